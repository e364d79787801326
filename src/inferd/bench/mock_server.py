"""`inferd mock-server`: an OpenAI-compatible endpoint with a known timing, to calibrate clients.

Schedule of one streaming request (times from the moment its body has been read):
    [role chunk]   chat with --role-chunk: {"role": "assistant", "content": ""} at once
    content        the first content chunk carries 1 token at TTFT; after it, chunks of
                   --tokens-per-chunk tokens; the chunk ending at token i goes at TTFT + TPOT * (i - 1)
    usage          with stream_options.include_usage, a usage-only chunk right after the last token
    [DONE]
Every chunk carries `usage` when the request asks for continuous_usage_stats. Output length: a
request's max_tokens with ignore_eos, else min(max_tokens, --output-len) (--output-len plays the
part of the point where the model would stop). Non-streaming requests answer at the last token's time.

Each send is awaited as an absolute deadline (no drift across a long stream), and its actual
time is logged with --log as JSONL: one line per request ({"id", "event": "request", "recv_ns",
...}) and one per chunk ({"id", "seq", "kind", "tokens", "sched_ns", "perf_ns", "epoch_ns"});
perf_ns is `time.perf_counter_ns()` just after the write, on the machine's monotonic clock.

Raw asyncio, no torch and no web framework: a chunk costs a timer wake-up and one socket write,
so a few hundred concurrent streams keep their schedule on two cores.

Test hooks: a prompt containing MOCK_HTTP_500 gets a 500; MOCK_BREAK closes the connection after the
first content chunk; MOCK_STREAM_ERROR sends an error event instead of the tokens.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from time import perf_counter_ns

from inferd.bench.loop import run as run_precise
from inferd.errors import openai_error

_TOKEN = " tok"


class MockServer:
    def __init__(self, ttft_ms: float = 200.0, tpot_ms: float = 20.0, output_len: int = 128,
                 tokens_per_chunk: int = 1, role_chunk: bool = False, log_path: str | None = None,
                 model: str = "mock"):
        if tokens_per_chunk < 1 or output_len < 0 or ttft_ms < 0 or tpot_ms < 0:
            raise ValueError("mock-server: --tokens-per-chunk >= 1 and non-negative times/lengths")
        self.ttft_ns = int(round(ttft_ms * 1e6))
        self.tpot_ns = int(round(tpot_ms * 1e6))
        self.output_len = output_len
        self.k = tokens_per_chunk
        self.role_chunk = role_chunk
        self.model = model
        self.log = open(log_path, "a", buffering=1 << 20) if log_path else None
        self.pending: list = []  # log records not yet written (written while no stream is running)
        self.active = 0
        self.n = 0
        self.tag = os.urandom(3).hex()  # ids stay unique when several runs append to one log
        self.server: asyncio.AbstractServer | None = None

    # -- HTTP --------------------------------------------------------------------------------
    def send_json(self, conn: "_Conn", status: int, obj, keep: bool, reason: str = "OK"):
        data = json.dumps(obj).encode()
        conn.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                   f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n".encode() + data)

    async def route(self, method, path, body, conn, recv_ns, keep) -> bool:
        if method == "GET" and path == "/health":
            self.send_json(conn, 200, {"status": "ok"}, keep)
            return True
        if method == "GET" and path == "/v1/models":
            self.send_json(conn, 200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                                     "owned_by": "inferd-mock"}]}, keep)
            return True
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                req = json.loads(body or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError:
                self.send_json(conn, 400, openai_error("request body is not valid JSON"), keep, "Bad Request")
                return True
            return await self.generate(req, path.endswith("chat/completions"), conn, recv_ns, keep)
        self.send_json(conn, 404, openai_error(f"no route {method} {path}", "not_found_error"), keep, "Not Found")
        return True

    # -- generation ---------------------------------------------------------------------------
    def plan(self, req: dict) -> int:
        mt = req.get("max_completion_tokens") or req.get("max_tokens")
        if mt is None:
            return self.output_len
        return int(mt) if req.get("ignore_eos") else min(int(mt), self.output_len)

    def chunk_ends(self, n: int) -> list[int]:
        """Token counts at the end of each content chunk: 1, 1+K, 1+2K, ..., n."""
        if n <= 0:
            return []
        ends = [1]
        while ends[-1] < n:
            ends.append(min(ends[-1] + self.k, n))
        return ends

    async def generate(self, req: dict, chat: bool, conn, recv_ns: int, keep: bool) -> bool:
        self.n += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-mock{self.tag}-{self.n}"
        n = self.plan(req)
        prompt = _prompt_text(req, chat)
        log = self.pending if self.log else None
        if log is not None:
            log.append({"id": rid, "event": "request", "recv_ns": recv_ns, "recv_epoch_ns": time.time_ns(),
                        "output_len": n, "chat": chat, "stream": bool(req.get("stream"))})
        self.active += 1
        try:
            return await self._generate(req, chat, conn, recv_ns, keep, rid, n, prompt, log)
        finally:
            self.active -= 1
            if self.log and (self.active == 0 or len(self.pending) > 200_000):
                self.flush_log()
            if self.active == 0:
                gc.collect()  # automatic collection is off (see serve_mock): collect while idle

    async def _generate(self, req, chat, conn, recv_ns, keep, rid, n, prompt, log) -> bool:
        prompt_tokens = len(prompt.split())
        created = int(time.time())
        if "MOCK_HTTP_500" in prompt:
            self.send_json(conn, 500, openai_error("mock failure", "server_error"), keep, "Internal Server Error")
            return True
        obj = "chat.completion" if chat else "text_completion"
        if not req.get("stream"):
            await _sleep_until(recv_ns + self.ttft_ns + self.tpot_ns * max(n - 1, 0))
            text = _TOKEN * n
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            self.send_json(conn, 200, {"id": rid, "object": obj, "created": created, "model": self.model,
                                         "choices": [choice], "usage": _usage(prompt_tokens, n)}, keep)
            if log is not None:
                t = perf_counter_ns()
                log.append({"id": rid, "seq": 0, "kind": "response", "tokens": n, "perf_ns": t,
                            "epoch_ns": time.time_ns(),
                            "sched_ns": recv_ns + self.ttft_ns + self.tpot_ns * max(n - 1, 0)})
            return True

        so = req.get("stream_options") or {}
        cont = bool(so.get("continuous_usage_stats"))
        incl = bool(so.get("include_usage"))
        head = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: " + (b"keep-alive" if keep else b"close") + b"\r\n\r\n"]
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        pre = (f'{{"id": "{rid}", "object": "{chunk_obj}", "created": {created}, '
               f'"model": {json.dumps(self.model)}, "choices": [')
        seq = 0
        transport = conn.transport

        def send(payload: str, kind: str, tokens: int, sched: int) -> bool:
            """One SSE event as one HTTP chunk, in one write (the response head goes with the first)."""
            nonlocal seq
            if transport.is_closing():
                return False
            data = f"data: {payload}\n\n".encode()
            if head:
                transport.write(head.pop() + b"%x\r\n%b\r\n" % (len(data), data))
            else:
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            if log is not None:
                log.append((rid, seq, kind, tokens, sched, perf_counter_ns(), time.time_ns()))
            seq += 1
            return True

        def usage_tail(ct: int) -> str:
            if not cont:
                return ""
            return (f', "usage": {{"prompt_tokens": {prompt_tokens}, "completion_tokens": {ct}, '
                    f'"total_tokens": {prompt_tokens + ct}}}')

        if chat and self.role_chunk:
            send(pre + f'{{"index": 0, "delta": {{"role": "assistant", "content": ""}}, "logprobs": null, '
                       f'"finish_reason": null}}]{usage_tail(0)}}}', "role", 0, recv_ns)
        if "MOCK_STREAM_ERROR" in prompt:
            await _sleep_until(recv_ns + self.ttft_ns)
            send(json.dumps(openai_error("mock error inside the stream", "server_error")), "error", 0,
                 recv_ns + self.ttft_ns)
            n = 0
        prev = 0
        ends = self.chunk_ends(n)
        for j, end in enumerate(ends):
            sched = recv_ns + self.ttft_ns + self.tpot_ns * (end - 1)
            await _sleep_until(sched)
            text = _TOKEN * (end - prev)
            fin = '"length"' if j == len(ends) - 1 else "null"
            if chat:
                role = '"role": "assistant", ' if j == 0 and not self.role_chunk else ""
                ch = f'{{"index": 0, "delta": {{{role}"content": "{text}"}}, "logprobs": null, "finish_reason": {fin}}}'
            else:
                ch = f'{{"index": 0, "text": "{text}", "logprobs": null, "finish_reason": {fin}, "stop_reason": null}}'
            if not send(pre + ch + "]" + usage_tail(end) + "}", "content", end, sched):
                return False
            prev = end
            if "MOCK_BREAK" in prompt:
                transport.write(b"5\r\ndata:")  # a torn chunk, then the connection goes
                transport.close()
                return False
            if conn.paused is not None:
                await conn.paused
        t_last = recv_ns + self.ttft_ns + self.tpot_ns * max(n - 1, 0)
        if incl:
            send(pre + f'], "usage": {json.dumps(_usage(prompt_tokens, n))}}}', "usage", n, t_last)
        send("[DONE]", "done", n, t_last)
        transport.write(b"0\r\n\r\n")
        return True

    def flush_log(self):
        """Write the pending records (formatting them costs more than sending the chunks did)."""
        recs, self.pending = self.pending, []
        out = []
        for r in recs:
            if isinstance(r, dict):
                out.append(json.dumps(r))
            else:
                out.append('{"id": "%s", "seq": %d, "kind": "%s", "tokens": %d, "sched_ns": %d, "perf_ns": %d, '
                           '"epoch_ns": %d}' % r)
        if out:
            self.log.write("\n".join(out) + "\n")
            self.log.flush()

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Conn(self), host, port, backlog=4096)
        return self.server.sockets[0].getsockname()[1]


class _Conn(asyncio.Protocol):
    """One client connection: HTTP/1.1 requests parsed as they arrive, answered one at a time."""

    def __init__(self, srv: MockServer):
        self.srv = srv
        self.transport = None
        self.buf = b""
        self.busy = False
        self.paused: asyncio.Future | None = None

    def connection_made(self, transport):
        self.transport = transport

    def write(self, data: bytes):
        if not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data):
        t = perf_counter_ns()  # the request's arrival: its schedule counts from here
        self.buf += data
        if not self.busy:
            self._next(t)

    def _next(self, t: int):
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            if len(self.buf) > 1 << 16:
                self.transport.close()
            return
        lines = self.buf[:i].decode("latin-1").split("\r\n")
        try:
            method, path, version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length") or 0)
        except ValueError:
            self.transport.close()
            return
        if len(self.buf) < i + 4 + n:
            return
        body, self.buf = self.buf[i + 4: i + 4 + n], self.buf[i + 4 + n:]
        keep = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        self.busy = True
        task = asyncio.get_running_loop().create_task(
            self.srv.route(method, path.split("?", 1)[0], body, self, t, keep))
        task.add_done_callback(lambda f, keep=keep: self._done(f, keep))

    def _done(self, fut, keep):
        self.busy = False
        ok = not fut.cancelled() and fut.exception() is None and fut.result()
        if not ok or not keep:
            self.transport.close()
        elif self.buf:
            self._next(perf_counter_ns())

    def pause_writing(self):
        if self.paused is None:
            self.paused = asyncio.get_running_loop().create_future()

    def resume_writing(self):
        if self.paused is not None:
            if not self.paused.done():
                self.paused.set_result(None)
            self.paused = None

    def connection_lost(self, exc):
        self.resume_writing()


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _prompt_text(req: dict, chat: bool) -> str:
    if chat:
        parts = []
        for m in req.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(str(c or ""))
        return " ".join(parts)
    p = req.get("prompt", "")
    if isinstance(p, list):
        return " ".join(str(x) for x in p)
    return str(p)


async def _sleep_until(deadline_ns: int) -> None:
    """Sleep until an absolute time on the perf_counter clock (never a relative chain of sleeps)."""
    delay = deadline_ns - perf_counter_ns()
    if delay > 0:
        await asyncio.sleep(delay / 1e9)


async def serve_mock(args) -> int:
    gc.collect()
    gc.freeze()
    gc.disable()  # a gen-2 pass in the middle of 256 streams would delay their chunks by milliseconds
    srv = MockServer(args.ttft_ms, args.tpot_ms, args.output_len, args.tokens_per_chunk, args.role_chunk,
                     args.log, args.served_model_name)
    port = await srv.start(args.host, args.port)
    print(f"inferd mock-server: listening on http://{args.host}:{port} (TTFT {args.ttft_ms:g} ms, "
          f"TPOT {args.tpot_ms:g} ms, {args.output_len} tokens, {args.tokens_per_chunk} per chunk"
          f"{', role chunk' if args.role_chunk else ''})", flush=True)
    try:
        async with srv.server:
            await srv.server.serve_forever()
    finally:
        if srv.log:
            srv.log.close()
    return 0


def main(args) -> int:
    try:
        return run_precise(serve_mock(args))
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        sys.stderr.write(f"inferd: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}\n")
        return 2

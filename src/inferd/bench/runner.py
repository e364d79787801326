"""Run a benchmark: send the prompts on their schedule, record every SSE event, build the trace.

Per request the runner notes four client times (ns since the run's start, t0):
    sched_ns     when the arrival schedule wanted it sent
    dispatch_ns  when the dispatcher actually got to it (dispatch - sched = send lag)
    slot_ns      when it got a --max-concurrency slot (slot - dispatch = slot wait)
    send_ns      just before its connection was taken and the request written
and the arrival time of every SSE event. JSON is parsed only after the run, so the hot path is
the arrival timestamp, de-chunking and an SSE split.
"""
from __future__ import annotations

import asyncio
import gc
import json
import time
from time import perf_counter_ns, process_time_ns

from inferd.bench.http import Client, Response
from inferd.bench.loop import run as run_precise
from inferd.bench.progress import TICK_S

LOOP_LAG_INTERVAL_NS = 10_000_000
MAX_PRECONNECT = 1024
TRACE_FORMAT = "inferd-bench-trace"
TRACE_VERSION = 1


async def sleep_until(deadline_ns: int) -> None:
    delay = deadline_ns - perf_counter_ns()
    if delay > 0:
        await asyncio.sleep(delay / 1e9)


# Anthropic's API requires max_tokens: a request whose dataset names no output length gets this
MESSAGES_MAX_TOKENS = 1024
ENDPOINT_TYPES = ("completions", "chat", "responses", "messages", "embeddings")


def endpoint_type(endpoint: str) -> str:
    """The API an endpoint path speaks, for --endpoint-type auto (embeddings: /v1/embeddings, /pooling,
    /api/embed: one answer, no output tokens; latency is the whole request's)."""
    if "embed" in endpoint or endpoint.rstrip("/").endswith("/pooling"):
        return "embeddings"
    for kind, part in (("chat", "chat"), ("responses", "responses"), ("messages", "messages")):
        if part in endpoint:
            return kind
    return "completions"


def request_body(cfg: dict, prompt: str, output_len: int | None, messages: list | None = None) -> bytes:
    kind = cfg["endpoint_type"]
    body: dict = {"model": cfg["model"]} if cfg.get("model") else {}
    if kind == "embeddings":  # one forward, one JSON answer: no stream, no output tokens
        body["input"] = prompt
        for k, v in (cfg.get("extra_body") or {}).items():
            body.pop(k, None) if v is None else body.__setitem__(k, v)
        return json.dumps(body).encode()
    if kind in ("chat", "messages"):
        body["messages"] = messages or [{"role": "user", "content": prompt}]
    elif kind == "responses":
        body["input"] = messages or prompt
        body["store"] = False  # nothing kept on the server for a benchmark's requests
    else:
        body["prompt"] = prompt
    if output_len is not None:
        body[{"responses": "max_output_tokens"}.get(kind, "max_tokens")] = output_len
        body["ignore_eos"] = True
    elif kind == "messages":
        body["max_tokens"] = MESSAGES_MAX_TOKENS
    body["stream"] = True
    if kind in ("completions", "chat"):  # the other APIs tell the output's tokens once, at the end
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    for k, v in (cfg.get("extra_body") or {}).items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return json.dumps(body).encode()


async def _run(cfg: dict, bodies: list[bytes], offsets_ns: list[int], warmup_bodies: list[bytes],
               progress=None, on_start=None) -> dict:
    headers = None
    if cfg["endpoint_type"] == "messages":  # what Anthropic's API asks of every request
        headers = {"anthropic-version": "2023-06-01", **({"x-api-key": cfg["api_key"]} if cfg.get("api_key") else {})}
    client = Client(cfg["base_url"], cfg.get("api_key"), headers)
    path = cfg["endpoint"]
    timeout = cfg.get("timeout")
    conc = cfg.get("max_concurrency")
    sem = asyncio.Semaphore(conc) if conc else None
    raw: list = [None] * len(bodies)

    async def one(i, body, sched, store, warm=False):
        dispatch = perf_counter_ns()
        if sem is not None:
            async with sem:
                slot = perf_counter_ns()
                send, resp, kind, err = await client.post(path, body, timeout)
        else:
            slot = dispatch
            send, resp, kind, err = await client.post(path, body, timeout)
        end = resp.end_ns if resp is not None and resp.end_ns is not None else perf_counter_ns()
        store[i] = (sched, dispatch, slot, send, end, resp, kind, err, warm)
        if progress is not None and not warm:
            progress.finished.append(i)

    warm_raw: list = [None] * len(warmup_bodies)
    if warmup_bodies:
        now = perf_counter_ns()
        await asyncio.gather(*(one(i, b, now, warm_raw, True) for i, b in enumerate(warmup_bodies)))

    if conc:  # one kept-alive connection per slot, opened before the clock starts
        try:
            await client.preconnect(min(conc, len(bodies), MAX_PRECONNECT))
        except (OSError, asyncio.TimeoutError):
            pass  # the timed requests will connect (and report the failure) themselves
    if on_start is not None:
        on_start()  # e.g. a /metrics scrape: nothing is in flight, and the clock has not started
    lags: list[int] = []
    stop = asyncio.Event()

    async def monitor():
        deadline = perf_counter_ns() + LOOP_LAG_INTERVAL_NS
        while not stop.is_set():
            await sleep_until(deadline)
            now = perf_counter_ns()
            lags.append(now - deadline)
            deadline += LOOP_LAG_INTERVAL_NS
            if deadline < now:
                deadline = now + LOOP_LAG_INTERVAL_NS

    async def ticker():
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            progress.tick(raw, perf_counter_ns())

    t0 = perf_counter_ns() + 20_000_000  # a little lead, so that request 0 is not late by construction
    t0_epoch = time.time_ns() + (t0 - perf_counter_ns())
    cpu0 = process_time_ns()
    mon = asyncio.create_task(monitor())
    if progress is not None:
        progress.start(t0)
        tick = asyncio.create_task(ticker())
    tasks = []
    for i, off in enumerate(offsets_ns):
        due = t0 + off
        if due > perf_counter_ns():
            await sleep_until(due)
        tasks.append(asyncio.create_task(one(i, bodies[i], due, raw)))
    await asyncio.gather(*tasks)
    wall = perf_counter_ns() - t0
    cpu = process_time_ns() - cpu0
    stop.set()
    await mon
    if progress is not None:
        tick.cancel()
        progress.close(raw, perf_counter_ns())
    client.close()
    return {"rx_timestamps": "kernel" if client.kernel_timestamps else "user", "t0": t0, "t0_epoch": t0_epoch, "raw": raw, "warm": warm_raw, "lags": lags, "wall": wall, "cpu": cpu}


def _openai_chunk(d: dict, kind: str) -> tuple:
    """One chunk of a completions or chat stream: (kind, text, role, completion_tokens, usage)."""
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else None
    ct = usage.get("completion_tokens") if usage else None
    choices = d.get("choices") or []
    if not choices:
        return "usage" if usage else "empty", "", None, ct, usage
    c = choices[0]
    if kind == "chat":
        delta = c.get("delta") or {}
        return "choice", (delta.get("content") or "") + (delta.get("reasoning_content") or ""), delta.get("role"), \
            ct, usage
    return "choice", c.get("text") or "", None, ct, usage


_RESPONSES_TEXT = ("response.output_text.delta", "response.reasoning_text.delta",
                   "response.function_call_arguments.delta")
_RESPONSES_END = ("response.completed", "response.incomplete")


def _dialect_event(d: dict, kind: str) -> tuple:
    """One event of a Responses or Messages stream as (kind, text, role, completion_tokens, usage,
    error): its text deltas are content (reasoning and tool arguments too, as chat's), its closing
    event carries the usage; TTFT and TPOT are then read exactly as for chat."""
    t = d.get("type")
    if kind == "responses":
        if t in _RESPONSES_TEXT:
            return "choice", d.get("delta") or "", None, None, None, None
        if t == "response.created":
            return "choice", "", "assistant", None, None, None
        if t in _RESPONSES_END:
            u = (d.get("response") or {}).get("usage") or {}
            usage = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens")}
            return "usage", "", None, usage["completion_tokens"], usage, None
        if t in ("response.failed", "error"):
            e = (d.get("response") or {}).get("error") or d
            return "error", "", None, None, None, e.get("message", str(e)) if isinstance(e, dict) else str(e)
        return "empty", "", None, None, None, None
    if t == "content_block_delta":
        delta = d.get("delta") or {}
        text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
        return "choice", text, None, None, None, None
    if t == "message_start":
        u = (d.get("message") or {}).get("usage") or {}
        return "choice", "", "assistant", None, {"prompt_tokens": u.get("input_tokens")}, None
    if t == "message_delta":
        u = d.get("usage") or {}
        total_in = sum(u.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                                "cache_creation_input_tokens"))
        usage = {"completion_tokens": u.get("output_tokens"), "prompt_tokens": total_in or None}
        return "usage", "", None, usage["completion_tokens"], usage, None
    if t == "error":
        e = d.get("error") or {}
        return "error", "", None, None, None, e.get("message", str(e)) if isinstance(e, dict) else str(e)
    return "empty", "", None, None, None, None


def parse_events(resp: Response, kind: str) -> dict:
    """Raw SSE payloads -> trace events, output tokens (from usage), text, errors. `kind`: the
    endpoint type (completions, chat, responses, messages)."""
    chunks = []  # (t, kind0, text, role, completion_tokens or None)
    rid = None
    err = None
    prompt_tokens = None
    done = False
    for t, payload in resp.events:
        if payload == b"[DONE]":
            chunks.append((t, "done", "", None, None))
            done = True
            continue
        try:
            d = json.loads(payload)
        except ValueError:
            chunks.append((t, "error", "", None, None))
            err = err or f"bad JSON in stream: {payload[:80]!r}"
            continue
        if not isinstance(d, dict):
            continue
        if kind in ("responses", "messages"):
            k, text, role, ct, usage, e = _dialect_event(d, kind)
            rid = rid or d.get("id") or (d.get("response") or d.get("message") or {}).get("id")
            if e is not None:
                chunks.append((t, "error", "", None, None))
                err = err or "error event in stream: " + e
                continue
            if usage and usage.get("prompt_tokens") is not None:
                prompt_tokens = usage["prompt_tokens"]
            chunks.append((t, k, text, role, ct))
            if d.get("type") in _RESPONSES_END or d.get("type") == "message_stop":
                chunks.append((t, "done", "", None, None))
                done = True
            continue
        if d.get("error") is not None and not d.get("choices"):
            e = d["error"]
            chunks.append((t, "error", "", None, None))
            err = err or "error event in stream: " + (e.get("message", str(e)) if isinstance(e, dict) else str(e))
            continue
        rid = rid or d.get("id")
        k, text, role, ct, usage = _openai_chunk(d, kind)
        if usage and usage.get("prompt_tokens") is not None:
            prompt_tokens = usage["prompt_tokens"]
        chunks.append((t, k, text, role, ct))
    # per-chunk token counts are trusted when every chunk with text carried usage
    choice = [c for c in chunks if c[1] == "choice"]
    known = any(c[4] is not None for c in choice) and all(c[4] is not None for c in choice if c[2])
    events, prev, last_ct = [], 0, None
    for t, k, text, role, ct in chunks:
        if ct is not None:
            last_ct = ct if last_ct is None else max(last_ct, ct)
        if k != "choice":
            n = None
            if known and ct is not None and k == "usage":
                n = ct - prev
            events.append([t, k, n, 0])
            continue
        if known:
            n = (ct - prev) if ct is not None else 0
            if ct is not None:
                prev = ct
            kind0 = "content" if n > 0 else ("role" if role else "empty")
            events.append([t, kind0, n if kind0 == "content" else None, len(text)])
        else:
            kind0 = "content" if text else ("role" if role else "empty")
            events.append([t, kind0, None, len(text)])
    return {"events": events, "text": "".join(c[2] for c in chunks), "completion_tokens": last_ct,
            "prompt_tokens": prompt_tokens, "response_id": rid, "error": err, "done": done}


def parse_embeddings(resp: Response) -> dict:
    """An embeddings answer: its latency is the whole request's (no first token); usage counts the
    input tokens the server embedded."""
    body = b"".join(resp.body)
    try:
        d = json.loads(body)
        n = len(d["data"] if "data" in d else d["embeddings"])
    except (ValueError, KeyError, TypeError):
        return {"events": [], "text": "", "completion_tokens": None, "prompt_tokens": None, "response_id": None,
                "error": f"unexpected response body: {body[:100]!r}", "done": False}
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else {}
    return {"events": [], "text": "", "completion_tokens": 0, "response_id": d.get("id"), "error": None,
            "prompt_tokens": usage.get("prompt_tokens", d.get("prompt_eval_count")), "done": n > 0}


def _plain_text(d: dict, kind: str) -> str:
    if kind == "responses":
        return "".join(c.get("text") or "" for item in d.get("output") or () if item.get("type") == "message"
                       for c in item.get("content") or ())
    if kind == "messages":
        return "".join(b.get("text") or "" for b in d.get("content") or ())
    c = d["choices"][0]
    return ((c.get("message") or {}).get("content") if kind == "chat" else c.get("text")) or ""


def parse_plain(resp: Response, kind: str) -> dict:
    """A 200 answer that is not an event stream (a server that ignored stream=true)."""
    body = b"".join(resp.body)
    try:
        d = json.loads(body)
        text = _plain_text(d, kind)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return {"events": [], "text": "", "completion_tokens": None, "prompt_tokens": None, "response_id": None,
                "error": f"unexpected response body: {body[:100]!r}", "done": False}
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else {}
    ct = usage.get("completion_tokens", usage.get("output_tokens"))
    ev = [[resp.end_ns, "content" if (ct or text) else "empty", ct if ct else None, len(text)]]
    return {"events": ev, "text": text, "completion_tokens": ct,
            "prompt_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
            "response_id": d.get("id"), "error": None, "done": True}


def _http_error(resp: Response) -> str:
    body = b"".join(resp.body)
    msg = body[:200].decode("utf-8", "replace")
    try:
        e = json.loads(body)
        e = e.get("error", e) if isinstance(e, dict) else e
        msg = e.get("message", msg) if isinstance(e, dict) else str(e)
    except ValueError:
        pass
    return f"HTTP {resp.status}: {msg}".strip()


def build_record(i: int, item, t0: int, prompt, endpoint_type: str, tokenizer) -> dict:
    sched, dispatch, slot, send, end, resp, kind, err, warm = item
    rec = {"type": "request", "index": i, "warmup": warm, "prompt_len": prompt.prompt_len,
           "output_len": prompt.output_len, "sched_ns": sched - t0, "dispatch_ns": dispatch - t0,
           "slot_ns": slot - t0, "send_ns": send - t0, "end_ns": end - t0, "ok": False,
           "error_kind": kind, "error": err, "http_status": None, "response_id": None, "prompt_tokens": None,
           "output_tokens": None, "output_tokens_source": None, "rx_delay_max_ns": None, "events": [], "text": ""}
    if getattr(prompt, "klass", None) is not None:  # a request class (--dataset mixed): per-class metrics
        rec["class"] = prompt.klass
    if resp is not None:
        rec["rx_delay_max_ns"] = resp.rx_delay_max
    if resp is not None and resp.status is not None and resp.status != 200 and kind is None:
        rec.update(error_kind="http", http_status=resp.status, error=_http_error(resp))
        return rec
    if resp is None or resp.status is None:
        return rec
    p = (parse_embeddings(resp) if endpoint_type == "embeddings" else parse_events(resp, endpoint_type) if resp.sse
         else parse_plain(resp, endpoint_type))
    for e in p["events"]:
        e[0] -= t0
    rec.update(events=p["events"], text=p["text"], response_id=p["response_id"], prompt_tokens=p["prompt_tokens"])
    if kind is not None:  # timeout or broken stream: keep what arrived, but it failed
        return rec
    if p["error"]:
        rec.update(error_kind="server", error=p["error"])
        return rec
    if p["completion_tokens"] is not None:
        rec.update(output_tokens=p["completion_tokens"], output_tokens_source="usage")
    elif tokenizer is not None:
        rec.update(output_tokens=len(tokenizer.encode(p["text"], add_special_tokens=False)),
                   output_tokens_source="tokenizer")
    else:
        rec.update(output_tokens=sum(1 for e in p["events"] if e[1] == "content"), output_tokens_source="chunks")
    rec.update(ok=True, error_kind=None, error=None)
    return rec


def run_benchmark(cfg: dict, prompts: list, offsets_ns: list[int], tokenizer=None,
                  warnings: list[str] | None = None, progress=None, on_start=None) -> list[dict]:
    """Run and return the trace as a list of JSON-ready records: header, requests..., footer.
    `progress` (a bench.progress.Progress) is redrawn during the run; `on_start()` is called after
    the warm-up, just before the clock starts."""
    bodies = [request_body(cfg, p.prompt, p.output_len, getattr(p, "messages", None)) for p in prompts]
    nw = cfg.get("warmup") or 0
    warm_prompts = [prompts[i % len(prompts)] for i in range(nw)] if prompts else []
    warm_bodies = bodies[:nw] if nw <= len(bodies) else [bodies[i % len(bodies)] for i in range(nw)]
    # No cyclic GC inside the timed run: a gen-2 pass can stall the loop for 5-20 ms, delaying every
    # timestamp taken meanwhile. A run makes almost no cyclic garbage (~500 objects per 2,000
    # requests); reference counting frees the rest.
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        out = run_precise(_run(cfg, bodies, offsets_ns, warm_bodies, progress, on_start))
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
    kind = cfg["endpoint_type"]
    t0 = out["t0"]
    header = {"type": "header", "format": TRACE_FORMAT, "version": TRACE_VERSION,
              "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(out["t0_epoch"] / 1e9)),
              "t0_perf_ns": t0, "t0_epoch_ns": out["t0_epoch"], "rx_timestamps": out["rx_timestamps"],
              "config": {k: v for k, v in cfg.items() if k != "api_key"}, "warnings": list(warnings or [])}
    recs = [build_record(i, it, t0, warm_prompts[i], kind, tokenizer) for i, it in enumerate(out["warm"])]
    recs += [build_record(i, it, t0, prompts[i], kind, tokenizer) for i, it in enumerate(out["raw"])]
    footer = {"type": "footer", "wall_ns": out["wall"], "cpu_ns": out["cpu"],
              "loop_lag_interval_ns": LOOP_LAG_INTERVAL_NS, "loop_lag_ns": out["lags"]}
    return [header, *recs, footer]


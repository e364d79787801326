"""What the generation endpoints share: the served model, running its requests on the engine, and
the one path from a chunk stream to a response.

Each endpoint writes a single async generator of the chunks its SSE stream sends. A streaming
request sends them as they come; a non-streaming one folds the same chunks into one body, so the
two answers cannot drift apart.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from inferd.engine.client import EngineClient, EngineDead, Overloaded
from inferd.engine.processor import resolve_max_tokens
from inferd.errors import InferdError
from inferd.server.protocol import ApiError, check_parts

# When the HTTP request reached the server (time.monotonic()). Set by the outermost middleware and
# read where the engine request is made (several calls down, in a streaming task that inherits the
# context), so that the server's TTFT/E2E/queue histograms cover what a client sees: HTTP parsing,
# tokenization and the wait for the engine thread's current step, not only the engine's part.
log = logging.getLogger("inferd")

ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("inferd_arrival", default=None)

Chunk = dict[str, Any]


class Served:
    """The model behind the API: its names, tokenizer, context length and engine."""

    def __init__(self, llm: EngineClient, name: str, limits=None):
        self.llm = llm
        self.limits = limits
        self.info = llm.info
        self.tok = self.info.tokenizer
        self.name = name
        self.max_len = self.info.max_model_len
        self.stall_timeout = limits.stall_timeout_s if limits is not None else None
        self.prompt_details = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
        self.lora: str | None = None  # the LoRA adapter its requests run with (a request that names one)
        self.reasoning_parser: str | None = None  # --reasoning-parser: splits <think> text from answers

    def with_adapter(self, name: str) -> "Served":
        """The same model answering as LoRA adapter `name` (vLLM's: the adapter is the `model`)."""
        import copy

        view = copy.copy(self)
        view.name, view.lora = name, name
        return view

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int = 0, details: bool = False) -> dict:
        u = usage(prompt_tokens, completion_tokens)
        if self.prompt_details or details:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        return u

    def render_chat(self, messages, add_generation_prompt=True, kwargs=None, tools=None, tool_choice=None) -> list[int]:
        from inferd.server.tools import render_messages, template_knows_tools

        check_parts(messages, self.info.modalities, self.name)
        msgs, extra = render_messages(messages, tools, tool_choice, template_knows_tools(self.tok.chat_template))
        return self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **{**(kwargs or {}), **extra})

    def check_vocab(self, prompts: list[list[int]], nested: bool):
        """Token ids a client gave are this model's (negative ones never parse: protocol.check_prompt)."""
        vocab = self.info.vocab_size
        for i, ids in enumerate(prompts):
            for j, t in enumerate(ids):
                if t >= vocab:
                    where = f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"
                    raise ApiError(f"{where} is {t}: past the vocabulary of model `{self.name}` (token ids 0 to "
                                   f"{vocab - 1})", param="prompt")

    def token_str(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def require_runner(self, runner: str):
        """A generation route to an embedding model, or an embedding route to a generating one: a 400
        saying which the model answers."""
        have = getattr(self.info, "runner", "generate")
        if have == runner:
            return
        if have == "pooling":
            raise ApiError(f"model `{self.name}` is an embedding model: it answers /v1/embeddings, /pooling and "
                           "/api/embed, not text generation", param="model")
        raise ApiError(f"model `{self.name}` generates text and has no embeddings: serve an embedding model, or "
                       "this one with --runner pooling", param="model")

    def max_tokens_for(self, req_max: int | None, n_prompt: int, ceiling: bool = False) -> int:
        """`ceiling`: the request's max_tokens bounds the output rather than demands it (Anthropic's and
        the Responses API's meaning): past the context it stops at the context's end."""
        self.require_runner("generate")
        try:
            return resolve_max_tokens(req_max, n_prompt, self.max_len, clamp=ceiling)
        except InferdError as e:
            raise ApiError(str(e), param="max_tokens") from None

    async def run_one(self, prompt_ids, params, rid, kv_transfer_params=None):
        """All outputs of one engine request, mapped to 503 / 400 as needed."""
        kw = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        if self.lora is not None:
            kw["lora"] = self.lora
        try:
            async for out in self.llm.generate(prompt_ids, params, rid, arrival=ARRIVAL.get(), **kw):
                if out.error:  # its step failed in the engine (which went on): a 500 of this request only
                    raise ApiError(f"the engine failed on this request: {out.error}", status=500,
                                   type_="server_error", code="internal_error")
                yield out
        except Overloaded:
            raise ApiError("server is overloaded: too many requests waiting; retry later", status=503,
                           type_="server_overloaded", code="overloaded", headers={"Retry-After": "1"}) from None
        except InferdError as e:
            raise ApiError(str(e)) from None
        except EngineDead as e:
            raise ApiError(str(e), status=503, type_="server_error", code="engine_dead") from None

    async def merged(self, prompts, params_for, base_id, kv_transfer_params=None):
        """Outputs of several prompts' requests, as they come: (prompt index, output)."""
        if len(prompts) == 1:
            async for out in self.run_one(prompts[0], params_for(0), f"{base_id}-0", kv_transfer_params):
                yield 0, out
            return
        if kv_transfer_params is not None:
            raise ApiError("kv_transfer_params apply to a request with one prompt", param="kv_transfer_params")
        q: asyncio.Queue = asyncio.Queue()
        DONE = object()

        async def pump(i, ids):
            try:
                async for out in self.run_one(ids, params_for(i), f"{base_id}-{i}"):
                    await q.put((i, out))
                await q.put((i, DONE))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await q.put((i, e))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is DONE:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprob_sum(entries) -> float:
    return sum(e[0] for e in entries or ())


# -- one path for stream and non-stream ---------------------------------------------------------
# A choice in a chunk may carry fields whose names start with "_": what the fold needs (the
# cumulative logprob for best_of, a chat choice's stop_reason) but the stream has never sent.

def _public(choice: dict) -> dict:
    return {k: v for k, v in choice.items() if not k.startswith("_")}


def _public_chunk(chunk: Chunk) -> Chunk:
    if any(k.startswith("_") for ch in chunk["choices"] for k in ch):
        chunk = {**chunk, "choices": [_public(ch) for ch in chunk["choices"]]}
    return chunk


def keep_best(choices: list[dict], n: int, k: int) -> list[dict]:
    """Of each prompt's k = best_of samples (choice index // k is the prompt), keep the n with the
    highest cumulative logprob; renumber them in order."""
    if k <= n:
        return choices
    kept = []
    for p in sorted({c["index"] // k for c in choices}):
        kept += sorted((c for c in choices if c["index"] // k == p), key=lambda c: -c["_cum"])[:n]
    for j, c in enumerate(kept):
        c["index"] = j
    return kept


async def fold(chunks: AsyncIterator[Chunk], obj: str, merge: Callable[[dict | None, dict], dict],
               n: int, k: int) -> dict:
    """The non-streaming body: every choice's chunks merged (merge(acc or None, choice) -> acc), the
    usage of the closing chunk, then the n best of best_of."""
    head, total, acc, kvp = None, None, {}, None
    async for c in chunks:
        head = head or c
        for ch in c["choices"]:
            acc[ch["index"]] = merge(acc.get(ch["index"]), ch)
        if "usage" in c:
            total = c["usage"]
        kvp = c.get("kv_transfer_params", kvp)
    choices = keep_best([acc[i] for i in sorted(acc)], n, k)
    body = {"id": head["id"], "object": obj, "created": head["created"], "model": head["model"],
            "choices": [_public(c) for c in choices], "usage": total}
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    return body


async def respond(req, params, chunks: Callable[[bool, bool], AsyncIterator[Chunk]], obj: str,
                  merge: Callable[[dict | None, dict], dict], stall_timeout: float | None = None):
    """`chunks(include_usage, continuous_usage)` is the endpoint's chunk stream: sent as SSE when the
    request streams, else folded into one `obj` body (always with the closing usage chunk), keeping
    the `params.n` best of its `params.num_samples` samples."""
    if req.stream:
        so = req.stream_options
        body = await primed(chunks(bool(so and so.include_usage), bool(so and so.continuous_usage_stats)))
        return SSEResponse(sse(body), stall_timeout)
    return await fold(chunks(True, False), obj, merge, params.n, params.num_samples)


class SSEResponse(StreamingResponse):
    """A text/event-stream whose client must keep reading: a write that waits on a full socket for
    longer than stall_timeout seconds ends the stream (its request is aborted, its KV blocks freed),
    so a client that stops reading cannot hold an engine slot without bound."""

    def __init__(self, content, stall_timeout: float | None, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type)
        self.stall_timeout = stall_timeout

    async def stream_response(self, send) -> None:
        if not self.stall_timeout:
            return await super().stream_response(send)

        async def timed(msg):
            try:
                await asyncio.wait_for(send(msg), self.stall_timeout)
            except asyncio.TimeoutError:
                raise _Stalled() from None

        try:
            await super().stream_response(timed)
        except _Stalled:
            log.warning("a client stopped reading its stream for %.0f s: request aborted", self.stall_timeout)
            await self.body_iterator.aclose()  # leaves the engine's generator: the request is aborted


class _Stalled(Exception):
    pass


async def primed(agen):
    """Run a stream up to its first chunk before the response starts, so that a request the engine
    refuses (400, 503) gets its status code instead of an error event inside a 200 stream."""
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        first = None

    async def rest():
        try:
            if first is not None:
                yield first
            async for c in agen:
                yield c
        finally:
            await agen.aclose()

    return rest()


async def translated(chunks: AsyncIterator[Chunk], start: Callable[[], list], feed: Callable[[Chunk], list],
                     finish: Callable[[], list]):
    """A dialect's events made from the chat stream by its translator (`start()`, `feed(chunk)`,
    `finish()`, each a list of events). Leaving it early (a client gone) closes the chat stream at
    once, which aborts the engine request and frees its blocks."""
    try:
        for ev in start():
            yield ev
        async for c in chunks:
            for ev in feed(c):
                yield ev
        for ev in finish():
            yield ev
    finally:
        await chunks.aclose()


async def framed(events, frame: Callable[[Any], str], on_error: Callable[[ApiError], str]):
    """A dialect's events, each framed as its wire format writes it (`event:`/`data:` SSE, NDJSON);
    an error after the stream started becomes the dialect's own error frame, which ends it."""
    try:
        async for ev in events:
            yield frame(ev)
    except ApiError as e:
        yield on_error(e)
    finally:
        await events.aclose()


def sse_event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse(chunks):
    """SSE framing; an error after the stream started becomes an error event, then [DONE]."""
    try:
        async for c in chunks:
            yield f"data: {json.dumps(_public_chunk(c), ensure_ascii=False)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"

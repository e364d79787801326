"""The OpenAI-compatible HTTP API over AsyncLLM (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions (streaming and not), /v1/models, /health, /metrics,
/tokenize, /detokenize. Every failure a client can cause is an OpenAI error body with a 4xx;
past --max-waiting queued requests the answer is 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferd.engine.async_engine import AsyncLLM, Overloaded
from inferd.errors import InferdError
from inferd.server.metrics import Metrics
from inferd.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)


# When the HTTP request reached the server (time.monotonic()). Set by the outermost middleware and
# read where the engine request is made (several calls down, in a streaming task that inherits the
# context), so that the server's TTFT/E2E/queue histograms cover what a client sees: HTTP parsing,
# tokenization and the wait for the engine thread's current step, not only the engine's part.
_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("inferd_arrival", default=None)


def create_app(llm: AsyncLLM, served_name: str, api_key: str | None = None,
               metrics: Metrics | None = None, aliases: set[str] | None = None) -> FastAPI:
    app = FastAPI(title="inferd", docs_url=None, redoc_url=None)
    engine = llm.engine
    tok = engine.tokenizer
    names = {served_name} | set(aliases or ())
    max_len = engine.max_model_len

    # -- errors ---------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "request body is not valid JSON", ""
        return JSONResponse(ApiError(f"{loc}: {msg}" if loc else msg, param=loc or None).body(), status_code=400)

    @app.exception_handler(InferdError)
    async def _inferd_error(_, e: InferdError):
        return JSONResponse(ApiError(str(e)).body(), status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        _ARRIVAL.set(time.monotonic())
        if api_key and not request.url.path.startswith(("/health", "/metrics")):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = ApiError("invalid or missing API key", status=401, type_="authentication_error",
                             code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    def check_model(name: str | None):
        if name is not None and name not in names:
            raise ApiError(f"The model `{name}` does not exist.", status=404, param="model",
                           code="model_not_found", type_="not_found_error")

    # -- plain routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if llm.dead:
            return JSONResponse({"status": "error", "detail": llm.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        if metrics is None:
            return Response("", media_type="text/plain")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "inferd", "max_model_len": max_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if req.messages is not None:
            ids = render_chat(req.messages, req.add_generation_prompt)
        else:
            ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.model_config.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    def render_chat(messages, add_generation_prompt=True, kwargs=None) -> list[int]:
        msgs = []
        for m in messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            d = {"role": m.role, "content": content or ""}
            msgs.append(d)
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True,
                                       **(kwargs or {}))

    # -- generation -----------------------------------------------------------------------------
    async def run_one(prompt_ids, params, rid):
        """All outputs of one engine request, mapped to 503 / 400 as needed."""
        try:
            async for out in llm.generate(prompt_ids, params, rid, arrival=_ARRIVAL.get()):
                yield out
        except Overloaded:
            raise ApiError("server is overloaded: too many requests waiting; retry later", status=503,
                           type_="server_overloaded", code="overloaded", headers={"Retry-After": "1"}) from None
        except InferdError as e:
            raise ApiError(str(e)) from None

    async def merged(prompts, params_for, base_id):
        """Outputs of several prompts' requests, as they come: (prompt index, output)."""
        if len(prompts) == 1:
            async for out in run_one(prompts[0], params_for(0), f"{base_id}-0"):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()
        DONE = object()

        async def pump(i, ids):
            try:
                async for out in run_one(ids, params_for(i), f"{base_id}-{i}"):
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

    def usage(prompt_tokens, completion_tokens):
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def token_str(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def completion_logprobs(entries, ids, offset0):
        """OpenAI completions format for (logprob, rank, alts) entries (None = no logprob)."""
        tokens, lps, tops, offs = [], [], [], []
        off = offset0
        for t, e in zip(ids, entries):
            s = token_str(t)
            tokens.append(s)
            offs.append(off)
            off += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(e[0])
                top = {token_str(a): b for a, b in e[2]}
                top.setdefault(s, e[0])
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def chat_logprobs(entries, ids):
        content = []
        for t, e in zip(ids, entries):
            s = token_str(t)
            content.append({"token": s, "logprob": e[0], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_str(a), "logprob": b, "bytes": list(token_str(a).encode())}
                                             for a, b in e[2]]})
        return {"content": content}

    def max_tokens_for(req_max, n_prompt):
        if req_max is None:
            return max(1, max_len - n_prompt)  # vLLM's default: the rest of the context
        return req_max

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [tok.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tok.encode(x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise ApiError("prompt must be a non-empty string, list of strings, or token ids", param="prompt")
        if req.max_tokens is not None and req.max_tokens < 0:
            raise ApiError("max_tokens must be at least 0", param="max_tokens")
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise ApiError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise ApiError("logprobs must be in [0, 20]", param="logprobs")
        want_prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None

        def params_for(i):
            mt = 1 if score_only else max_tokens_for(req.max_tokens, len(prompts[i]))
            return req.sampling_params(mt, req.logprobs, want_prompt_lp)

        params_for(0)  # validate before anything is queued
        n = req.n
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompt_tokens = sum(len(x) for x in prompts)

        def choice_index(i, out):
            return i * n + out.index

        if req.stream:
            body = await _primed(stream_completions(cid, created, prompts, params_for, n, req, score_only,
                                                    prompt_tokens))
            return StreamingResponse(_sse(body), media_type="text/event-stream")

        finals: dict[int, dict] = {}
        gen_lps: dict[int, list] = {}
        prompt_lps: dict[int, list] = {}
        completion_tokens = 0
        async for i, out in merged(prompts, params_for, cid):
            ci = choice_index(i, out)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            if out.logprobs:
                gen_lps.setdefault(ci, []).extend(out.logprobs)
            if out.finished:
                completion_tokens += 0 if score_only else len(out.output_ids)
                finals[ci] = {"i": i, "out": out}
        choices = []
        best_of = req.best_of or n
        for ci in sorted(finals):
            i, out = finals[ci]["i"], finals[ci]["out"]
            text = "" if score_only else out.text
            ids = [] if score_only else list(out.output_ids)
            lps = [] if score_only else gen_lps.get(ci, [])
            prefix = ""
            if req.echo:
                prefix = tok.decode(prompts[i])
                text = prefix + text
            logprobs = None
            if req.logprobs is not None:
                ent = ([None] + list(prompt_lps.get(i, [None])[1:]) if req.echo else []) + lps
                all_ids = (prompts[i] if req.echo else []) + ids
                logprobs = completion_logprobs(ent, all_ids, 0)
            choices.append({"index": ci, "text": text, "logprobs": logprobs,
                            "finish_reason": "length" if score_only else out.finish_reason,
                            "stop_reason": out.stop_reason, "_cum": sum(e[0] for e in gen_lps.get(ci, []))})
        if best_of > n:  # keep the n best of each prompt's best_of samples
            kept = []
            for i in range(len(prompts)):
                mine = sorted([c for c in choices if c["index"] // best_of == i], key=lambda c: -c["_cum"])[:n]
                kept.extend(mine)
            choices = kept
            for j, c in enumerate(choices):
                c["index"] = j
        for c in choices:
            c.pop("_cum", None)
        return {"id": cid, "object": "text_completion", "created": created, "model": served_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def stream_completions(cid, created, prompts, params_for, n, req, score_only, prompt_tokens):
        so = req.stream_options or None
        completion_tokens = 0
        echoed = set()
        async for i, out in merged(prompts, params_for, cid):
            ci = i * n + out.index
            text = "" if score_only else out.text_delta
            ids = [] if score_only else out.new_token_ids
            ent = [] if score_only else (out.logprobs or [])
            if req.echo and ci not in echoed:
                echoed.add(ci)
                text = tok.decode(prompts[i]) + text
                if req.logprobs is not None and out.prompt_logprobs is not None:
                    ent = [None] + list(out.prompt_logprobs[1:]) + list(ent)
                    ids = prompts[i] + list(ids)
            completion_tokens += len(out.new_token_ids) if not score_only else 0
            chunk = {"id": cid, "object": "text_completion", "created": created, "model": served_name,
                     "choices": [{"index": ci, "text": text,
                                  "logprobs": completion_logprobs(ent, ids, 0) if req.logprobs is not None else None,
                                  "finish_reason": ("length" if score_only else out.finish_reason) if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}]}
            if so and so.continuous_usage_stats:
                chunk["usage"] = usage(prompt_tokens, completion_tokens)
            if text or out.finished or chunk["choices"][0]["logprobs"]:
                yield chunk
        if so and so.include_usage:
            yield {"id": cid, "object": "text_completion", "created": created, "model": served_name,
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        check_model(req.model)
        try:
            ids = render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        except InferdError as e:
            raise ApiError(str(e), param="messages") from None
        mt_req = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if mt_req is not None and mt_req < 1:
            raise ApiError("max_tokens must be at least 1", param="max_tokens")
        top = req.top_logprobs if req.logprobs else None
        if req.logprobs and top is None:
            top = 0
        params = req.sampling_params(max_tokens_for(mt_req, len(ids)), top)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            body = await _primed(stream_chat(cid, created, ids, params, req))
            return StreamingResponse(_sse(body), media_type="text/event-stream")
        finals, lps = {}, {}
        async for _, out in merged([ids], lambda i: params, cid):
            if out.logprobs:
                lps.setdefault(out.index, []).extend(out.logprobs)
            if out.finished:
                finals[out.index] = out
        choices = []
        for i in sorted(finals):
            out = finals[i]
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                            "logprobs": chat_logprobs(lps.get(i, []), out.output_ids) if req.logprobs else None,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                            "_cum": sum(e[0] for e in lps.get(i, []))})
        if (req.best_of or req.n) > req.n:
            choices = sorted(choices, key=lambda c: -c["_cum"])[: req.n]
            for j, c in enumerate(choices):
                c["index"] = j
        for c in choices:
            c.pop("_cum", None)
        completion_tokens = sum(len(o.output_ids) for o in finals.values())
        return {"id": cid, "object": "chat.completion", "created": created, "model": served_name,
                "choices": choices, "usage": usage(len(ids), completion_tokens)}

    async def stream_chat(cid, created, ids, params, req):
        so = req.stream_options or None
        completion_tokens = 0
        started = set()
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": served_name}
        async for _, out in merged([ids], lambda i: params, cid):
            if out.index not in started:
                started.add(out.index)
                yield {**base, "choices": [{"index": out.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            completion_tokens += len(out.new_token_ids)
            chunk = {**base, "choices": [{"index": out.index, "delta": {"content": out.text_delta} if out.text_delta else {},
                                          "logprobs": chat_logprobs(out.logprobs or [], out.new_token_ids) if req.logprobs else None,
                                          "finish_reason": out.finish_reason if out.finished else None}]}
            if so and so.continuous_usage_stats:
                chunk["usage"] = usage(len(ids), completion_tokens)
            if out.text_delta or out.finished or req.logprobs:
                yield chunk
        if so and so.include_usage:
            yield {**base, "choices": [], "usage": usage(len(ids), completion_tokens)}

    return app


async def _primed(agen):
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


async def _sse(chunks):
    """SSE framing; an error after the stream started becomes an error event, then [DONE]."""
    try:
        async for c in chunks:
            yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"

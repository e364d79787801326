"""The OpenAI-compatible HTTP API over AsyncLLM (FastAPI on uvicorn).

Routes: /v1/completions (completions.py), /v1/chat/completions (chat.py), both streaming and not;
here /v1/models, /health, /metrics, /tokenize, /detokenize. Every failure a client can cause is an
OpenAI error body with a 4xx; past --max-waiting queued requests the answer is 503 with Retry-After.
"""
from __future__ import annotations

import hmac
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from inferd.engine.async_engine import AsyncLLM
from inferd.errors import InferdError
from inferd.server import chat, completions
from inferd.server.generation import ARRIVAL, Served
from inferd.server.metrics import Metrics
from inferd.server.protocol import ApiError, DetokenizeRequest, TokenizeRequest


def create_app(llm: AsyncLLM, served_name: str, api_key: str | None = None,
               metrics: Metrics | None = None, aliases: set[str] | None = None) -> FastAPI:
    app = FastAPI(title="inferd", docs_url=None, redoc_url=None)
    srv = Served(llm, served_name, aliases)

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

    app.add_middleware(_Front, api_key=api_key)

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
                                            "owned_by": "inferd", "max_model_len": srv.max_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        srv.check_model(req.model)
        if req.messages is not None:
            ids = srv.render_chat(req.messages, req.add_generation_prompt)
        else:
            ids = srv.tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": srv.max_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        srv.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < srv.engine.model_config.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": srv.tok.decode(req.tokens)}

    # -- generation -----------------------------------------------------------------------------
    app.include_router(completions.router(srv))
    app.include_router(chat.router(srv))
    return app


class _Front:
    """Stamps each request's arrival and checks the API key, as plain ASGI: Starlette's
    `@app.middleware("http")` would pass every streamed chunk through an extra task and memory
    stream, a cost paid once per token. The key is compared in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            ARRIVAL.set(time.monotonic())
            if self.expected is not None and not scope["path"].startswith(("/health", "/metrics")):
                got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if not hmac.compare_digest(got, self.expected):
                    e = ApiError("invalid or missing API key", status=401, type_="authentication_error",
                                 code="invalid_api_key")
                    await JSONResponse(e.body(), status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)

"""The OpenAI-compatible HTTP API over AsyncLLM (FastAPI on uvicorn).

Routes: /v1/completions (completions.py), /v1/chat/completions (chat.py), both streaming and not;
here /v1/models, /health, /metrics, /tokenize, /detokenize. Every failure a client can cause is an
OpenAI error body with a 4xx; past --max-waiting queued requests the answer is 503 with Retry-After.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        ARRIVAL.set(time.monotonic())
        if api_key and not request.url.path.startswith(("/health", "/metrics")):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = ApiError("invalid or missing API key", status=401, type_="authentication_error",
                             code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

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

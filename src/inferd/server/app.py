"""The OpenAI-compatible HTTP API over an engine client (FastAPI on uvicorn).

Routes: /v1/completions (completions.py), /v1/chat/completions (chat.py), both streaming and not;
the chat page, the dashboard and /v1/engine/state (web.py); here /v1/models, /health, /metrics,
/tokenize, /detokenize, and /models/load and /models/unload (llama-server's operator routes; the
served models and when they load: models.py). Every failure a client can cause is an
OpenAI error body with a 4xx; past --max-waiting queued requests the answer is 503 with Retry-After.
"""
from __future__ import annotations

import contextlib

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.errors import InferdError
from inferd.server import chat, completions, embeddings, web
from inferd.server.limits import Front, Limits
from inferd.server.metrics import Metrics
from inferd.server.models import Models
from inferd.server.protocol import (COMMON_ERRORS, ApiError, DetokenizeRequest, DetokenizeResponse, HealthResponse,
                                    LoadLoRARequest, LoRAActionResponse, ModelAction, ModelActionResponse, ModelList,
                                    TokenizeRequest, TokenizeResponse, UnloadLoRARequest, error_responses,
                                    validation_error)


def create_app(models: Models, api_key: str | None = None, metrics: Metrics | None = None,
               limits: Limits | None = None, allowed_origins: list[str] | None = None, on_start=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        if on_start is not None:
            await on_start()
        yield

    app = FastAPI(title="inferd", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.draining = False  # set on SIGTERM: new requests get 503 while the open ones finish
    limits = limits or Limits()

    # -- errors ---------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return JSONResponse(validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(InferdError)
    async def _inferd_error(_, e: InferdError):
        return JSONResponse(ApiError(str(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):  # routing (404, 405), body limits (408, 413)
        msg = e.detail if isinstance(e.detail, str) else "request failed"
        if e.status_code == 404 and msg == "Not Found":
            msg = "no such route"
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(msg, status=e.status_code, type_=kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    if allowed_origins:  # CORS only when asked for (vLLM's --allowed-origins): a browser page elsewhere
        from starlette.middleware.cors import CORSMiddleware  # may not drive the API by default

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Front, api_key=api_key, limits=limits, state=app.state)

    # -- plain routes ---------------------------------------------------------------------------
    @app.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse}})
    async def health():
        if models.dead:
            return JSONResponse({"status": "error", "detail": models.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                                    **error_responses(408, 413, 431)})
    async def prom():
        if metrics is None:
            return Response("", media_type="text/plain")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(*COMMON_ERRORS)})
    async def list_models():
        """Every served model with its state (`status.value`: loaded, loading, unloading, unloaded)."""
        return {"object": "list", "data": [models.card(e) for e in models.entries] + models.adapter_cards()}

    @app.post("/models/load", responses={200: {"model": ModelActionResponse}, **error_responses(*COMMON_ERRORS, 404,
                                                                                                  500, 503)})
    async def load_model(req: ModelAction):
        """Load a model now (it waits for the load); an operator's call, behind --api-key."""
        e = models.find(req.model)
        await models.ensure_loaded(e)
        return {"model": e.name, "status": models.card(e)["status"], "load_seconds": e.load_seconds}

    @app.post("/models/unload", responses={200: {"model": ModelActionResponse}, **error_responses(*COMMON_ERRORS,
                                                                                                    404, 409)})
    async def unload_model(req: ModelAction):
        """Unload a model once its open requests finish (new ones wait, then load it again); past
        `wait_s` seconds of open requests it stays loaded and the answer is 409."""
        e = models.find(req.model)
        if not await models.unload(e, "api", wait_s=req.wait_s):
            raise ApiError(f"model `{e.name}` still has {e.served.llm.open_requests()} open requests after "
                           f"{req.wait_s:g} s: not unloaded", status=409, type_="conflict_error", code="model_busy")
        return {"model": e.name, "status": models.card(e)["status"], "load_seconds": e.load_seconds}

    @app.post("/v1/load_lora_adapter", responses={200: {"model": LoRAActionResponse},
                                                   **error_responses(*COMMON_ERRORS, 404, 500, 503)})
    async def load_lora_adapter(req: LoadLoRARequest):
        """Load a PEFT LoRA folder into a base model's engine (vLLM's route); requests then name it as
        their `model`. A wrong base shape or a rank over --max-lora-rank is a 400."""
        return await models.load_adapter(req.lora_name, req.lora_path, req.base_model)

    @app.post("/v1/unload_lora_adapter", responses={200: {"model": LoRAActionResponse},
                                                     **error_responses(*COMMON_ERRORS, 404, 409)})
    async def unload_lora_adapter(req: UnloadLoRARequest):
        """Unload an adapter; refused (409) while requests that use it are in flight."""
        return await models.unload_adapter(req.lora_name)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **error_responses(*COMMON_ERRORS, 404)})
    async def tokenize(req: TokenizeRequest):
        async with models.use(req.model) as srv:
            if req.messages is not None:
                ids = srv.render_chat(req.messages, req.add_generation_prompt)
            else:
                ids = srv.tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
            return {"tokens": ids, "count": len(ids), "max_model_len": srv.max_len}

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **error_responses(*COMMON_ERRORS, 404)})
    async def detokenize(req: DetokenizeRequest):
        async with models.use(req.model) as srv:
            bad = [t for t in req.tokens if not 0 <= t < srv.info.vocab_size]
            if bad:
                raise ApiError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
            return {"prompt": srv.tok.decode(req.tokens)}

    # -- generation -----------------------------------------------------------------------------
    app.include_router(completions.router(models))
    app.include_router(chat.router(models))
    app.include_router(embeddings.router(models))  # /v1/embeddings, /pooling, /api/embed, /api/embeddings
    app.include_router(web.router(models, app.state))  # the chat page, the dashboard and its state JSON
    app.openapi = lambda: openapi_document(app)
    return app


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document without its 422 answers: validation errors here are 400s (the OpenAI
    shape), declared on each route."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title="inferd", version="1", routes=app.routes)
        for path in doc.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        comps = doc.get("components", {}).get("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        app.openapi_schema = doc
    return app.openapi_schema


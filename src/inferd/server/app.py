"""The HTTP API over an engine client (FastAPI on uvicorn), in three dialects.

Routes: OpenAI's /v1/completions, /v1/chat/completions, /v1/responses and /v1/embeddings (with
vLLM's /pooling) (openai/); Anthropic's /v1/messages and /v1/messages/count_tokens (anthropic/);
Ollama's /api/* (ollama/); the chat page, the dashboard and /v1/engine/state (web.py); here
/v1/models (readable by OpenAI's and Anthropic's clients), /health, /metrics, /tokenize,
/detokenize, and /models/load and /models/unload (llama-server's operator routes; the served models
and when they load: models.py). Every failure a client can cause is a 4xx in the error shape of the
dialect its path speaks (dialects.py); past --max-waiting queued requests the answer is 503 with
Retry-After.
"""
from __future__ import annotations

import contextlib
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.errors import InferdError
from inferd.server import anthropic, ollama, openai, web
from inferd.server.dialects import dialect_of, error_body
from inferd.server.limits import Front, Limits
from inferd.server.metrics import Metrics
from inferd.server.models import Models
from inferd.server.ollama import embed as ollama_embed
from inferd.server.openai import embeddings as openai_embeddings
from inferd.server.openai.store import ResponseStore
from inferd.server.protocol import (COMMON_ERRORS, ApiError, DetokenizeRequest, DetokenizeResponse, HealthResponse,
                                    LoadLoRARequest, LoRAActionResponse, ModelAction, ModelActionResponse, ModelList,
                                    TokenizeRequest, TokenizeResponse, UnloadLoRARequest, error_responses,
                                    validation_error)


def create_app(models: Models, api_key: str | None = None, metrics: Metrics | None = None,
               limits: Limits | None = None, allowed_origins: list[str] | None = None, on_start=None,
               store: ResponseStore | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        if on_start is not None:
            await on_start()
        yield

    app = FastAPI(title="inferd", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.draining = False  # set on SIGTERM: new requests get 503 while the open ones finish
    limits = limits or Limits()
    store = store if store is not None else ResponseStore()
    app.state.responses_store = store
    if metrics is not None:
        metrics.watch_store(store)

    # -- errors, each in the shape of the dialect its path speaks --------------------------------
    def answer(request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e, dialect_of(request.url.path)), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return answer(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        return answer(request, validation_error(e.errors()))

    @app.exception_handler(InferdError)
    async def _inferd_error(request, e: InferdError):
        return answer(request, ApiError(str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):  # routing (404, 405), body limits (408, 413)
        msg = e.detail if isinstance(e.detail, str) else "request failed"
        if e.status_code == 404 and msg == "Not Found":
            msg = f"no such route (path: {request.url.path[:128]})"
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        headers = getattr(e, "headers", None)
        methods = allowed_methods(app, request.url.path) if e.status_code == 405 else None
        if methods:  # every method of the path, not only the first route's that matched it
            headers = {**(headers or {}), "Allow": ", ".join(methods)}
        return answer(request, ApiError(msg, status=e.status_code, type_=kind, headers=headers))

    if allowed_origins:  # CORS only when asked for (vLLM's --allowed-origins): a browser page elsewhere
        from starlette.middleware.cors import CORSMiddleware  # may not drive the API by default

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])
    app.add_middleware(Front, api_key=api_key, limits=limits, state=app.state,
                       on_response=metrics.on_response if metrics is not None else None)

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
        """Every served model with its state (`status.value`: loaded, loading, unloading, unloaded).
        The list is OpenAI's and Anthropic's at once (their fields do not collide), so both
        clients' `models.list()` read it."""
        cards = [models.card(e) for e in models.entries] + models.adapter_cards()
        return {"object": "list", "data": cards, "has_more": False,
                "first_id": cards[0]["id"] if cards else None, "last_id": cards[-1]["id"] if cards else None}

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
    app.include_router(openai.router(models, store))
    app.include_router(anthropic.router(models))
    app.include_router(ollama.router(models))
    app.include_router(openai_embeddings.router(models))  # /v1/embeddings, /pooling
    app.include_router(ollama_embed.router(models))  # /api/embed, /api/embeddings
    app.include_router(web.router(models, app.state))  # the chat page, the dashboard and its state JSON
    app.openapi = lambda: openapi_document(app)
    return app


def allowed_methods(app: FastAPI, path: str) -> list[str] | None:
    """The methods the OpenAPI document gives the path (a path such as /v1/responses/{id} has a
    route a method, of which Starlette's 405 names only the first), or None for a path it lacks."""
    for template, ops in openapi_document(app).get("paths", {}).items():
        parts = re.split(r"(\{[^/{}]+\})", template)
        pattern = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
        if re.fullmatch(pattern, path):
            return sorted(m.upper() for m in ops)
    return None


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


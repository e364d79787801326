"""Ollama's `/api/embed` and its legacy `/api/embeddings`: the request path every dialect's
embedding route shares (inferd.server.embeddings), answered as Ollama answers. Errors are Ollama's
shape through the app's handler, as on every `/api/*` route (inferd.server.dialects).

The body is read as JSON whatever its content type says, as Ollama's clients send it, and checked
here, so that a malformed one is the same one-line 400 as on the other routes."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from pydantic import ValidationError

from inferd.server.embeddings import embed_inputs
from inferd.server.models import Models
from inferd.server.ollama.protocol import (OllamaEmbeddingsRequest, OllamaEmbedRequest, ollama_error_responses,
                                           served_name)
from inferd.server.protocol import validation_error

ERRORS = ollama_error_responses(400, 404, 500, 503, reasons={
    400: "invalid request", 404: "unknown model", 500: "the model failed to load or run",
    503: "overloaded or engine stopped"})


async def read_body(request: Request, model):
    """The body as `model`, or the 400 that says what is wrong with it."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def body_schema(model) -> dict:
    """The OpenAPI request body of a route that reads its own (`read_body`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def router(models: Models) -> APIRouter:
    r = APIRouter()

    @r.post("/api/embed", openapi_extra=body_schema(OllamaEmbedRequest), responses=ERRORS)
    async def ollama_embed(request: Request):
        """Ollama's embed: normalised vectors (as Ollama's are), inputs past the limit cut unless
        `truncate` is false."""
        t0 = time.monotonic()
        req = await read_body(request, OllamaEmbedRequest)
        async with models.use(served_name(req.model, models.by_name)) as srv:
            prompts, vecs = await embed_inputs(srv, req.input, f"ollama-{uuid.uuid4().hex}", dimensions=req.dimensions,
                                               normalize=True, truncate=-1 if req.truncate else None)
        return {"model": req.model, "embeddings": vecs, "total_duration": int((time.monotonic() - t0) * 1e9),
                "load_duration": 0, "prompt_eval_count": sum(len(p) for p in prompts)}

    @r.post("/api/embeddings", openapi_extra=body_schema(OllamaEmbeddingsRequest), responses=ERRORS)
    async def ollama_embeddings(request: Request):
        """Ollama's legacy route: one prompt, the vector as the model pools it, unnormalised (as
        Ollama's legacy route answers), cut at the model's limit."""
        req = await read_body(request, OllamaEmbeddingsRequest)
        async with models.use(served_name(req.model, models.by_name)) as srv:
            _, vecs = await embed_inputs(srv, req.prompt, f"ollama-{uuid.uuid4().hex}", dimensions=None,
                                         normalize=False, truncate=-1)
        return {"embedding": vecs[0]}

    return r

"""OpenAI's `/v1/embeddings` and vLLM's `/pooling`: one request body, one handler, two answer
shapes (the vector's key and its object's name). Their request path is the one every dialect's
embedding route shares (inferd.server.embeddings)."""
from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Literal, NamedTuple

from fastapi import APIRouter
from pydantic import Field, field_validator

from inferd.server.embeddings import Input, check_input, embed_inputs
from inferd.server.models import Models
from inferd.server.protocol import INT32_MAX, Strict, error_responses

ERRORS = error_responses(400, 401, 404, 408, 413, 431, 503)


class EmbeddingRequest(Strict):
    """OpenAI's /v1/embeddings body, with vLLM's extensions (truncate_prompt_tokens, normalize,
    add_special_tokens)."""
    model: str | None = Field(None, max_length=256)
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = Field(None, max_length=256)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    normalize: bool | None = None
    add_special_tokens: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, v):
        return check_input(v)


def encode_b64(vec: list[float]) -> str:
    """OpenAI's base64 form: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def usage(prompts: list[list[int]]) -> dict:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


class Shape(NamedTuple):
    """What tells the two routes apart: the answer's shape, and the route's name and description in
    the OpenAPI document."""
    name: str
    id_prefix: str
    item_object: str  # each item's `object`
    vector_key: str  # the item's key that holds its vector
    description: str


SHAPES = {
    "/v1/embeddings": Shape("embeddings", "embd", "embedding", "embedding",
                            "OpenAI's embeddings: string, list of strings, token ids or lists of them; float or "
                            "base64."),
    "/pooling": Shape("pooling", "pool", "pooling", "data",
                      "vLLM's pooling route: the pooled vector of each input, as `data`."),
}


def vectors_route(models: Models, shape: Shape):
    async def route(req: EmbeddingRequest):
        async with models.use(req.model) as srv:
            rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
            prompts, vecs = await embed_inputs(srv, req.input, rid, dimensions=req.dimensions, normalize=req.normalize,
                                               truncate=req.truncate_prompt_tokens,
                                               add_special_tokens=req.add_special_tokens)
            data = [{"object": shape.item_object, "index": i,
                     shape.vector_key: encode_b64(v) if req.encoding_format == "base64" else v}
                    for i, v in enumerate(vecs)]
            return {"id": rid, "object": "list", "created": int(time.time()), "model": srv.name, "data": data,
                    "usage": usage(prompts)}

    return route


def router(models: Models) -> APIRouter:
    r = APIRouter()
    for path, shape in SHAPES.items():
        r.add_api_route(path, vectors_route(models, shape), methods=["POST"], name=shape.name,
                        description=shape.description, responses=ERRORS)
    return r

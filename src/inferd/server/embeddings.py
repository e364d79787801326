"""Embeddings over HTTP, in the three dialects clients speak: OpenAI's `/v1/embeddings`, vLLM's
`/pooling`, Ollama's `/api/embed` and its legacy `/api/embeddings`. One module, one router: every
route tokenizes here, sends `PoolingParams` requests through the engine client (inferd.engine.pooling
batches them) and shapes the vectors as its dialect does.

Limits, the same on every route: an input longer than the model's `max_seq_length` is a 400 unless
the request asks for truncation (`truncate_prompt_tokens`, vLLM's name; Ollama's `truncate`, true by
default there as in Ollama); text is cut as sentence-transformers cuts it (the start kept, the
special tokens kept). Errors on the Ollama routes are Ollama's shape, `{"error": "..."}`.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator
from typing_extensions import Annotated

from inferd.engine.request import PoolingParams
from inferd.server.protocol import INT32_MAX, ApiError, Strict, TokenId, error_responses, validation_error

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit for /v1/embeddings)
IN_FLIGHT = 256  # a request's inputs in the engine at once: a 2048-input request must not fill --max-waiting
THREAD_TOKENIZE_CHARS = 1 << 16  # past this much text, tokenize off the event loop
INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"

Input = Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)],
              Annotated[list[TokenId], Field(min_length=1)],
              Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)]]


def _check_input(v: Any, name: str = "input") -> Any:
    """One string, or a list of one kind, each part non-empty: each wrong shape one line naming its place."""
    if isinstance(v, str):
        if not v:
            raise ApiError(f"{name} is an empty string", param=name)
        return v
    if not isinstance(v, list):
        raise ApiError(f"{name} is {type(v).__name__}: give {INPUT_SHAPES}", param=name)
    if not v:
        raise ApiError(f"{name} is an empty list: give {INPUT_SHAPES}", param=name)
    kinds = {"str" if isinstance(x, str) else "list" if isinstance(x, list) else
             "int" if isinstance(x, int) and not isinstance(x, bool) else type(x).__name__ for x in v}
    if len(kinds) > 1 or kinds - {"str", "list", "int"}:
        raise ApiError(f"{name} mixes or holds {', '.join(sorted(kinds))}: give {INPUT_SHAPES}", param=name)
    if kinds != {"int"} and len(v) > MAX_INPUTS:
        raise ApiError(f"{name} holds {len(v)} inputs: at most {MAX_INPUTS} in one request", param=name)
    for i, x in enumerate(v):
        if x == "" or x == []:
            raise ApiError(f"{name}[{i}] is empty", param=name)
        if isinstance(x, list) and any(not isinstance(t, int) or isinstance(t, bool) for t in x):
            raise ApiError(f"{name}[{i}] holds something other than token ids", param=name)
    return v


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
        return _check_input(v)


class OllamaEmbedRequest(Strict):
    """Ollama's /api/embed body (`options` and `keep_alive` are taken and ignored: the server's own
    flags rule)."""
    model: str = Field(max_length=256)
    input: Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    options: dict | None = None
    keep_alive: Union[str, int, float, None] = None

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, v):
        return _check_input(v)


class OllamaEmbeddingsRequest(Strict):
    """Ollama's legacy /api/embeddings body: one prompt."""
    model: str = Field(max_length=256)
    prompt: str = Field(min_length=1)
    options: dict | None = None
    keep_alive: Union[str, int, float, None] = None


class OllamaError(BaseModel):
    error: str


_OLLAMA_ERRORS = {s: {"model": OllamaError, "description": d} for s, d in
                  ((400, "invalid request"), (404, "unknown model"), (500, "the model failed to load or run"),
                   (503, "overloaded or engine stopped"))}


def truncate_ids(tok, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids, at most `limit` of them as sentence-transformers cuts: the text's tokens cut at
    the end, the special tokens around them kept."""
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) <= limit:
        return ids
    if not add_special_tokens:
        return ids[:limit]
    body = tok.encode(text, add_special_tokens=False)
    for head in range(len(ids) - len(body) + 1):  # where the text's own tokens sit among the specials
        if ids[head:head + len(body)] == body:
            tail = ids[head + len(body):]
            keep = limit - head - len(tail)
            if keep >= 0:
                return ids[:head] + body[:keep] + tail
            break
    return ids[:limit]


def encode_b64(vec: list[float]) -> str:
    """OpenAI's base64 form: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


async def tokenize_inputs(srv, inputs, truncate: int | None, add_special_tokens: bool = True) -> list[list[int]]:
    """The inputs as token-id lists, checked against the vocabulary and the model's limit (past it:
    a 400, or cut to `truncate` tokens where the request asks)."""
    limit = srv.max_len
    if truncate is not None:
        if truncate == -1:
            truncate = limit
        if truncate < 1 or truncate > limit:
            raise ApiError(f"truncate_prompt_tokens is {truncate}: it must be -1 or 1 to the model's limit of "
                           f"{limit} tokens", param="truncate_prompt_tokens")
    texts = [inputs] if isinstance(inputs, str) else inputs if isinstance(inputs[0], str) else None
    if texts is not None:
        def encode():
            if truncate is None:
                return [srv.tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]
            return [truncate_ids(srv.tok, t, truncate, add_special_tokens) for t in texts]

        big = sum(len(t) for t in texts) > THREAD_TOKENIZE_CHARS
        prompts = await asyncio.to_thread(encode) if big else encode()
    else:
        prompts = [inputs] if isinstance(inputs[0], int) else inputs
        vocab = srv.info.vocab_size
        for i, ids in enumerate(prompts):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                where = "input" if isinstance(inputs[0], int) else f"input[{i}]"
                raise ApiError(f"{where} holds token id {bad}: past the vocabulary of model `{srv.name}` (token ids 0 "
                               f"to {vocab - 1})", param="input")
        if truncate is not None:
            prompts = [ids[:truncate] for ids in prompts]
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(f"input[{i}] has no tokens", param="input")
        if len(ids) > limit:
            where = "input" if len(prompts) == 1 else f"input[{i}]"
            raise ApiError(f"{where} is {len(ids)} tokens; model `{srv.name}` takes at most {limit} (set "
                           "truncate_prompt_tokens to cut it)", param="input")
    return prompts


async def embed(srv, prompts: list[list[int]], params: PoolingParams, base_id: str) -> list[list[float]]:
    """Every prompt's vector, in order; sent together (at most IN_FLIGHT at once) so the engine
    batches them."""
    srv.require_runner("pooling")
    out: list[list[float] | None] = [None] * len(prompts)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int):
        async with gate:
            async for o in srv.run_one(prompts[i], params, f"{base_id}-{i}"):
                if o.embedding is not None:
                    out[i] = o.embedding

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return out


def pooling_params(srv, dimensions: int | None, normalize: bool | None) -> PoolingParams:
    width = (srv.info.pooling or {}).get("dimensions")
    if dimensions is not None and dimensions != width:
        raise ApiError(f"dimensions: model `{srv.name}` makes {width}-dimensional embeddings and cannot shorten them "
                       "(no Matryoshka training declared)", param="dimensions")
    return PoolingParams(normalize=normalize)


def _usage(prompts: list[list[int]]) -> dict:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


def _ollama_error(e: ApiError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


async def _ollama_body(request: Request, model):
    """The body as `model`, or an Ollama-shaped 400 (raised as ApiError, caught by the route)."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _ollama_name(name: str) -> str:
    """Ollama's `name:tag`: the default tag means the model itself."""
    return name[:-len(":latest")] if name.endswith(":latest") else name


def _schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def router(models) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/embeddings", responses=error_responses(400, 401, 404, 408, 413, 431, 503))
    async def embeddings(req: EmbeddingRequest):
        """OpenAI's embeddings: string, list of strings, token ids or lists of them; float or base64."""
        async with models.use(req.model) as srv:
            params = pooling_params(srv, req.dimensions, req.normalize)
            prompts = await tokenize_inputs(srv, req.input, req.truncate_prompt_tokens, req.add_special_tokens)
            rid = f"embd-{uuid.uuid4().hex}"
            vecs = await embed(srv, prompts, params, rid)
            data = [{"object": "embedding", "index": i,
                     "embedding": encode_b64(v) if req.encoding_format == "base64" else v} for i, v in enumerate(vecs)]
            return {"id": rid, "object": "list", "created": int(time.time()), "model": srv.name, "data": data,
                    "usage": _usage(prompts)}

    @r.post("/pooling", responses=error_responses(400, 401, 404, 408, 413, 431, 503))
    async def pooling(req: EmbeddingRequest):
        """vLLM's pooling route: the pooled vector of each input, as `data`."""
        async with models.use(req.model) as srv:
            params = pooling_params(srv, req.dimensions, req.normalize)
            prompts = await tokenize_inputs(srv, req.input, req.truncate_prompt_tokens, req.add_special_tokens)
            rid = f"pool-{uuid.uuid4().hex}"
            vecs = await embed(srv, prompts, params, rid)
            data = [{"object": "pooling", "index": i, "data": encode_b64(v) if req.encoding_format == "base64" else v}
                    for i, v in enumerate(vecs)]
            return {"id": rid, "object": "list", "created": int(time.time()), "model": srv.name, "data": data,
                    "usage": _usage(prompts)}

    @r.post("/api/embed", openapi_extra=_schema(OllamaEmbedRequest), responses=_OLLAMA_ERRORS)
    async def ollama_embed(request: Request):
        """Ollama's embed: normalised vectors (as Ollama's are), inputs past the limit cut unless
        `truncate` is false."""
        t0 = time.monotonic()
        try:
            req = await _ollama_body(request, OllamaEmbedRequest)
            async with models.use(_ollama_name(req.model)) as srv:
                params = pooling_params(srv, req.dimensions, True)
                prompts = await tokenize_inputs(srv, req.input, -1 if req.truncate else None)
                vecs = await embed(srv, prompts, params, f"ollama-{uuid.uuid4().hex}")
        except ApiError as e:
            return _ollama_error(e)
        return {"model": req.model, "embeddings": vecs, "total_duration": int((time.monotonic() - t0) * 1e9),
                "load_duration": 0, "prompt_eval_count": sum(len(p) for p in prompts)}

    @r.post("/api/embeddings", openapi_extra=_schema(OllamaEmbeddingsRequest), responses=_OLLAMA_ERRORS)
    async def ollama_embeddings(request: Request):
        """Ollama's legacy route: one prompt, the vector as the model pools it, unnormalised (as
        Ollama's legacy route answers), cut at the model's limit."""
        try:
            req = await _ollama_body(request, OllamaEmbeddingsRequest)
            async with models.use(_ollama_name(req.model)) as srv:
                params = pooling_params(srv, None, False)
                prompts = await tokenize_inputs(srv, req.prompt, -1)
                vecs = await embed(srv, prompts, params, f"ollama-{uuid.uuid4().hex}")
        except ApiError as e:
            return _ollama_error(e)
        return {"embedding": vecs[0]}

    return r

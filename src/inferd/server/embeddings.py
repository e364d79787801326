"""The one request path of every dialect's embedding route (OpenAI's `/v1/embeddings` and vLLM's
`/pooling` in openai/embeddings.py, Ollama's `/api/embed` and `/api/embeddings` in
ollama/embed.py): the inputs' shapes, tokenizing and its limits, and the `PoolingParams` requests
sent through the engine client (inferd.engine.pooling batches them). Each dialect's route shapes
the vectors as its clients read them.

Limits, the same on every route: an input longer than the model's `max_seq_length` is a 400 unless
the request asks for truncation (`truncate_prompt_tokens`, vLLM's name; Ollama's `truncate`, true by
default there as in Ollama); text is cut as sentence-transformers cuts it (the start kept, the
special tokens kept).
"""
from __future__ import annotations

import asyncio
from typing import Any, Union

from pydantic import Field
from typing_extensions import Annotated

from inferd.engine.request import PoolingParams
from inferd.server.protocol import ApiError, TokenId

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit for /v1/embeddings)
IN_FLIGHT = 256  # a request's inputs in the engine at once: a 2048-input request must not fill --max-waiting
THREAD_TOKENIZE_CHARS = 1 << 16  # past this much text, tokenize off the event loop
INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"

Input = Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)],
              Annotated[list[TokenId], Field(min_length=1)],
              Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_INPUTS)]]


def check_input(v: Any, name: str = "input") -> Any:
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


async def embed_inputs(srv, inputs, request_id: str, *, dimensions: int | None, normalize: bool | None,
                       truncate: int | None, add_special_tokens: bool = True) -> tuple[list[list[int]], list]:
    """The inputs' token ids and their vectors, in order: what every embedding route answers from."""
    params = pooling_params(srv, dimensions, normalize)
    prompts = await tokenize_inputs(srv, inputs, truncate, add_special_tokens)
    return prompts, await embed(srv, prompts, params, request_id)

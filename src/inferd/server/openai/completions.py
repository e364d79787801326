"""/v1/completions: prompts as text, token ids or lists of either; echo, logprobs, n and best_of."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter

from inferd.server.generation import Served, logprob_sum, respond
from inferd.server.models import Models
from inferd.server.protocol import (COMMON_ERRORS, SSE_CONTENT, ApiError, CompletionRequest, CompletionResponse,
                                    error_responses)


def router(models: Models) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions", responses={
        200: {"model": CompletionResponse, "content": SSE_CONTENT},
        **error_responses(*COMMON_ERRORS, 404, 500)})
    async def completions(req: CompletionRequest):
        async with models.use(req.model) as srv:
            return await complete(srv, req)

    return r


async def complete(srv: Served, req: CompletionRequest):
    prompts = _prompt_ids(srv, req.prompt)
    # OpenAI's scoring request: echo with max_tokens 0 returns the prompt's logprobs, generating
    # nothing (the engine runs one token, never sent); without echo, 0 is the usual 400
    score_only = req.max_tokens == 0 and req.echo
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError("logprobs must be in [0, 20]", param="logprobs")
    want_prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None

    def params_for(i):
        mt = 1 if score_only else srv.max_tokens_for(req.max_tokens, len(prompts[i]))
        return req.sampling_params(mt, req.logprobs, want_prompt_lp)

    params = params_for(0)  # validates before anything is queued
    cid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunks(include_usage, continuous_usage):
        return completion_chunks(srv, req, prompts, params_for, cid, created, score_only, include_usage,
                                 continuous_usage)

    return await respond(req, params, chunks, "text_completion", merge_choice, srv.stall_timeout)


def _prompt_ids(srv: Served, p) -> list[list[int]]:
    """The prompts' token ids; the shapes were checked as the request parsed (protocol.check_prompt)."""
    if isinstance(p, str):
        return [srv.tok.encode(p)]
    if isinstance(p[0], str):
        return [srv.tok.encode(x) for x in p]
    nested = isinstance(p[0], list)
    ids = [list(x) for x in p] if nested else [list(p)]
    srv.check_vocab(ids, nested)
    return ids


async def completion_chunks(srv: Served, req: CompletionRequest, prompts, params_for, cid, created, score_only,
                            include_usage, continuous_usage):
    """The stream of a completion request. Choice index = prompt * best_of + sample (best_of is n
    whenever the request streams). With max_tokens 0 (score_only, echo only) the one token the
    engine had to generate is not shown or counted."""
    k = params_for(0).num_samples
    want_lp = req.logprobs is not None
    prompt_tokens = sum(len(x) for x in prompts)
    base = {"id": cid, "object": "text_completion", "created": created, "model": srv.name}
    completion_tokens = 0
    echoed: set[int] = set()
    prompt_lps: dict[int, list] = {}  # the engine sends them with one sample's first output only
    cum: dict[int, float] = {}
    cached, kvp = {}, None
    async for i, out in srv.merged(prompts, params_for, cid, req.kv_transfer_params):
        if out.finished:
            cached[i] = out.num_cached_tokens
            kvp = out.kv_transfer_params or kvp
        ci = i * k + out.index
        if out.prompt_logprobs is not None:
            prompt_lps[i] = out.prompt_logprobs
        cum[ci] = cum.get(ci, 0.0) + logprob_sum(out.logprobs)
        text = "" if score_only else out.text_delta
        ids = [] if score_only else list(out.new_token_ids)
        ent = [] if score_only else list(out.logprobs or [])
        if req.echo and ci not in echoed:
            echoed.add(ci)
            text = srv.tok.decode(prompts[i]) + text
            if want_lp and i in prompt_lps:
                ent = [None] + list(prompt_lps[i][1:]) + ent
                ids = list(prompts[i]) + ids
        completion_tokens += 0 if score_only else len(out.new_token_ids)
        choice = {"index": ci, "text": text, "logprobs": completion_logprobs(srv, ent, ids) if want_lp else None,
                  "finish_reason": None, "stop_reason": None}
        if out.finished:
            choice.update(finish_reason="length" if score_only else out.finish_reason,
                          stop_reason=out.stop_reason, _cum=cum[ci])
        chunk = {**base, "choices": [choice]}
        if continuous_usage:
            chunk["usage"] = srv.usage(prompt_tokens, completion_tokens, sum(cached.values()))
        if text or out.finished or choice["logprobs"]:
            yield chunk
    if include_usage:
        last = {**base, "choices": [], "usage": srv.usage(prompt_tokens, completion_tokens, sum(cached.values()))}
        if kvp is not None:
            last["kv_transfer_params"] = kvp
        yield last


def completion_logprobs(srv: Served, entries, ids) -> dict:
    """OpenAI completions format for (logprob, rank, alts) entries (None = no logprob). Offsets
    count from the start of this piece (a stream chunk's offsets restart at 0)."""
    tokens, lps, tops, offs = [], [], [], []
    off = 0
    for t, e in zip(ids, entries):
        s = srv.token_str(t)
        tokens.append(s)
        offs.append(off)
        off += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(e[0])
            top = {srv.token_str(a): b for a, b in e[2]}
            top.setdefault(s, e[0])
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def merge_choice(acc: dict | None, ch: dict) -> dict:
    """Fold one chunk's choice into the choice of the non-streaming body."""
    if acc is None:
        acc = {"index": ch["index"], "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}
    acc["text"] += ch["text"]
    lp = ch["logprobs"]
    if lp is not None:
        if acc["logprobs"] is None:
            acc["logprobs"] = {key: list(v) for key, v in lp.items()}
        else:
            a = acc["logprobs"]
            shift = a["text_offset"][-1] + len(a["tokens"][-1]) if a["tokens"] else 0
            a["tokens"] += lp["tokens"]
            a["token_logprobs"] += lp["token_logprobs"]
            a["top_logprobs"] += lp["top_logprobs"]
            a["text_offset"] += [shift + o for o in lp["text_offset"]]
    if ch["finish_reason"] is not None:
        acc.update(finish_reason=ch["finish_reason"], stop_reason=ch["stop_reason"], _cum=ch["_cum"])
    return acc

"""/v1/chat/completions: messages through the model's chat template; logprobs, n and best_of;
response_format / structured_outputs, tools (inferd.server.tools), and the reasoning split
(inferd.server.reasoning) into `reasoning_content`.

A chat request is also the one form every other dialect's generation becomes (the Responses API,
Anthropic's Messages, Ollama's chat): `prepare` renders and resolves it, `chat_chunks` is its
stream, which each dialect translates into its own events.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter
from pydantic import ValidationError

from inferd.engine.request import SamplingParams
from inferd.errors import InferdError
from inferd.server.generation import Served, logprob_sum, respond
from inferd.server.models import Models
from inferd.server.protocol import (COMMON_ERRORS, SSE_CONTENT, ApiError, ChatCompletionRequest,
                                    ChatCompletionResponse, error_responses, validation_error)
from inferd.server.reasoning import REASONING, ReasoningSplit, prompt_opens_block
from inferd.server.tools import call_stream, tool_constraint, tool_mode


def router(models: Models) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse, "content": SSE_CONTENT},
        **error_responses(*COMMON_ERRORS, 404, 500)})
    async def chat(req: ChatCompletionRequest):
        async with models.use(req.model) as srv:
            return await complete_chat(srv, req)

    return r


def chat_request(body: dict) -> ChatCompletionRequest:
    """Another dialect's request, translated into a chat body, as the chat schema reads it."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


@dataclass
class ChatTurn:
    """A chat request made ready for the engine: its prompt, its sampling, how calls are read."""
    ids: list[int]
    params: SamplingParams
    mode: str = "none"  # tools.tool_mode
    name: str | None = None  # the named function
    reasoning: str | None = None  # the reasoning parser that splits its output
    prompt_opened: bool = False  # the prompt ends inside a think block

    def split(self) -> ReasoningSplit | None:
        return None if self.reasoning is None else ReasoningSplit(self.reasoning, self.prompt_opened)


def render(srv: Served, req: ChatCompletionRequest) -> list[int]:
    """The request's messages (and tools) through the model's chat template, as token ids."""
    tool_mode(req)  # a wrong tool_choice is named before the template sees it
    try:
        return srv.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs, req.tools,
                               req.tool_choice)
    except InferdError as e:
        raise ApiError(str(e), param="messages") from None


def prepare(srv: Served, req: ChatCompletionRequest, ids: list[int] | None = None,
            ceiling: bool = False) -> ChatTurn:
    """Render (unless the prompt's `ids` are given), resolve max_tokens (a ceiling within the
    context with `ceiling`), sampling and the tool constraint: every 400 before the engine."""
    mode, name = tool_mode(req)
    if ids is None:
        ids = render(srv, req)
    mt_req = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = req.top_logprobs if req.logprobs else None
    if req.logprobs and top is None:
        top = 0
    params = req.sampling_params(srv.max_tokens_for(mt_req, len(ids), ceiling), top)
    tc = tool_constraint(req, mode, name)
    if tc is not None:
        if params.structured_outputs is not None:
            raise ApiError(f"tool_choice {'required' if mode == 'required' else 'naming a function'} already "
                           "constrains the output: drop response_format / structured_outputs", param="tool_choice")
        params.structured_outputs = tc
    parser = srv.reasoning_parser
    opened = parser is not None and prompt_opens_block(srv.tok.decode(ids[-8:], skip_special_tokens=False))
    return ChatTurn(ids, params, mode, name, parser, opened)


async def complete_chat(srv: Served, req: ChatCompletionRequest):
    turn = prepare(srv, req)
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunks(include_usage, continuous_usage):
        return chat_chunks(srv, req, turn, cid, created, include_usage, continuous_usage)

    return await respond(req, turn.params, chunks, "chat.completion", merge_choice, srv.stall_timeout)


async def chat_chunks(srv: Served, req: ChatCompletionRequest, turn: ChatTurn, cid, created, include_usage,
                      continuous_usage, cached_details: bool = False):
    """The stream of a chat request: per sample a role chunk, then its reasoning, content or
    tool-call deltas. `cached_details`: the usage always tells the prompt tokens found in the
    prefix cache (the dialects that report them ask)."""
    ids, params, mode, name = turn.ids, turn.params, turn.mode, turn.name
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": srv.name}
    completion_tokens = 0
    started: set[int] = set()
    cum: dict[int, float] = {}
    cached, kvp = 0, None
    calls: dict = {}  # sample index -> its CallStream, when tool calls are read from the output
    splits: dict = {}  # sample index -> its ReasoningSplit, with --reasoning-parser
    async for _, out in srv.merged([ids], lambda i: params, cid, req.kv_transfer_params):
        if out.finished:
            cached = out.num_cached_tokens  # the n samples share one prompt
            kvp = out.kv_transfer_params or kvp
        if out.index not in started:
            started.add(out.index)
            yield {**base, "choices": [{"index": out.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
            if mode != "none":
                calls[out.index] = call_stream(mode, name)
            splits[out.index] = turn.split()
        completion_tokens += len(out.new_token_ids)
        cum[out.index] = cum.get(out.index, 0.0) + logprob_sum(out.logprobs)
        stream = calls.get(out.index)
        split = splits[out.index]
        pieces = [("content", out.text_delta)] if split is None else split.feed(out.text_delta)
        if split is not None and out.finished:
            pieces += split.finish()
        deltas = []
        for kind, text in pieces:
            if kind == REASONING:
                deltas.append({"reasoning_content": text})
            elif stream is None:
                if text:
                    deltas.append({"content": text})
            else:
                deltas += stream.feed(text)
        if stream is not None and out.finished:
            deltas += stream.finish()
        reason = out.finish_reason if out.finished else None
        if stream is not None and reason == "stop" and stream.calls and mode != "named":
            reason = "tool_calls"  # as OpenAI and vLLM; a named function's call ends with "stop", as OpenAI's
        # one delta a chunk; the logprobs and the finish reason ride on the last
        for delta in deltas[:-1]:
            yield {**base, "choices": [{"index": out.index, "delta": delta, "logprobs": None, "finish_reason": None}]}
        choice = {"index": out.index, "delta": deltas[-1] if deltas else {},
                  "logprobs": chat_logprobs(srv, out.logprobs or [], out.new_token_ids) if req.logprobs else None,
                  "finish_reason": reason}
        if out.finished:
            choice.update(_stop_reason=out.stop_reason, _cum=cum[out.index])
        chunk = {**base, "choices": [choice]}
        if continuous_usage:
            chunk["usage"] = srv.usage(len(ids), completion_tokens, cached)
        if deltas or out.finished or req.logprobs:
            yield chunk
    if include_usage:
        last = {**base, "choices": [], "usage": srv.usage(len(ids), completion_tokens, cached, cached_details)}
        if kvp is not None:
            last["kv_transfer_params"] = kvp
        yield last


def chat_logprobs(srv: Served, entries, ids) -> dict:
    content = []
    for t, e in zip(ids, entries):
        s = srv.token_str(t)
        content.append({"token": s, "logprob": e[0], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": srv.token_str(a), "logprob": b,
                                          "bytes": list(srv.token_str(a).encode())} for a, b in e[2]]})
    return {"content": content}


def merge_choice(acc: dict | None, ch: dict) -> dict:
    """Fold one chunk's choice into the choice of the non-streaming body."""
    if acc is None:
        acc = {"index": ch["index"], "message": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None, "stop_reason": None}
    delta = ch["delta"]
    msg = acc["message"]
    if "role" in delta:
        msg["role"] = delta["role"]
    msg["content"] += delta.get("content") or ""
    if delta.get("reasoning_content"):
        msg["reasoning_content"] = (msg.get("reasoning_content") or "") + delta["reasoning_content"]
    for tc in delta.get("tool_calls") or ():
        calls = msg.setdefault("tool_calls", [])
        if tc["index"] == len(calls):
            calls.append({"id": tc["id"], "type": "function", "function": {"name": tc["function"]["name"],
                                                                          "arguments": ""}})
        calls[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
    if ch["logprobs"] is not None:
        if acc["logprobs"] is None:
            acc["logprobs"] = {"content": []}
        acc["logprobs"]["content"] += ch["logprobs"]["content"]
    if ch["finish_reason"] is not None:
        acc.update(finish_reason=ch["finish_reason"], stop_reason=ch["_stop_reason"], _cum=ch["_cum"])
        if msg.get("tool_calls") and not msg["content"].strip():
            msg["content"] = None  # OpenAI: a message of calls has no content
    return acc

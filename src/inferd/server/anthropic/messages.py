"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A request becomes one chat request (`openai.chat.prepare`: the template, sampling, stop strings,
tools through `inferd.server.tools`), and the chat stream becomes Anthropic's event sequence
(`MessageBuilder`: message_start, ping, content_block_start / delta / stop per block, message_delta
with the stop reason and usage, message_stop); the builder's final message is the non-streaming
body, so the two cannot drift apart.

What Claude Code sends is taken as it comes: `anthropic-version` / `anthropic-beta` headers and
`?beta=true` (nothing here depends on them), `system` as blocks, `cache_control` on any block (the
prefix cache keeps every full block of a prompt anyway: a repeated prefix is a hit without it),
`metadata`, and `thinking` (the chat template's `enable_thinking`; the reasoning comes back as
thinking blocks with --reasoning-parser). `output_config.format` (a JSON schema) is structured
output; `temperature`, `top_p` and `top_k`, which Anthropic's newest SDK no longer offers, are still
read when a client sends them. An earlier turn's thinking blocks go back to the template
as that turn's reasoning.
"""
from __future__ import annotations

import hashlib
import json
import uuid

from fastapi import APIRouter

from inferd.server.anthropic.protocol import (CountTokensRequest, CountTokensResponse, MessageResponse,
                                              MessagesRequest, anthropic_error_responses)
from inferd.server.dialects import anthropic_error
from inferd.server.generation import SSEResponse, Served, framed, primed, sse_event, translated
from inferd.server.models import Models
from inferd.server.openai.chat import chat_chunks, chat_request, prepare, render
from inferd.server.protocol import COMMON_ERRORS, SSE_CONTENT, ApiError, check_part

ERRORS = anthropic_error_responses(*COMMON_ERRORS, 404, 500)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def router(models: Models) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages", responses={
        200: {"model": MessageResponse, "content": SSE_CONTENT}, **ERRORS})
    async def messages(req: MessagesRequest):
        """Anthropic's Messages API over the served model (text, client tools, thinking)."""
        async with models.use(req.model) as srv:
            return await create_message(srv, req)

    @r.post("/v1/messages/count_tokens", responses={200: {"model": CountTokensResponse}, **ERRORS})
    async def count_tokens(req: CountTokensRequest):
        """The prompt's tokens as the model's template renders the request (system, tools, messages)."""
        async with models.use(req.model) as srv:
            return {"input_tokens": len(render(srv, chat_request(chat_body(req, srv))))}

    return r


async def create_message(srv: Served, req: MessagesRequest):
    chat = chat_request(chat_body(req, srv))
    turn = prepare(srv, chat, ceiling=True)  # Claude Code asks for 32,000 tokens whatever the context
    builder = MessageBuilder(srv, req, len(turn.ids))
    chunks = chat_chunks(srv, chat, turn, builder.id, 0, True, False, cached_details=True)
    if req.stream:  # the engine takes the request (or refuses it: a status) before the stream starts
        chunks = await primed(chunks)

    events = translated(chunks, builder.start, builder.feed, builder.finish)
    if req.stream:
        def on_error(e: ApiError) -> str:
            return sse_event("error", anthropic_error(e.message, e.status))

        return SSEResponse(framed(events, lambda ev: sse_event(ev["type"], ev), on_error), srv.stall_timeout)
    async for _ in events:
        pass
    return builder.message


# -- the request as a chat -------------------------------------------------------------------------

def chat_body(req, srv: Served) -> dict:
    """The chat request a Messages (or count_tokens) request is."""
    messages = []
    system = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system or ())
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += turn_messages(m, f"messages[{i}]", srv)
    body: dict = {"messages": messages}
    if req.tools:
        body["tools"] = [client_tool(t, i) for i, t in enumerate(req.tools)]
    tc = req.tool_choice
    if tc is not None and (req.tools or tc.type not in ("auto", "none")):  # Claude Code sends auto without tools
        if tc.type == "tool":
            if not tc.name:
                raise ApiError("tool_choice of type tool names the tool", param="tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        if tc.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None and req.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, ignore_eos=req.ignore_eos)
    return {k: v for k, v in body.items() if v is not None}


def client_tool(t, i: int) -> dict:
    if t.type not in (None, "custom"):
        raise ApiError(f"tools[{i}].type is {t.type[:32]!r}: this server runs client tools only (a name, a "
                       "description and an input_schema)", param=f"tools[{i}].type")
    fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def turn_messages(m, at: str, srv: Served) -> list[dict]:
    """One Anthropic turn as chat messages: a user turn's tool_result blocks become tool messages
    (in their place among its text), an assistant turn's tool_use blocks its tool calls and its
    thinking blocks its reasoning."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict] = []
    text: list[str] = []
    calls, reasoning = [], []

    def flush():
        if text:
            out.append({"role": m.role, "content": "".join(text)})
            text.clear()

    for j, b in enumerate(m.content):
        where = f"{at}.content[{j}]"
        if b.type == "text":
            text.append(b.text)
        elif b.type in ("image", "document"):
            check_part(b.type, where, srv.info.modalities, srv.name, "image" if b.type == "image" else "file")
        elif b.type == "tool_result":
            flush()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result_text(b.content, where, srv)})
        elif b.type == "tool_use" and m.role == "assistant":
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
        elif b.type == "thinking" and m.role == "assistant" and b.thinking:
            reasoning.append(b.thinking)
        elif b.type == "search_result":
            text.append(result_text(getattr(b, "content", None), where, srv))
        # redacted_thinking (another server's opaque reasoning): nothing of it is readable here
    if m.role == "assistant":
        msg = {"role": "assistant", "content": "".join(text) or None}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        return out + [msg] if (calls or text or reasoning) else out
    flush()
    return out


def result_text(content, at: str, srv: Served) -> str:
    """A tool result's (or search result's) content: a string or blocks, of which text is read."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, b in enumerate(content):
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        elif t in ("image", "document"):
            check_part(t, f"{at}.content[{k}]", srv.info.modalities, srv.name, "image" if t == "image" else "file")
        else:
            raise ApiError(f"{at}.content[{k}] is {'a ' + str(t)[:32] if t else 'not a'} block: a tool result holds "
                           "text blocks", param=f"{at}.content[{k}]")
    return "\n".join(parts)


# -- the chat stream as Anthropic events -------------------------------------------------------------

class MessageBuilder:
    """Chat chunks in, Messages events out; `message` is the final message either way."""

    def __init__(self, srv: Served, req: MessagesRequest, prompt_tokens: int):
        self.srv, self.req = srv, req
        self.id = f"msg_{uuid.uuid4().hex}"
        self.open: dict | None = None  # the content block being streamed
        self.args: dict[int, str] = {}  # a tool_use block's index -> its input's JSON text so far
        self.message = {"id": self.id, "type": "message", "role": "assistant", "model": srv.name, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                                  "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        self.finish_reason = self.stop_reason = None
        self.usage: dict | None = None

    def start(self) -> list[dict]:
        snap = json.loads(json.dumps(self.message))
        return [{"type": "message_start", "message": snap}, {"type": "ping"}]

    def _open(self, block: dict) -> list[dict]:
        out = self._close()
        idx = len(self.message["content"])
        self.message["content"].append(block)
        self.open = {"block": block, "index": idx}
        start = dict(block, input={}) if block["type"] == "tool_use" else dict(block)
        out.append({"type": "content_block_start", "index": idx, "content_block": start})
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        block, idx = self.open["block"], self.open["index"]
        self.open = None
        out = []
        if block["type"] == "thinking":  # a signature, as Anthropic's clients expect on every thinking block
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()
            out.append({"type": "content_block_delta", "index": idx,
                        "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif block["type"] == "tool_use":
            block["input"] = tool_input(self.args.pop(idx, ""))
        out.append({"type": "content_block_stop", "index": idx})
        return out

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.open["index"], "delta": delta}

    def _kind_open(self) -> str | None:
        return None if self.open is None else self.open["block"]["type"]

    def feed(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        for ch in chunk.get("choices") or ():
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                if self._kind_open() != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                self.open["block"]["thinking"] += d["reasoning_content"]
                out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            if d.get("content"):
                if self._kind_open() != "text":
                    out += self._open({"type": "text", "text": ""})
                self.open["block"]["text"] += d["content"]
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            for tc in d.get("tool_calls") or ():
                if "id" in tc:
                    out += self._open({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"], "input": {}})
                frag = tc["function"].get("arguments") or ""
                if frag and self._kind_open() == "tool_use":
                    self.args[self.open["index"]] = self.args.get(self.open["index"], "") + frag
                    out.append(self._delta({"type": "input_json_delta", "partial_json": frag}))
            if ch.get("finish_reason") is not None:
                self.finish_reason, self.stop_reason = ch["finish_reason"], ch.get("_stop_reason")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out

    def finish(self) -> list[dict]:
        out = self._close()
        m = self.message
        stops = self.req.stop_sequences or ()
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str) and self.stop_reason in stops:
            m["stop_reason"], m["stop_sequence"] = "stop_sequence", self.stop_reason
        else:
            m["stop_reason"] = STOP_REASONS.get(self.finish_reason, "end_turn")
        u = self.usage or {"prompt_tokens": m["usage"]["input_tokens"], "completion_tokens": 0}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        # Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew
        m["usage"] = {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
        out.append({"type": "message_delta", "delta": {"stop_reason": m["stop_reason"],
                                                       "stop_sequence": m["stop_sequence"]}, "usage": dict(m["usage"])})
        out.append({"type": "message_stop"})
        return out


def tool_input(args: str) -> dict:
    """A call's arguments as the object Anthropic's tool_use carries (text that is not an object:
    under the key the model's output gave nothing better for)."""
    try:
        v = json.loads(args) if args.strip() else {}
    except ValueError:
        return {"arguments": args}
    return v if isinstance(v, dict) else {"arguments": v}

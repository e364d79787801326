"""OpenAI's Responses API: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` and its input items.

A request becomes one chat request (`chat.prepare`: the template, sampling, tools through
`inferd.server.tools`, `text.format` through structured output); the chat stream becomes the
Responses event sequence (`ResponseBuilder`), and the same builder's final response is the
non-streaming body, so a stream and a body cannot drift apart.

Conversations: `previous_response_id` reads the stored conversation (store.py: bounded in entries,
bytes and time); `store: false` keeps nothing, and a client that sends its whole history each turn
(Codex) needs nothing kept. Reasoning (with --reasoning-parser) is a `reasoning` item; with
`include: ["reasoning.encrypted_content"]` it also carries the reasoning as an opaque string, which
a later turn may send back (decoded into the assistant turn it preceded, as thinking templates
render it).
"""
from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Path

from inferd.server.generation import SSEResponse, Served, framed, primed, sse_event, translated
from inferd.server.models import Models
from inferd.server.openai.chat import chat_chunks, chat_request, prepare
from inferd.server.openai.responses_protocol import (DeletedResponse, InputItemList, ResponseObject,
                                                     ResponsesRequest)
from inferd.server.openai.store import ResponseStore
from inferd.server.protocol import COMMON_ERRORS, SSE_CONTENT, ApiError, check_part, error_responses

ENCRYPTED = "reasoning.encrypted_content"
OPAQUE_PREFIX = "inferd-reasoning:"  # our own opaque reasoning; anyone else's is not ours to read
TEXT_PARTS = ("input_text", "output_text", "text")


def router(models: Models, store: ResponseStore) -> APIRouter:
    r = APIRouter()
    rid_path = Path(max_length=256)

    @r.post("/v1/responses", responses={
        200: {"model": ResponseObject, "content": SSE_CONTENT},
        **error_responses(*COMMON_ERRORS, 404, 500)})
    async def create(req: ResponsesRequest):
        """OpenAI's Responses API over the served model (text, function tools, `text.format`)."""
        async with models.use(req.model) as srv:
            return await create_response(srv, req, store)

    @r.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject},
                                                      **error_responses(*COMMON_ERRORS, 404)})
    async def retrieve(response_id: str = rid_path):
        return stored(store, response_id).response

    @r.delete("/v1/responses/{response_id}", responses={200: {"model": DeletedResponse},
                                                         **error_responses(*COMMON_ERRORS, 404)})
    async def delete(response_id: str = rid_path):
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @r.get("/v1/responses/{response_id}/input_items", responses={200: {"model": InputItemList},
                                                                  **error_responses(*COMMON_ERRORS, 404)})
    async def input_items(response_id: str = rid_path, order: Literal["asc", "desc"] = "desc"):
        """The items the response answered (its conversation before its output), newest first unless
        `order=asc`, as OpenAI lists them."""
        st = stored(store, response_id)
        n_out = len(st.response["output"])
        items = st.conversation[:len(st.conversation) - n_out]
        if order == "desc":
            items = items[::-1]
        return {"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
                "last_id": items[-1].get("id") if items else None, "has_more": False}

    return r


def not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(f"no stored response with id '{rid[:64]}' (never stored, deleted, or evicted from the "
                    "server's bounded store)", status=404, type_="not_found_error", param=param)


def stored(store: ResponseStore, rid: str):
    st = store.get(rid)
    if st is None:
        raise not_found(rid)
    return st


async def create_response(srv: Served, req: ResponsesRequest, store: ResponseStore):
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.conversation
    items = input_items_of(req)
    chat = chat_request(chat_body(req, history, items, srv))
    turn = prepare(srv, chat, ceiling=True)
    builder = ResponseBuilder(srv, req, turn.params)
    chunks = chat_chunks(srv, chat, turn, builder.id, builder.created, True, False, cached_details=True)
    if req.stream:  # the engine takes the request (or refuses it: a status) before the stream starts
        chunks = await primed(chunks)

    def finish() -> list[dict]:
        events = builder.finish()
        if req.store:
            store.put(builder.response, history + items + builder.response["output"])
        return events

    events = translated(chunks, builder.start, builder.feed, finish)
    if req.stream:
        return SSEResponse(framed(events, lambda ev: sse_event(ev["type"], ev), stream_error(builder)),
                           srv.stall_timeout)
    async for _ in events:
        pass
    return builder.response


def stream_error(builder: "ResponseBuilder"):
    def frame(e: ApiError) -> str:
        builder.response.update(status="failed", error={"code": e.code or "server_error", "message": e.message})
        return sse_event("response.failed", builder.event("response.failed", response=builder.response))

    return frame


# -- the request as a chat -------------------------------------------------------------------------

def input_items_of(req: ResponsesRequest) -> list[dict]:
    """The request's input as items (what `input_items` lists and the store keeps)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    out = []
    for item in req.input:
        d = item.model_dump(exclude_none=True)
        d.setdefault("type", "message")
        out.append(d)
    return out


def chat_body(req: ResponsesRequest, history: list[dict], items: list[dict], srv: Served) -> dict:
    """The chat request this Responses request is: instructions as the system message (never
    carried over from an earlier response, as OpenAI's), the conversation as messages."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    n_hist = len(history)

    def place(i: int) -> str:
        return f"input[{i - n_hist}]" if i >= n_hist else f"the conversation of previous_response_id (item {i})"

    messages += items_to_messages(history + items, place, srv)
    body = {"messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "ignore_eos": req.ignore_eos,
            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [function_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        tc = req.tool_choice
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            if fmt.schema_ is None:
                raise ApiError("text.format of type json_schema needs a schema", param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    return {k: v for k, v in body.items() if v is not None}


def function_tool(t, i: int) -> dict:
    if t.type != "function":
        raise ApiError(f"tools[{i}].type is {t.type[:32]!r}: this server runs function tools only",
                       param=f"tools[{i}].type")
    if t.name is None:
        raise ApiError(f"tools[{i}] has no name: a function tool is named", param=f"tools[{i}].name")
    fn = {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def items_to_messages(items: list[dict], place, srv: Served) -> list[dict]:
    """Items -> chat messages: a model's function calls join the assistant message before them
    (or make one), a reasoning item goes with the assistant turn after it, an output answers its
    call as a tool message."""
    msgs: list[dict] = []
    reasoning = None
    for i, it in enumerate(items):
        t = it.get("type", "message")
        if t == "reasoning":
            reasoning = reasoning_text(it) or reasoning
            continue
        if t == "message":
            text = content_text(it.get("content"), f"{place(i)}.content", srv)
            m = {"role": it["role"], "content": text}
            if it["role"] == "assistant" and reasoning:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
        elif t == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": None}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, None
                msgs.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:  # function_call_output
            out = content_text(it.get("output"), f"{place(i)}.output", srv)
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": out})
    return msgs


def content_text(content, at: str, srv: Served) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content or ()):
        if p["type"] in TEXT_PARTS:
            parts.append(p["text"])
        elif p["type"] == "refusal":
            parts.append(str(p.get("refusal", "")))
        else:
            check_part(p["type"], f"{at}[{j}]", srv.info.modalities, srv.name)
    return "".join(parts)


def reasoning_text(item: dict) -> str | None:
    """A reasoning item's text: its content, else our own opaque string (another server's is not
    readable here and is left out)."""
    texts = [c.get("text") for c in item.get("content") or () if isinstance(c, dict)]
    if any(isinstance(t, str) for t in texts):
        return "".join(t for t in texts if isinstance(t, str))
    blob = item.get("encrypted_content")
    if isinstance(blob, str) and blob.startswith(OPAQUE_PREFIX):
        try:
            return base64.b64decode(blob[len(OPAQUE_PREFIX):], validate=True).decode()
        except ValueError:
            return None
    return None


def opaque(text: str) -> str:
    return OPAQUE_PREFIX + base64.b64encode(text.encode()).decode()


# -- the chat stream as Responses events -------------------------------------------------------------

class ResponseBuilder:
    """Chat chunks in, Responses events out; `response` is the final object either way."""

    def __init__(self, srv: Served, req: ResponsesRequest, params):
        self.srv, self.req = srv, req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0
        self.open: dict | None = None  # the output item being streamed
        self.reasoning_text = ""
        self.finish_reason = None
        self.usage: dict | None = None
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        self.response = {
            "id": self.id, "object": "response", "created_at": self.created, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": srv.name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "truncation": req.truncation
            or "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}, "background": False,
        }
        if self.response["tool_choice"] is None:
            self.response["tool_choice"] = "auto"

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        snap = dict(self.response, output=[])
        return [self.event("response.created", response=snap), self.event("response.in_progress", response=snap)]

    # -- items ---------------------------------------------------------------------------------------
    def _open(self, item: dict, part: dict | None = None) -> list[dict]:
        out = self._close()
        idx = len(self.response["output"])
        self.response["output"].append(item)
        self.open = {"item": item, "index": idx, "part": part}
        out.append(self.event("response.output_item.added", output_index=idx, item=_snapshot(item)))
        if part is not None:
            item["content"].append(part)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part=dict(part)))
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        item, idx, part = self.open["item"], self.open["index"], self.open["part"]
        self.open = None
        out = []
        ids = {"item_id": item["id"], "output_index": idx}
        if item["type"] == "message":
            out.append(self.event("response.output_text.done", **ids, content_index=0, text=part["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=part))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **ids, content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=part))
            if ENCRYPTED in (self.req.include or ()):
                item["encrypted_content"] = opaque(part["text"])
        else:
            out.append(self.event("response.function_call_arguments.done", **ids, name=item["name"],
                                  arguments=item["arguments"]))
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def _kind_open(self) -> str | None:
        return None if self.open is None else self.open["item"]["type"]

    def feed(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        for ch in chunk.get("choices") or ():
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                if self._kind_open() != "reasoning":
                    out += self._open({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                                       "content": [], "status": "in_progress"},
                                      {"type": "reasoning_text", "text": ""})
                o = self.open
                o["part"]["text"] += d["reasoning_content"]
                self.reasoning_text += d["reasoning_content"]
                out.append(self.event("response.reasoning_text.delta", item_id=o["item"]["id"],
                                      output_index=o["index"], content_index=0, delta=d["reasoning_content"]))
            if d.get("content"):
                if self._kind_open() != "message":
                    out += self._open({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                       "role": "assistant", "content": []},
                                      {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                o = self.open
                o["part"]["text"] += d["content"]
                out.append(self.event("response.output_text.delta", item_id=o["item"]["id"], output_index=o["index"],
                                      content_index=0, delta=d["content"], logprobs=[]))
            for tc in d.get("tool_calls") or ():
                if "id" in tc:  # a call's first delta: its id and name
                    out += self._open({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                       "call_id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                frag = tc["function"].get("arguments") or ""
                if frag and self._kind_open() == "function_call":
                    o = self.open
                    o["item"]["arguments"] += frag
                    out.append(self.event("response.function_call_arguments.delta", item_id=o["item"]["id"],
                                          output_index=o["index"], delta=frag))
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out

    def finish(self) -> list[dict]:
        out = self._close()
        u = self.usage or {"prompt_tokens": 0, "completion_tokens": 0}
        reasoning_tokens = (len(self.srv.tok.encode(self.reasoning_text, add_special_tokens=False))
                            if self.reasoning_text else 0)
        self.response["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u["completion_tokens"])},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}
        if self.finish_reason == "length":
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            out.append(self.event("response.incomplete", response=self.response))
        else:
            self.response["status"] = "completed"
            out.append(self.event("response.completed", response=self.response))
        return out


def _snapshot(item: dict) -> dict:
    return json.loads(json.dumps(item))

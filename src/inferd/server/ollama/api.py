"""Ollama's API: `/api/chat`, `/api/generate` (NDJSON streams), `/api/tags`, `/api/show`,
`/api/ps`, `/api/version`, and a plain 400 for what a server of fixed models does not do (`pull`,
`push`, `create`, `copy`, `delete`).

`/api/chat` is a chat request (`openai.chat.prepare`: template, sampling, tools, `format` through
structured output) and `/api/generate` the same with one user turn, or with `raw` the prompt's own
tokens; `OllamaBuilder` turns the chat stream into Ollama's lines, and its last line is the
non-streaming body. `keep_alive` sets the model's idle time in the models table (models.py), as
Ollama's does: 0 unloads it once its requests finish, a negative value keeps it loaded. Ollama's
`/api/embed` and `/api/embeddings` are in embed.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from inferd.server.dialects import ollama_error
from inferd.server.generation import ARRIVAL, SSEResponse, Served, framed, primed, translated
from inferd.server.models import Entry, Models, path_bytes, rfc3339
from inferd.server.ollama.protocol import (ChatRequest, ChatResponse, GenerateRequest, GenerateResponse, ModelTags,
                                           ShowRequest, ShowResponse, Version, ollama_error_responses, served_name)
from inferd.server.openai.chat import ChatTurn, chat_chunks, chat_request, prepare, render
from inferd.server.protocol import COMMON_ERRORS, ApiError, check_part

# The Ollama API version reported to clients: editors and UIs gate features on it (tools, thinking,
# structured outputs arrived by 0.9), so it names the API this server speaks, not inferd's version.
API_VERSION = "0.12.0"
ERRORS = ollama_error_responses(*COMMON_ERRORS, 404, 500)
NDJSON = "application/x-ndjson"
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class JSONBodies(APIRoute):
    """Ollama's clients (and the curl lines of its docs) post JSON without saying so, or as a form:
    every body of these routes is read as JSON."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = {**request.scope, "headers": headers + [(b"content-type", b"application/json")]}
            return await handler(Request(scope, request.receive))

        return route


def router(models: Models) -> APIRouter:
    r = APIRouter(route_class=JSONBodies)

    @r.post("/api/chat", responses={200: {"model": ChatResponse, "content": {NDJSON: {"schema": {"type": "string"}}}},
                                    **ERRORS})
    async def chat(req: ChatRequest):
        """Ollama's chat (NDJSON stream unless `stream: false`); no messages: load the model."""
        e = find(models, req.model)
        if not req.messages:
            return await load_only(models, e, req, "message")
        async with models.use(e.name) as srv:
            out = await answer(srv, req, chat_request(chat_body(req, srv)), "chat")
        keep_alive(models, e, req)
        return out

    @r.post("/api/generate", responses={
        200: {"model": GenerateResponse, "content": {NDJSON: {"schema": {"type": "string"}}}}, **ERRORS})
    async def generate(req: GenerateRequest):
        """Ollama's completion of one prompt (through the chat template unless `raw`); an empty
        prompt loads the model."""
        e = find(models, req.model)
        for name in ("suffix", "template"):
            if getattr(req, name):
                raise ApiError(f"{name} is not supported by this server (the model's own chat template is used, "
                               "with no fill-in-the-middle)", param=name)
        if req.context:
            raise ApiError("context (Ollama's deprecated token context) is not supported: send the conversation "
                           "to /api/chat", param="context")
        if not req.prompt:
            return await load_only(models, e, req, "response")
        async with models.use(e.name) as srv:
            for i, _ in enumerate(req.images or ()):
                check_part("image", f"images[{i}]", srv.info.modalities, srv.name)
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}]
            chat = chat_request({"messages": messages, **sampling(req)})
            ids = srv.tok.encode(req.prompt) if req.raw else None
            out = await answer(srv, req, chat, "generate", ids)
        keep_alive(models, e, req)
        return out

    @r.get("/api/tags", responses={200: {"model": ModelTags}, **ERRORS})
    async def tags():
        """The served models (loaded or not), as Ollama lists its local models."""
        return {"models": [tag(models, e) for e in models.entries]}

    @r.post("/api/show", responses={200: {"model": ShowResponse}, **ERRORS})
    async def show(req: ShowRequest):
        """A model's template, context length and capabilities (it is loaded to read them)."""
        name = req.model or req.name
        if not name:
            raise ApiError("model is required", param="model")
        e = find(models, name)
        async with models.use(e.name) as srv:
            facts = model_facts(e)
            arch = facts["family"] or "unknown"
            caps = ["completion", "tools"] + (["thinking"] if srv.reasoning_parser else [])
            return {"modelfile": "", "parameters": "", "template": srv.tok.chat_template or "",
                    "details": details(facts), "capabilities": caps, "modified_at": modified(e),
                    "model_info": {"general.architecture": arch, f"{arch}.context_length": srv.max_len,
                                   "general.basename": e.name}}

    @r.get("/api/ps", responses={200: {"model": ModelTags}, **ERRORS})
    async def ps():
        """The loaded models, their engine's memory, and when an idle one will be unloaded."""
        out = []
        for e, srv in models.loaded_served():
            exp = models.expires_at(e)
            out.append({**tag(models, e), "size": e.rss or 0, "size_vram": 0, "context_length": srv.max_len,
                        # Ollama's "never": a time far ahead
                        "expires_at": rfc3339(exp) if exp is not None else "2318-01-01T00:00:00Z"})
        return {"models": out}

    @r.get("/api/version", responses={200: {"model": Version}, **ERRORS})
    async def version():
        return {"version": API_VERSION}

    for path, method in (("/api/pull", "POST"), ("/api/push", "POST"), ("/api/create", "POST"),
                         ("/api/copy", "POST"), ("/api/delete", "DELETE")):
        r.add_api_route(path, refused(path), methods=[method], responses=ERRORS,
                        summary=f"{path} is not supported: the server serves the models it was started with")
    return r


def refused(path: str):
    async def route():
        raise ApiError(f"{path} is not supported: inferd serves the models it was started with; give them to "
                       "`inferd serve --model` (a GGUF file, a Hugging Face folder or id)", param=path)

    route.__name__ = "refused_" + path.rsplit("/", 1)[-1]
    return route


def find(models: Models, name: str) -> Entry:
    """A model by name; Ollama's clients may add the default tag `:latest`."""
    try:
        return models.find(served_name(name, models.by_name))
    except ApiError:
        raise ApiError(f"model '{name[:256]}' not found (served: {', '.join(models.names())})", status=404,
                       param="model", type_="not_found_error") from None


# -- keep_alive ----------------------------------------------------------------------------------------

def parse_keep_alive(v) -> float | None:
    """Seconds (a number, or a Go duration such as "5m", "1h30m", "-1"); None: for ever."""
    if isinstance(v, (int, float)):
        secs = float(v)
    else:
        text = v.strip()
        try:
            secs = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(a + u for a, u in parts) != text:
                raise ApiError(f"keep_alive is {text[:32]!r}: give seconds or a duration such as \"5m\" or "
                               "\"1h30m\"", param="keep_alive") from None
            secs = sum(float(a) * _UNITS[u] for a, u in parts)
    return None if secs < 0 else secs


def keep_alive(models: Models, e: Entry, req):
    if req.keep_alive is not None:
        models.set_keep_alive(e, parse_keep_alive(req.keep_alive))


async def load_only(models: Models, e: Entry, req, field: str):
    """Ollama's load (or, with keep_alive 0, unload) request: no prompt, no generation."""
    ka = parse_keep_alive(req.keep_alive) if req.keep_alive is not None else -1
    body = {"model": req.model, "created_at": now(), "done": True}
    body[field] = {"role": "assistant", "content": ""} if field == "message" else ""
    if ka == 0:
        await models.unload(e, "api")
        return {**body, "done_reason": "unload"}
    await models.ensure_loaded(e)
    keep_alive(models, e, req)
    return {**body, "done_reason": "load"}


# -- the request as a chat ---------------------------------------------------------------------------

def sampling(req) -> dict:
    """Ollama's options and format as a chat request's fields."""
    o = req.options
    body: dict = {}
    if o is not None:
        body.update(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p, seed=o.seed,
                    stop=o.stop, repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
                    frequency_penalty=o.frequency_penalty)
    if req.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": req.format}}
    if req.think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.think is not False}
    return {k: v for k, v in body.items() if v is not None}


def chat_body(req: ChatRequest, srv: Served) -> dict:
    messages = []
    for i, m in enumerate(req.messages):
        for j, _ in enumerate(m.images or ()):
            check_part("image", f"messages[{i}].images[{j}]", srv.info.modalities, srv.name)
        d: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for k, c in enumerate(m.tool_calls)]
        if m.role == "assistant" and m.thinking:
            d["reasoning_content"] = m.thinking
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        messages.append(d)
    body = {"messages": messages, **sampling(req)}
    if req.tools:
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return body


def output_budget(req, n_prompt: int, max_len: int) -> int:
    """max_tokens under Ollama's rules: num_predict is a ceiling (-1, -2: none), the context
    num_ctx if given (within the model's)."""
    o = req.options
    limit = min(o.num_ctx, max_len) if o is not None and o.num_ctx else max_len
    if n_prompt >= limit:
        what = "options.num_ctx" if limit < max_len else "the model's context"
        raise ApiError(f"the prompt is {n_prompt} tokens: it fills {what} ({limit} tokens)",
                       param="options.num_ctx" if limit < max_len else "messages")
    n = o.num_predict if o is not None else None
    if n == 0:
        raise ApiError("options.num_predict is 0: give at least 1, or -1 for no limit", param="options.num_predict")
    room = limit - n_prompt
    return room if n is None or n < 0 else min(n, room)


async def answer(srv: Served, req, chat, kind: str, ids: list[int] | None = None):
    t0 = time.monotonic()
    arrival = ARRIVAL.get() or t0
    if ids is None:
        ids = render(srv, chat)
    chat.max_tokens = output_budget(req, len(ids), srv.max_len)
    turn = prepare(srv, chat, ids)
    builder = OllamaBuilder(srv, req, kind, turn, arrival)
    chunks = chat_chunks(srv, chat, turn, f"ollama-{uuid.uuid4().hex}", 0, True, False, cached_details=True)
    if req.stream:
        chunks = await primed(chunks)

    lines = translated(chunks, list, builder.feed, builder.finish)  # Ollama's stream has no opening line
    if req.stream:
        return SSEResponse(framed(lines, lambda d: json.dumps(d, ensure_ascii=False) + "\n",
                                  lambda e: json.dumps(ollama_error(e.message)) + "\n"), srv.stall_timeout, NDJSON)
    async for _ in lines:
        pass
    return JSONResponse(builder.body)


# -- the chat stream as Ollama lines ----------------------------------------------------------------

class OllamaBuilder:
    """Chat chunks in, Ollama's NDJSON lines out (message deltas for /api/chat, response deltas
    for /api/generate); `body` is the non-streaming answer: everything folded into the last line."""

    def __init__(self, srv: Served, req, kind: str, turn: ChatTurn, arrival: float):
        self.srv, self.req, self.kind, self.turn = srv, req, kind, turn
        self.arrival = arrival
        self.first: float | None = None
        self.text, self.thinking = "", ""
        self.calls: list[dict] = []  # {"name", "arguments" (JSON text so far)}
        self.finish_reason = None
        self.usage: dict | None = None
        self.body: dict = {}

    def _line(self, content: str = "", thinking: str = "", calls: list | None = None, **extra) -> dict:
        line = {"model": self.req.model, "created_at": now()}
        if self.kind == "chat":
            msg = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            line["message"] = msg
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        line["done"] = False
        line.update(extra)
        return line

    def feed(self, chunk: dict) -> list[dict]:
        out = []
        for ch in chunk.get("choices") or ():
            d = ch.get("delta") or {}
            if (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")) and self.first is None:
                self.first = time.monotonic()
            if d.get("reasoning_content") or d.get("content"):
                self.thinking += d.get("reasoning_content") or ""
                self.text += d.get("content") or ""
                out.append(self._line(d.get("content") or "", d.get("reasoning_content") or ""))
            for tc in d.get("tool_calls") or ():
                if "id" in tc:
                    self.calls.append({"name": tc["function"]["name"], "arguments": ""})
                if self.calls:
                    self.calls[-1]["arguments"] += tc["function"].get("arguments") or ""
            if ch.get("finish_reason") is not None:
                self.finish_reason = ch["finish_reason"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return out

    def finish(self) -> list[dict]:
        """Ollama sends calls whole (its arguments an object), then the closing line with the counts."""
        out = []
        calls = [{"function": {"name": c["name"], "arguments": call_arguments(c["arguments"])}} for c in self.calls]
        if calls:
            out.append(self._line(calls=calls))
        end = time.monotonic()
        first = self.first or end
        u = self.usage or {"prompt_tokens": len(self.turn.ids), "completion_tokens": 0}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        stats = {"done_reason": "length" if self.finish_reason == "length" else "stop",
                 "total_duration": ns(end - self.arrival), "load_duration": 0,
                 "prompt_eval_count": u["prompt_tokens"] - cached, "prompt_eval_duration": ns(first - self.arrival),
                 "eval_count": u["completion_tokens"], "eval_duration": ns(end - first)}
        last = self._line(**stats)
        last["done"] = True
        out.append(last)
        self.body = self._line(self.text, self.thinking, calls, **stats)
        self.body["done"] = True
        return out


def call_arguments(text: str) -> dict:
    try:
        v = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"arguments": text}
    return v if isinstance(v, dict) else {"arguments": v}


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


# -- what the model is ---------------------------------------------------------------------------------

_FACTS: dict[str, dict] = {}


def model_facts(e: Entry) -> dict:
    """Family, format and quantization of a served model: from its engine once loaded, from its
    file's metadata (read once) before."""
    info = e.served.info if e.served is not None else None
    path = info.model_path if info is not None else e.spec.source_path
    facts = dict(_file_facts(path, getattr(e.spec.config, "quantization", "none")))
    if info is not None and info.architecture:
        facts["family"] = info.architecture
    return facts


def _file_facts(path: str | None, quant: str | None) -> dict:
    key = f"{path}\0{quant}"
    if key not in _FACTS:
        _FACTS[key] = _read_facts(path, quant)
    return _FACTS[key]


def _read_facts(path: str | None, quant: str | None) -> dict:
    from inferd.errors import InferdError
    from inferd.gguf_file import read_gguf_metadata

    facts = {"family": "", "format": "", "quantization": "" if quant in (None, "none", "auto") else quant,
             "path": path}
    if path and os.path.isfile(path) and path.endswith(".gguf"):
        facts["format"] = "gguf"
        try:
            meta = read_gguf_metadata(path)
            facts["family"] = str(meta.get("general.architecture", ""))
            facts["parameter_size"] = str(meta.get("general.size_label", ""))
            if not facts["quantization"]:
                facts["quantization"] = file_type_name(meta.get("general.file_type"))
        except InferdError:
            pass
    elif path and os.path.isdir(path):
        facts["format"] = "safetensors"
        try:
            with open(os.path.join(path, "config.json")) as f:
                facts["family"] = str(json.load(f).get("model_type", ""))
        except (OSError, ValueError, AttributeError):
            pass
    return facts


def details(facts: dict) -> dict:
    fam = facts["family"]
    return {"parent_model": "", "format": facts["format"], "family": fam, "families": [fam] if fam else [],
            "parameter_size": facts.get("parameter_size", ""),
            "quantization_level": facts["quantization"]}


def file_type_name(ft) -> str:
    """llama.cpp's file type number as Ollama names it (Q4_1, Q8_0, F16)."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return ""


def modified(e: Entry) -> str:
    path = model_facts(e)["path"]
    try:
        return rfc3339(os.path.getmtime(path))
    except (OSError, TypeError):
        return rfc3339(time.time())


def tag(models: Models, e: Entry) -> dict:
    facts = model_facts(e)
    # an identifier of the served model (its name and file), not a hash of the file's bytes
    digest = hashlib.sha256(f"{e.name}\0{facts['path']}".encode()).hexdigest()
    return {"name": e.name, "model": e.name, "modified_at": modified(e), "size": path_bytes(facts["path"]),
            "digest": digest, "details": details(facts)}

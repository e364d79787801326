"""OpenAI tool calling on top of structured output.

`tool_choice` decides how the model's answer becomes calls:
* "required": the output is constrained to a JSON array of {"name", "arguments"} objects, one
  schema per tool (its name a constant, its arguments the tool's parameters), read back as calls;
* a named function: the output is constrained to that function's arguments;
* "auto": the model chooses; calls are read out of its text in the Hermes format
  (<tool_call>{"name": .., "arguments": ..}</tool_call>), which Qwen 2.5/3, Hermes 2/3 and
  SmolLM3 templates write. A template that has no tool format (SmolLM2's) is given the tools, and
  told that format, in its system message by inferd;
* "none": tools are shown to the template but no call is read.

Each mode is a small stream transformer (`CallStream.feed(text) -> deltas`), so a streamed answer
sends OpenAI's tool-call deltas (the first with index, id, type and name and empty arguments, then
argument fragments) and a non-streamed one folds the very same deltas.
"""
from __future__ import annotations

import json
import re
import uuid

from inferd.engine.request import StructuredOutputs
from inferd.server.protocol import ApiError, ChatCompletionRequest

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def tool_mode(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return "none", None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ApiError("tools has two functions of the same name", param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        return choice, None
    if choice.function.name not in names:
        raise ApiError(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                       param="tool_choice")
    return "named", choice.function.name


def tool_constraint(req: ChatCompletionRequest, mode: str, name: str | None) -> StructuredOutputs | None:
    if mode not in ("required", "named"):
        return None
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == name)
        return StructuredOutputs(json=parameters(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in req.tools]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


# -- rendering ----------------------------------------------------------------------------------

def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and "tool_call" in template


def tools_system_text(tools) -> str:
    specs = "\n".join(json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)},
                                 ensure_ascii=False) for t in tools)
    return ("You can call functions. Their descriptions, as JSON schemas:\n<tools>\n" + specs + "\n</tools>\n"
            "To call one, answer with a block of this form for each call:\n" + TOOL_OPEN
            + '\n{"name": <function name>, "arguments": <the arguments as a JSON object>}\n' + TOOL_CLOSE)


def render_messages(messages, tools, tool_choice, native: bool) -> tuple[list[dict], dict]:
    """Messages (as dicts) and extra template variables. A template with a tool format gets the
    tools and the calls as they are; any other gets them as Hermes-format text."""
    msgs = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # content parts: text only (any other was refused, check_parts)
            content = "".join(p.text or "" for p in content if p.type == "text")
        # developer is OpenAI's newer name of system, which is the name chat templates know
        d = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                   "arguments": _args(c.function.arguments)}}
                     for c in m.tool_calls]
            if native:
                d["tool_calls"] = calls
            else:
                d["content"] = "\n".join([d["content"]] * bool(d["content"]) + [
                    f'{TOOL_OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)}\n{TOOL_CLOSE}'
                    for c in calls])
        if m.role == "tool":
            if native:
                if m.tool_call_id is not None:
                    d["tool_call_id"] = m.tool_call_id
            else:
                d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
        if m.name is not None and native:
            d["name"] = m.name
        reasoning = getattr(m, "reasoning_content", None)
        if m.role == "assistant" and isinstance(reasoning, str) and reasoning:
            d["reasoning_content"] = reasoning  # thinking templates keep the current turn's reasoning
        msgs.append(d)
    extra = {}
    if tools:
        if native:
            extra["tools"] = [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                              for t in tools]
        elif tool_choice != "none":
            text = tools_system_text(tools)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": (msgs[0]["content"] + "\n\n" + text).strip()}
            else:
                msgs.insert(0, {"role": "system", "content": text})
    return msgs, extra


def _args(a):
    """Arguments of an earlier call as the template should see them: the object, if it parses."""
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


# -- reading calls out of the stream ------------------------------------------------------------

def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def header(index: int, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def fragment(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class NamedCall:
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def feed(self, text: str) -> list[dict]:
        out = []
        if not self.calls:
            self.calls = 1
            out.append(header(0, self.name))
        if text:
            out.append(fragment(0, text))
        return out

    def finish(self) -> list[dict]:
        return self.feed("") if not self.calls else []


_CALL_HEAD = re.compile(r'\s*[\[,]?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class RequiredCalls:
    """tool_choice "required": the output is [{"name": .., "arguments": {..}}, ...] (name first, as
    the schema orders it); each call is announced when its name is complete, and its arguments'
    text is forwarded as it comes."""

    def __init__(self):
        self.buf, self.pos, self.calls = "", 0, 0
        self.in_args, self.depth, self.in_str, self.esc = False, 0, False, False

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out = []
        while True:
            if not self.in_args:
                m = _CALL_HEAD.match(self.buf, self.pos)
                if not m:
                    break
                out.append(header(self.calls, json.loads(m.group(1))))
                self.pos, self.in_args, self.depth, self.in_str, self.esc = m.end(), True, 0, False, False
                continue
            end = self._scan()
            frag = self.buf[self.pos:end]
            if frag:
                out.append(fragment(self.calls, frag))
            self.pos = end
            if end < len(self.buf):  # the value ended (at a ',' '}' or ']' outside it)
                self.in_args = False
                self.calls += 1
                self.pos = end + 1 if self.buf[end] == "}" else end  # the call object's own '}'
                continue
            break
        return out

    def _scan(self) -> int:
        """Advance over the arguments' value from self.pos; the index where it ends, or len(buf)."""
        for i in range(self.pos, len(self.buf)):
            c = self.buf[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" and self.depth > 0:
                self.depth -= 1
            elif c in ",}]" and self.depth == 0:
                return i
        return len(self.buf)

    def finish(self) -> list[dict]:
        if self.in_args:
            self.calls += 1
        return []


class HermesCalls:
    """tool_choice "auto": text, with calls written as <tool_call>{json}</tool_call> blocks. Text
    outside them is content (a possible start of a block is held back); each block that parses is
    a call, sent whole when it closes; one that does not parse is content."""

    def __init__(self):
        self.buf, self.pos, self.inside, self.calls = "", 0, False, 0

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out = []
        while True:
            if not self.inside:
                j = self.buf.find(TOOL_OPEN, self.pos)
                if j < 0:
                    keep = next((k for k in range(min(len(TOOL_OPEN) - 1, len(self.buf) - self.pos), 0, -1)
                                 if self.buf.endswith(TOOL_OPEN[:k])), 0)
                    self._content(out, self.buf[self.pos:len(self.buf) - keep])
                    self.pos = len(self.buf) - keep
                    break
                self._content(out, self.buf[self.pos:j])
                self.pos, self.inside = j + len(TOOL_OPEN), True
                continue
            j = self.buf.find(TOOL_CLOSE, self.pos)
            if j < 0:
                break
            body = self.buf[self.pos:j]
            self.pos, self.inside = j + len(TOOL_CLOSE), False
            call = _parse_call(body)
            if call is None:
                self._content(out, TOOL_OPEN + body + TOOL_CLOSE)
            else:
                out.append(header(self.calls, call[0]))
                out.append(fragment(self.calls, call[1]))
                self.calls += 1
        return out

    def _content(self, out: list, text: str):
        if text and (text.strip() or not self.calls):
            out.append({"content": text})

    def finish(self) -> list[dict]:
        out = []
        rest = (TOOL_OPEN if self.inside else "") + self.buf[self.pos:]
        self.pos = len(self.buf)
        self._content(out, rest)
        return out


def _parse_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def call_stream(mode: str, name: str | None):
    return {"named": lambda: NamedCall(name), "required": RequiredCalls, "auto": HermesCalls}[mode]()

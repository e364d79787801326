"""Request and response schemas of OpenAI's Responses API (`/v1/responses`), with the server's
usual bounds: every number has a range, every list a length, and each wrong input item is one
plain line naming its place (`input[2].type`)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.server.protocol import (INT32_MAX, MAX_MESSAGES, MAX_TOOLS, ApiError, Count, Seed, Strict, _Open, kind,
                                    shown)

MAX_INCLUDE = 16
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("user", "assistant", "system", "developer")
# Fields that would change what the answer must be, which inferd does not implement: a 400 naming
# the field (name -> the values that mean "not asked for")
UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,),
               "top_logprobs": (None, 0), "max_tool_calls": (None,)}


class InputPart(BaseModel):
    """A part of an input message's content: input_text / output_text (text), refusal, or a part
    of another kind (input_image, input_file) that only a model taking that input reads."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str = Field(max_length=64)
    text: str | None = None


class InputItem(BaseModel):
    """One item of `input`: a message (`type` may be left out), a function call the model made, a
    function's output, or a reasoning item an earlier response returned."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str | None = Field(None, max_length=64)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Union[str, list[InputPart], None] = None
    id: str | None = Field(None, max_length=256)
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = None
    output: Union[str, list[InputPart], None] = None
    summary: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = Field(None, max_length=32)


class FunctionTool(BaseModel):
    """A tool: only `function` tools are run here (their `name`, `description`, `parameters`)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str = Field(max_length=64)
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Strict):
    type: Literal["function"]
    name: str = Field(max_length=256)


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = Field(None, max_length=16)


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    effort: str | None = Field(None, max_length=16)
    summary: str | None = Field(None, max_length=16)


class ResponsesRequest(Strict):
    model: str | None = Field(None, max_length=256)
    input: Union[str, list[InputItem]] = Field(description="a string (one user message) or a list of items")
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extension
    seed: Seed | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension (inferd bench: fixed output lengths)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    include: list[str] | None = Field(None, max_length=MAX_INCLUDE)
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and data[name] not in neutral:
                    raise ApiError(f"{name} is not supported by this server's Responses API", param=name)
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v):
        check_input(v)
        return v

    @field_validator("include", mode="before")
    @classmethod
    def _include(cls, v):
        if isinstance(v, list):
            for i, x in enumerate(v):
                if not isinstance(x, str) or len(x) > 64:
                    raise ApiError(f"include[{i}] is {shown(x)}: include lists names such as "
                                   "'reasoning.encrypted_content'", param=f"include[{i}]")
        return v


def check_input(v):
    """`input`: a string, or a non-empty list of items, each an object of a known type."""
    if isinstance(v, str):
        return
    if not isinstance(v, list):
        raise ApiError(f"input is {kind(v)}: give a string or a list of input items", param="input")
    if not v:
        raise ApiError("input is an empty list: give a string or at least one input item", param="input")
    if len(v) > MAX_MESSAGES:
        raise ApiError(f"input holds {len(v)} items: at most {MAX_MESSAGES} in one request", param="input")
    for i, item in enumerate(v):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{at} is {kind(item)}: an input item is an object such as "
                           '{"role": "user", "content": "..."}', param=at)
        t = item.get("type", "message" if "role" in item else None)
        if t is None:
            raise ApiError(f"{at} has no type and no role: give a message's role, or the item's type "
                           f"({', '.join(ITEM_TYPES)})", param=at)
        if not isinstance(t, str) or t not in ITEM_TYPES:
            raise ApiError(f"{at}.type is {shown(t)}: this server takes input items of type "
                           f"{', '.join(ITEM_TYPES)}", param=f"{at}.type")
        if t == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ApiError(f"{at}.role is {shown(role) if 'role' in item else 'missing'}: a message's role is "
                               f"one of {', '.join(ROLES)}", param=f"{at}.role")
            _check_parts(item.get("content"), f"{at}.content", allow_none=False)
        elif t == "function_call":
            for f in ("call_id", "name", "arguments"):
                if not isinstance(item.get(f), str):
                    raise ApiError(f"{at}.{f} is {kind(item.get(f))}: a function_call item has a call_id, a name "
                                   "and arguments (a JSON string)", param=f"{at}.{f}")
        elif t == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"{at}.call_id is {kind(item.get('call_id'))}: a function_call_output names the "
                               "call_id it answers", param=f"{at}.call_id")
            _check_parts(item.get("output"), f"{at}.output", allow_none=False)


def _check_parts(content, at: str, allow_none: bool):
    if isinstance(content, str) or (content is None and allow_none):
        return
    if not isinstance(content, list) or not content:
        raise ApiError(f"{at} is {kind(content) if content != [] else 'an empty list'}: give a string or a list "
                       "of content parts", param=at)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(f'{at}[{j}] is {kind(part)} without a type: a content part is an object such as '
                           '{"type": "input_text", "text": "..."}', param=f"{at}[{j}]")
        if part["type"] in ("input_text", "output_text", "text") and not isinstance(part.get("text"), str):
            raise ApiError(f"{at}[{j}] is a {part['type']} part whose text is {kind(part.get('text'))}, not a "
                           "string", param=f"{at}[{j}]")


# -- response schemas (the OpenAPI document) -------------------------------------------------------

class ResponseObject(_Open):
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: str
    deleted: bool


class InputItemList(BaseModel):
    object: str
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool

"""Request and response schemas of Anthropic's Messages API, with the server's usual bounds: every
number has a range, every list a length, and each malformed message or content block is one plain
line naming its place (`messages[1].content[0].type`)."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.server.protocol import (INT32_MAX, MAX_MESSAGES, MAX_STOP, MAX_TOOLS, ApiError, Count, StopString, Strict,
                                    _Open, each_message, kind, shown)

ROLES = ("user", "assistant")
# block type -> the modality a model must read it in (None: text the server renders itself)
BLOCK_TYPES = {"text": None, "tool_use": None, "tool_result": None, "thinking": None, "redacted_thinking": None,
               "image": "image", "document": "file", "search_result": None}
# Fields naming what inferd does not run (Anthropic's hosted MCP connectors and code containers):
# a 400 naming the field, never silently dropped
UNSUPPORTED = {"mcp_servers": (None, []), "container": (None,)}


class Block(BaseModel):
    """A content block: text, tool_use (an assistant's call), tool_result (its answer, in a user
    turn), thinking (an earlier turn's reasoning), or image / document (refused by a text model)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str = Field(max_length=64)
    text: str | None = None
    id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, max_length=256)
    content: Union[str, list[dict[str, Any]], None] = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class SystemBlock(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class Tool(BaseModel):
    """A client tool (its name, description and input schema). Anthropic's server tools (web
    search, code execution: a `type` with a date) are not run here."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = Field(None, max_length=64)
    cache_control: dict[str, Any] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=256)
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Count | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Anthropic's output_config: `format` (a JSON schema the answer follows: structured output);
    `effort` is the model's own business and is not read."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    format: OutputFormat | None = None
    effort: str | None = Field(None, max_length=16)


class _Conversation(Strict):
    model: str | None = Field(None, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Union[str, list[SystemBlock], None] = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # the whole prompt's marker: the prefix cache keeps it anyway

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and data[name] not in neutral:
                    raise ApiError(f"{name} is not supported by this server", param=name)
        return data

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_shape(cls, v):
        check_messages(v)
        return v


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[StopString] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = Field(None, max_length=32)
    ignore_eos: bool = False  # vLLM's extension (inferd bench: fixed output lengths)


class CountTokensRequest(_Conversation):
    pass


def check_messages(msgs):
    """Messages: a non-empty list of user / assistant turns, each a string or a list of blocks
    that name a known type."""
    for at, m in each_message(msgs, "give at least one message"):
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ApiError(f"{at}.role is {shown(m.get('role')) if 'role' in m else 'missing'}: a role is user or "
                           "assistant (the system prompt is the top-level system field)", param=f"{at}.role")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ApiError(f"{at}.content is {kind(content)}: content is a string or a list of content blocks",
                           param=f"{at}.content")
        for j, b in enumerate(content):
            where = f"{at}.content[{j}]"
            if not isinstance(b, dict):
                raise ApiError(f'{where} is {kind(b)}: a content block is an object such as {{"type": "text", '
                               '"text": "..."}', param=where)
            t = b.get("type")
            if not isinstance(t, str) or t not in BLOCK_TYPES:
                raise ApiError(f"{where}.type is {shown(t) if 'type' in b else 'missing'}: a content block is one of "
                               f"{', '.join(BLOCK_TYPES)}", param=f"{where}.type")
            need = {"text": "text", "tool_use": "name", "tool_result": "tool_use_id"}.get(t)
            if need is not None and not isinstance(b.get(need), str):
                raise ApiError(f"{where} is a {t} block whose {need} is {kind(b.get(need))}, not a string",
                               param=f"{where}.{need}")


# -- response schemas (the OpenAPI document) -------------------------------------------------------

class MessageResponse(_Open):
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, Any]


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: str
    error: AnthropicErrorDetail


def anthropic_error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` entries: an Anthropic error body for each status."""
    return {s: {"model": AnthropicError, "description": "error"} for s in statuses}

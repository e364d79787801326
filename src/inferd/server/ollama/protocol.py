"""Request and response schemas of Ollama's API (`/api/*`), with the server's usual bounds.

`options` carries Ollama's runner settings: those that choose what is generated are read
(num_predict, temperature, top_k, top_p, min_p, seed, stop, num_ctx, repeat_penalty,
presence_penalty, frequency_penalty); those about how Ollama runs a model (num_gpu, num_thread,
use_mmap, ...) mean nothing to this engine and are ignored, as Ollama ignores the ones a runner
does not know.

Ollama's own conventions live here too, one place each: a model's `name:tag` (`served_name`) and
the error body's schema (`OllamaError`; the body itself is `inferd.server.dialects.ollama_error`).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import Annotated

from inferd.server.embeddings import MAX_INPUTS, check_input
from inferd.server.protocol import (INT32_MAX, MAX_MESSAGES, MAX_STOP, MAX_TOOLS, ApiError, Seed, StopString, Strict,
                                    Tool, _Open, each_message, kind, shown)

ROLES = ("system", "user", "assistant", "tool")


class Options(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    num_predict: int | None = Field(None, ge=-2, le=INT32_MAX)
    num_ctx: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Seed | None = None
    stop: list[StopString] | None = Field(None, max_length=MAX_STOP)
    repeat_penalty: float | None = Field(None, gt=0, le=100)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class CallFunction(Strict):
    name: str = Field(max_length=256)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(Strict):
    function: CallFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    thinking: str | None = None
    tool_name: str | None = Field(None, max_length=256)


class _Generation(Strict):
    model: str = Field(max_length=256)
    format: Union[Literal["json", ""], dict[str, Any], None] = Field(
        None, description='"json" (any JSON value) or a JSON schema')
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: Union[str, float, None] = Field(
        None, description='how long the model stays loaded once idle: seconds, or a duration such as "5m"; '
                          "0 unloads it after this request, a negative value keeps it loaded")
    think: Union[bool, Literal["low", "medium", "high"], None] = None

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, v):
        if isinstance(v, bool):
            raise ApiError("keep_alive is a boolean: give seconds or a duration such as \"5m\"", param="keep_alive")
        if isinstance(v, int):
            return float(v)
        return v


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_shape(cls, v):
        check_messages(v)
        return v


class GenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = Field(None, max_length=1)  # Ollama's deprecated token context: not taken
    images: list[str] | None = Field(None, max_length=64)


class ShowRequest(Strict):
    model: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)  # the older field name, still sent by some clients
    verbose: bool = False


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
        return check_input(v)


class OllamaEmbeddingsRequest(Strict):
    """Ollama's legacy /api/embeddings body: one prompt."""
    model: str = Field(max_length=256)
    prompt: str = Field(min_length=1)
    options: dict | None = None
    keep_alive: Union[str, int, float, None] = None


def served_name(name: str, served) -> str:
    """The served model an Ollama client names: its default tag `:latest` means the model itself,
    unless only the tagged name is served."""
    base = name.removesuffix(":latest")
    return name if name in served and base not in served else base


def check_messages(msgs):
    for at, m in each_message(msgs, None):  # no messages at all: a request that only loads the model
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ApiError(f"{at}.role is {shown(m.get('role')) if 'role' in m else 'missing'}: a role is one of "
                           f"{', '.join(ROLES)}", param=f"{at}.role")
        if "content" in m and not isinstance(m["content"], str):
            raise ApiError(f"{at}.content is {kind(m['content'])}: content is a string (images go in images)",
                           param=f"{at}.content")


# -- response schemas (the OpenAPI document) -------------------------------------------------------

class ChatResponse(_Open):
    model: str
    created_at: str
    done: bool
    message: dict[str, Any] | None = None


class GenerateResponse(_Open):
    model: str
    created_at: str
    done: bool
    response: str | None = None


class ModelTags(BaseModel):
    models: list[dict[str, Any]]


class ShowResponse(_Open):
    template: str | None = None
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]


class Version(BaseModel):
    version: str


class OllamaError(BaseModel):
    error: str


def ollama_error_responses(*statuses: int, reasons: dict[int, str] | None = None) -> dict:
    """OpenAPI `responses` entries: an Ollama error body for each status, described by its reason
    where one is given."""
    return {s: {"model": OllamaError, "description": (reasons or {}).get(s, "error")} for s in statuses}

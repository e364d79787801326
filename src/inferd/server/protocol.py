"""Request schemas of the OpenAI-compatible API (pydantic, strict types, unknown fields ignored)."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inferd.engine.request import SamplingParams, StructuredOutputs
from inferd.errors import InferdError, openai_error

MAX_N = 16


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code
        self.headers = headers

    def body(self) -> dict:
        return openai_error(self.message, self.type, self.param, self.status if self.code is None else self.code)


# Bounds of the request fields. Every numeric field has a range (a value past 64 bits or a NaN is a
# 400, never a 500) and every list a length, each error naming the limit. They are published in the
# OpenAPI document (/openapi.json), which is what schemathesis fuzzes the server against.
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_MESSAGES = 1024  # messages in one chat
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_LOGPROBS = 20  # logprobs / top_logprobs, as vLLM's default --max-logprobs
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch.Generator.manual_seed takes
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
BiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
BiasValue = Annotated[float, Field(ge=-100, le=100)]

# Fields that would change what the output must be, which inferd does not implement: a 400 naming
# the field, never silently ignored. (name -> the values that mean "no constraint")
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),  # OpenAI's deprecated form of tools
    "guided_whitespace_pattern": (None,), "guided_decoding_backend": (None,), "prediction": (None,),
    "audio": (None,), "modalities": (None, ["text"]),
}
# vLLM's older names of structured_outputs' fields, still sent by many clients
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
MAX_TOOLS = 128


# keywords whose value is a schema or a list of schemas, and those whose value maps names to schemas
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items", "not", "if", "then", "else", "additionalItems",
               "contains", "additionalProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema):
    """OpenAI's strict mode: every object schema without `additionalProperties` is closed (strict
    mode requires `additionalProperties: false` on each; inferd sets it where it is left out)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in _SUBSCHEMAS else
           {name: closed_objects(s) for name, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict) else v
           for k, v in schema.items()}
    types = schema.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's structured_outputs: exactly one constraint. Fields inferd does not implement are a 400."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, max_length=65536)
    choice: list[str] | None = Field(None, min_length=1, max_length=4096)
    grammar: str | None = Field(None, max_length=1 << 20)


class _Sampling(Strict):
    model: str | None = Field(None, max_length=256)
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    seed: Seed | None = None
    stop: Union[StopString, list[StopString], None] = Field(None, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict[BiasKey, BiasValue] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # disaggregated prefill/decode (vLLM's field): {"do_remote_decode": true} asks a KV producer to
    # lease the prompt's KV; a producer's answer's kv_transfer_params, sent to a KV consumer, bring it
    kv_transfer_params: dict[str, Any] | None = None
    # structured output (inferd.engine.structured): OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # suffix decoding's shared cache of outputs (inferd.engine.speculative.suffix): requests draft only
    # from outputs of requests with the same cache_salt (vLLM's field); suffix_cache false keeps this
    # request out of it (its output is not shared, nor are others' drafted from)
    cache_salt: str | None = Field(None, max_length=256)
    suffix_cache: bool = True

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                if name in data and data[name] not in neutral:
                    raise ApiError(f"{name} is not supported by this server", param=name)
            guided = {k: v for k, v in data.items() if k in GUIDED and v is not None}
            if guided:
                if data.get("structured_outputs") is not None or len(guided) > 1:
                    raise ApiError("give one constraint: structured_outputs or one guided_* field",
                                   param=next(iter(guided)))
                (k, v), = guided.items()
                data = {**data, "structured_outputs": {GUIDED[k]: v}}
        return data

    def constraint(self) -> StructuredOutputs | None:
        """The request's output constraint, from response_format or structured_outputs."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise ApiError("give response_format or structured_outputs, not both", param="structured_outputs")
        if so is not None:
            given = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                       ("choice", so.choice), ("grammar", so.grammar)) if v not in (None, False)}
            if len(given) != 1:
                raise ApiError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
                               param="structured_outputs")
            return StructuredOutputs(**given)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputs(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError("response_format json_schema needs json_schema.schema", param="response_format")
        schema = rf.json_schema.schema_
        if rf.json_schema.strict:
            schema = closed_objects(schema)
        return StructuredOutputs(json=schema)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.n > MAX_N or (self.best_of or 0) > MAX_N:
            raise ApiError(f"n and best_of must be at most {MAX_N}", param="n")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ApiError("logit_bias keys must be token ids", param="logit_bias") from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        p = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            n=self.n,
            best_of=self.best_of,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.constraint(),
            cache_salt=self.cache_salt,
            suffix_cache=self.suffix_cache,
        )
        try:
            p.validate()
        except InferdError as e:
            raise ApiError(str(e)) from None
        if self.stream and p.num_samples > p.n:
            raise ApiError("best_of > n cannot be streamed", param="best_of")
        return p


# -- the shapes of prompts and messages -------------------------------------------------------------
# A prompt or a chat whose shape is wrong gets one plain sentence naming the place (`prompt[3]`,
# `messages[2].role`, `messages[0].content[1]`), checked before pydantic's union would answer with
# the last branch it tried ("prompt.str: Input should be a valid string"). The schemas below still
# publish the accepted shapes for the OpenAPI document; what the served model decides (a token id
# past its vocabulary, a content part it cannot read) is checked where the model is known.

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"
ROLES = ("system", "user", "assistant", "tool", "developer")  # developer: OpenAI's newer name of system
# content part types -> what a model must take to read them (EngineInfo.modalities)
PART_MODALITIES = {"text": "text", "image_url": "image", "image": "image", "input_image": "image",
                   "input_audio": "audio", "audio_url": "audio", "video_url": "video", "file": "file",
                   "input_file": "file"}


def kind(x) -> str:
    """A JSON value's type in a client's words."""
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, int):
        return "an integer"
    if isinstance(x, float):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "a list"
    if isinstance(x, dict):
        return "an object"
    return "null" if x is None else type(x).__name__


def shown(x, limit: int = 40) -> str:
    """A client's value quoted in an error, cut short."""
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_item_kind(x) -> str | None:
    if isinstance(x, str):
        return "strings"
    if _is_token(x):
        return "token ids"
    if isinstance(x, list):
        return "token-id lists"
    return None


def _check_token(t, where: str):
    if not _is_token(t):
        raise ApiError(f"{where} is {kind(t)}: a token-id list holds token ids (integers) only", param="prompt")
    if t < 0:
        raise ApiError(f"{where} is {t}: token ids are 0 or more", param="prompt")
    if t > INT32_MAX:
        raise ApiError(f"{where} is {t}: past any vocabulary (token ids are below 2^31)", param="prompt")


def check_prompt(p):
    """A completion's prompt: one string, or a list of one kind (strings, token ids, token-id lists)."""
    if isinstance(p, str):
        return
    if not isinstance(p, list):
        raise ApiError(f"prompt is {kind(p)}: give {PROMPT_SHAPES}", param="prompt")
    if not p:
        raise ApiError(f"prompt is an empty list: give {PROMPT_SHAPES}", param="prompt")
    first = _prompt_item_kind(p[0])
    for i, x in enumerate(p):
        k = _prompt_item_kind(x)
        if k is None:
            raise ApiError(f"prompt[{i}] is {kind(x)}: a prompt list holds strings, token ids or token-id lists",
                           param="prompt")
        if k != first:
            raise ApiError(f"prompt mixes {first} and {k} (prompt[{i}] is {kind(x)}): a list holds strings only, "
                           "token ids only, or token-id lists only", param="prompt")
    if first != "token ids" and len(p) > MAX_PROMPTS:
        raise ApiError(f"prompt holds {len(p)} prompts: at most {MAX_PROMPTS} in one request", param="prompt")
    if first == "token ids":
        for i, t in enumerate(p):
            _check_token(t, f"prompt[{i}]")
    elif first == "token-id lists":
        for i, ids in enumerate(p):
            if not ids:
                raise ApiError(f"prompt[{i}] is an empty list: each token-id list holds at least one token id",
                               param="prompt")
            for j, t in enumerate(ids):
                if isinstance(t, list):
                    raise ApiError(f"prompt[{i}][{j}] is a list: prompts nest two levels deep at most "
                                   "(a list of token-id lists)", param="prompt")
                _check_token(t, f"prompt[{i}][{j}]")


def each_message(msgs, empty: str | None):
    """(its place, the message) for each of a chat's messages, in every dialect: first the list (a
    list, at most MAX_MESSAGES, and not empty unless `empty`, the dialect's words for why, is None),
    then each message an object as the loop reaches it, so the first fault in reading order is the
    one told. Roles and content are each dialect's own rules, checked in its loop."""
    if not isinstance(msgs, list):
        raise ApiError(f"messages is {kind(msgs)}: give a list of messages", param="messages")
    if not msgs and empty is not None:
        raise ApiError(f"messages is an empty list: {empty}", param="messages")
    if len(msgs) > MAX_MESSAGES:
        raise ApiError(f"messages holds {len(msgs)} messages: at most {MAX_MESSAGES} in one request",
                       param="messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} is {kind(m)}: a message is an object with a role and content", param=where)
        yield where, m


def check_messages(msgs):
    """A chat's messages: a non-empty list of objects, each with a role from ROLES and content that
    is a string, null, or a non-empty list of parts that each name their type."""
    for where, m in each_message(msgs, "a chat needs at least one message"):
        _check_role(m.get("role"), "role" in m, f"{where}.role")
        _check_content(m.get("content"), f"{where}.content")


def _check_role(role, given: bool, where: str):
    allowed = ", ".join(ROLES)
    if not given:
        raise ApiError(f"{where} is missing: give one of {allowed}", param=where)
    if role == "function":
        raise ApiError(f"{where} is 'function' (OpenAI's deprecated function calling), which this server does not "
                       "take: send a function's result as role tool with the tool_call_id it answers", param=where)
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(f"{where} is {shown(role)}: a role is one of {allowed}", param=where)


def _check_content(content, where: str):
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(f"{where} is {kind(content)}: content is a string, a list of content parts, or null",
                       param=where)
    if not content:
        raise ApiError(f"{where} is an empty list: give a string or at least one content part", param=where)
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ApiError(f'{at} is {kind(part)}: a content part is an object such as {{"type": "text", '
                           '"text": "..."}', param=at)
        t = part.get("type")
        if not isinstance(t, str):
            raise ApiError(f"{at} has {'no type' if t is None else 'a type that is ' + kind(t)}: a content part "
                           'names its type ("text", "image_url", ...)', param=at)
        if t == "text" and not isinstance(part.get("text"), str):
            raise ApiError(f"{at} is a text part whose text is {kind(part.get('text'))}, not a string", param=at)


def check_parts(messages, modalities, model: str):
    """Every content part of type the served model can read (a text-only model refuses an image)."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            check_part(part.type, f"messages[{i}].content[{j}]", modalities, model)


def check_part(part_type: str, at: str, modalities, model: str, modality: str | None = None):
    """One part of content (of any dialect: `at` is its place in the client's words) that the
    served model must be able to read."""
    if (modality or PART_MODALITIES.get(part_type)) not in modalities:
        raise ApiError(f"{at}: {part_type[:32]} parts are not supported by model `{model}` (it takes "
                       f"{' and '.join(modalities)} only)", param=at)


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=MAX_PROMPTS)]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = None  # insertion is not supported: any value is a 400

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        check_prompt(v)
        return v


class ToolCallFunction(Strict):
    name: str = Field(max_length=256)
    arguments: Union[str, dict[str, Any]] = ""


class ToolCall(Strict):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(BaseModel):
    """One part of a message's content: {"type": "text", "text": ...}, or a part of another type
    (image_url, input_audio, ...) that only a model taking that kind of input accepts."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "user", "assistant", "tool", "developer"]  # ROLES, published in the schema
    content: Union[str, Annotated[list[ContentPart], Field(min_length=1)], None] = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=256)  # a tool message: the call it answers
    name: str | None = Field(None, max_length=256)


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: a function without arguments
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(max_length=256)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_shape(cls, v):
        check_messages(v)
        return v


class TokenizeRequest(Strict):
    model: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_shape(cls, v):
        if v is not None:
            check_messages(v)
        return v


class DetokenizeRequest(Strict):
    model: str | None = Field(None, max_length=256)
    tokens: list[TokenId]


# -- pydantic's errors, as one line ----------------------------------------------------------------
# pydantic names a union's branch in the error's location (`stop.list[constrained-str].0`,
# `tool_choice.NamedToolChoice.function`): the client wrote neither, so the branch is dropped from
# the place, and list indices read as a client writes them (`messages[0].tool_calls[1]`).
_BRANCH = re.compile(r"^(str|int|float|bool|bytes|none|any|constrained-[\w-]+|[\w-]+\[.*\])$")


def _is_branch(part) -> bool:
    return isinstance(part, str) and (part in _model_names() or _BRANCH.match(part) is not None)


def _place(loc) -> tuple[str, str | None, int]:
    """(the place in the request, the place of the union whose branch failed or None, how many
    steps past that branch the error sat)."""
    out, union, depth = "", None, 0
    for part in loc:
        if part in ("body", "[key]"):
            continue
        if _is_branch(part):
            union = out if union is None else union
            continue
        if union is not None:
            depth += 1
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out, union, depth


def validation_error(errors: list[dict]) -> ApiError:
    """The first of pydantic's errors, as a client reads it. When every branch of a union failed at
    the field itself, the message says what each wanted; when one got further, its error is told."""
    if not errors:
        return ApiError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError("request body is not valid JSON")
    place, union, _ = _place(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    if union is not None:
        branches = [(e, *_place(e.get("loc", ()))) for e in errors]
        branches = [b for b in branches if b[2] == union]
        deepest = max(branches, key=lambda b: b[3])
        if deepest[3] > 0:
            place, msg = deepest[1], deepest[0].get("msg", msg)
        else:
            place = union
            wants = [b[0].get("msg", "") for b in branches]
            msg = ", or ".join([wants[0]] + [w.removeprefix("Input should be ") for w in wants[1:]])
    return ApiError(f"{place}: {msg}" if place else msg, param=place or None)


# -- response schemas, for the OpenAPI document (what schemathesis checks every answer against) --

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Union[str, int, None] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens"}, with --enable-prompt-tokens-details


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Choice(_Open):
    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionChoice(_Choice):
    text: str


class ChatChoiceMessage(_Open):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the <think> text
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Choice):
    message: ChatChoiceMessage


class _Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV producer's answer: where the prompt's KV waits


class CompletionResponse(_Completion):
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Completion):
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    wait_s: float | None = Field(None, ge=0, description="unload: how long open requests may keep it loaded "
                                 "(default: until they finish)")


class ModelActionResponse(BaseModel):
    model: str
    status: dict
    load_seconds: float | None = None


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model: str | None = Field(None, description="the model that takes it (default: the first served)")


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's clients send lora_int_id too
    lora_name: str = Field(min_length=1, max_length=256)


class LoRAActionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    model: str


class HealthResponse(BaseModel):
    status: str
    detail: str | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


# A streamed answer in the OpenAPI document: each server-sent event (its `event` name, if it has one,
# and its `data`, one JSON document or [DONE]), as OpenAPI before 3.2 describes an event stream
SSE_CONTENT = {"text/event-stream": {"schema": {
    "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"]}}}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` entries: an OpenAI error body for each status."""
    return {s: {"model": ErrorResponse, "description": _REASONS.get(s, "error")} for s in statuses}


_REASONS = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or route",
            408: "request body too slow", 413: "request body too large", 431: "request headers too large",
            500: "the engine failed on this request", 503: "overloaded, shutting down, or engine stopped"}
COMMON_ERRORS = (400, 401, 408, 413, 431, 503)


def _model_names() -> set[str]:
    """The schema models' names (every dialect's), which pydantic puts in an error's location
    inside a union; read when an error is told, so every dialect's models are known."""
    names, todo = set(), [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("inferd.") and sub.__name__ not in names:
                names.add(sub.__name__)
            todo.append(sub)
    return names

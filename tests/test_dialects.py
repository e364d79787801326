"""The APIs tools speak, each through its official client against a real `inferd serve`: OpenAI's
Responses API (`openai`), Anthropic's Messages API (`anthropic`) and Ollama's API (`ollama`).

One engine path: greedy output through every dialect equals the same request through chat
completions. A thinking model (helpers.write_tiny_thinking_gguf: its real engine output holds
`<think>…</think>`) served with --reasoning-parser qwen3 gives its reasoning apart in every dialect,
streamed and not. The bodies Claude Code and Codex send are taken; a second agent turn is a
prefix-cache hit in every dialect; `inferd bench` loads the Responses and Messages routes.

Two servers, started together: the default model (with --api-key, every client sending the key its
own way, and a small Responses store), and the thinking model.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import conftest
from helpers import THINKING_ANSWER, THINKING_REASONING, wait_until, write_tiny_thinking_gguf

MODEL = "smollm2-135m"
KEY = "sekret"
STORE_ENTRIES, STORE_BYTES = 6, 48 * 1024
TIMEOUT = 120.0
N = 12  # output tokens of the greedy comparisons
GREEDY = {"extra_body": {"temperature": 0}}  # Anthropic's SDK no longer offers temperature: sent as Claude Code does

SYSTEM = "You are a concise assistant."
QUESTION = "Write two sentences about Paris."
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
               "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    think = write_tiny_thinking_gguf(tmp_path_factory.mktemp("think") / "think.gguf")
    procs = {
        "main": conftest.ServerProc(["--model", MODEL, "--quantization", "none", "--dtype", "float32",
                                     "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                                     "--responses-store-entries", str(STORE_ENTRIES),
                                     "--responses-store-bytes", str(STORE_BYTES)], api_key=KEY),
        "think": conftest.ServerProc(["--model", think, "--reasoning-parser", "qwen3", "--threads", "1",
                                      "--max-model-len", "512"]),
    }
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers["main"].wait_ready()


@pytest.fixture(scope="module")
def think(servers):
    return servers["think"].wait_ready()


def oai(s, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)


def claude(s, key=KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.base, api_key=key, timeout=TIMEOUT, max_retries=0)


def olla(s, key=KEY) -> ollama.Client:
    return ollama.Client(host=s.base, headers={"Authorization": f"Bearer {key}"} if key else None, timeout=TIMEOUT)


def chat_text(s, messages, max_tokens=N, **kw) -> dict:
    """The reference: the same request through chat completions (greedy)."""
    r = httpx.post(s.base + "/v1/chat/completions", headers=s.auth, timeout=TIMEOUT,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(s) -> dict[str, float]:
    r = httpx.get(s.base + "/metrics", headers=s.auth, timeout=30)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def sse(s, path, body, headers=None) -> list[tuple[str, dict]]:
    """(event name, data) of an SSE response."""
    out, name = [], None
    with httpx.stream("POST", s.base + path, json=body, headers={**s.auth, **(headers or {})}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                out.append((name, json.loads(line[5:])))
    return out


# -- the pieces without a server: the reasoning split, the store -----------------------------------------

@pytest.mark.parametrize("parser,opened,text,want", [
    ("qwen3", False, "<think>\nLet me think.\n</think>\n\nHello!", ("Let me think.", "Hello!")),
    ("qwen3", False, "Hello <b>there</b>!", ("", "Hello <b>there</b>!")),  # no think block: all answer
    ("qwen3", False, "<think>cut short", ("cut short", "")),
    ("qwen3", True, "Let me\n think.</think>Hi", ("Let me\n think.", "Hi")),  # the template opened the block
    ("deepseek_r1", False, "Let me think.\n</think>\n\nHi", ("Let me think.", "Hi")),
    ("deepseek_r1", False, "<think>a < b </thi", ("a < b </thi", "")),  # an unfinished tag is text at the end
])
def test_reasoning_split_is_the_same_however_the_text_is_cut(parser, opened, text, want):
    from inferd.server.reasoning import ReasoningSplit

    for step in range(1, len(text) + 1):
        split = ReasoningSplit(parser, opened)
        pieces = [p for i in range(0, len(text), step) for p in split.feed(text[i:i + step])] + split.finish()
        got = tuple("".join(t for k, t in pieces if k == kind) for kind in ("reasoning", "content"))
        assert got == want, (step, pieces)


def test_store_bounds_entries_bytes_and_time():
    from inferd.server.openai.store import ResponseStore, json_size

    now = [0.0]
    store = ResponseStore(max_entries=3, max_bytes=2000, ttl_s=10, clock=lambda: now[0])

    def put(i, pad=0):
        return store.put({"id": f"r{i}", "output": []}, [{"type": "message", "content": "x" * pad}])

    for i in range(5):
        assert put(i)
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None and store.evicted == 2
    assert store.bytes == sum(json_size(s.response) + json_size(s.conversation) for s in store.entries.values())
    assert put(9, pad=1850) and store.get("r9") is not None  # the bytes bound: the oldest went to fit it
    assert len(store) < 3 and store.bytes <= 2000 and store.get("r2") is None
    assert not put(10, pad=5000) and store.get("r10") is None  # alone past the bound: not kept
    now[0] = 11.0
    assert len(store) == 0 and store.bytes == 0  # past its time to live


# -- OpenAI's Responses API ----------------------------------------------------------------------------

def test_responses_plain_and_streamed_equal_chat(srv):
    c = oai(srv)
    ref = chat_text(srv, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    r = c.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=N, temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"] and r.usage.output_tokens == N
    events = list(c.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=N,
                                     temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    with c.responses.stream(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=N,
                            temperature=0) as s:  # the SDK's helper (its final response only once completed)
        helper = list(s)
    assert helper[-1].type == "response.incomplete" and helper[-1].response.output_text == r.output_text


def test_responses_conversation_by_previous_response_id(srv):
    c = oai(srv)
    first = c.responses.create(model=MODEL, input="My name is Ada. Say hi.", max_output_tokens=8, temperature=0)
    second = c.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                max_output_tokens=N, temperature=0)
    ref = chat_text(srv, [{"role": "user", "content": "My name is Ada. Say hi."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}])
    assert second.output_text == ref["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(second.id).output_text == second.output_text
    items = c.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert [i.role for i in items.data] == ["user", "assistant", "user"]  # newest first, as OpenAI's
    assert items.data[0].content[0].text == "What is my name?"
    assert c.responses.delete(second.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, previous_response_id=second.id, input="again", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unsaved = c.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert unsaved.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unsaved.id)


def test_responses_function_tool_round_trip(srv):
    """A call forced by tool_choice (a constraint: its arguments valid against the parameters), then
    its output sent back as Codex sends turns: store false, the whole history each time."""
    c = oai(srv)
    tool = {"type": "function", **WEATHER}
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.responses.create(model=MODEL, input=history, tools=[tool], tool_choice="required", store=False,
                           max_output_tokens=40, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and r.status == "completed", r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    call = calls[0]
    history += [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    r2 = c.responses.create(model=MODEL, input=history, tools=[tool], store=False, max_output_tokens=N,
                            temperature=0)
    ref = chat_text(srv, [history[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}],
        tools=[{"type": "function", "function": WEATHER}])
    msg = ref["choices"][0]["message"]
    if msg.get("tool_calls"):
        assert [o.name for o in r2.output if o.type == "function_call"] == \
            [t["function"]["name"] for t in msg["tool_calls"]]
    else:
        assert r2.output_text == msg["content"]


def test_responses_json_schema_is_valid_against_its_schema(srv):
    r = oai(srv).responses.create(model=MODEL, input="Give a city and its population as JSON.", temperature=0,
                                  max_output_tokens=60, text={"format": {"type": "json_schema", "name": "city",
                                                                        "schema": CITY_SCHEMA, "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)
    assert r.text.format.type == "json_schema"


def test_responses_store_is_bounded_and_measured(srv):
    """Past its entries the oldest go; past its bytes too; /metrics reads its size."""
    c = oai(srv)
    ids = [c.responses.create(model=MODEL, input=f"Count to {i}.", max_output_tokens=2).id
           for i in range(STORE_ENTRIES + 3)]
    m = metrics(srv)
    assert m["inferd:responses_store_entries"] == STORE_ENTRIES
    assert 0 < m["inferd:responses_store_bytes"] <= STORE_BYTES
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert c.responses.retrieve(ids[-1]).id == ids[-1]
    big = "=" * 15000  # 15 kB of input in some 240 tokens: three fill the byte bound
    for _ in range(4):
        c.responses.create(model=MODEL, input=big, max_output_tokens=1)
    m2 = metrics(srv)
    assert m2["inferd:responses_store_bytes"] <= STORE_BYTES < 4 * len(big)
    assert m2["inferd:responses_store_entries"] < STORE_ENTRIES
    assert m2["inferd:responses_store_evictions"] > m["inferd:responses_store_evictions"] >= 3
    print(f"\nstore after 4 x 15 kB inputs: {m2['inferd:responses_store_entries']:.0f} entries, "
          f"{m2['inferd:responses_store_bytes']:.0f} bytes (bound {STORE_BYTES})")


# -- Anthropic's Messages API ----------------------------------------------------------------------------

def test_messages_create_and_stream_equal_chat(srv):
    c = claude(srv)
    ref = chat_text(srv, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    m = c.messages.create(model=MODEL, max_tokens=N, system=SYSTEM, **GREEDY,
                          messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.content[0].text == ref["choices"][0]["message"]["content"]
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == ref["usage"]["prompt_tokens"] and u.output_tokens == N
    with c.messages.stream(model=MODEL, max_tokens=N, system=SYSTEM, **GREEDY,
                           messages=[{"role": "user", "content": QUESTION}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"
    kinds = [name for name, _ in sse(srv, "/v1/messages", {"model": MODEL, "max_tokens": 3, "stream": True,
                                                           "messages": [{"role": "user", "content": "hi"}]})]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"], kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds


def test_messages_stop_sequence_is_told(srv):
    m = claude(srv).messages.create(model=MODEL, max_tokens=40, **GREEDY, stop_sequences=["Paris", " is"],
                                    messages=[{"role": "user", "content": QUESTION}])
    if m.stop_reason == "stop_sequence":
        assert m.stop_sequence in ("Paris", " is")
    else:
        assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None


def test_messages_tool_use_round_trip(srv):
    c = claude(srv)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    m = c.messages.create(model=MODEL, max_tokens=40, **GREEDY, tools=[tool], tool_choice={"type": "any"},
                          messages=[ask])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather", m
    jsonschema.validate(uses[0].input, WEATHER["parameters"])
    turn2 = [ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                           "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    m2 = c.messages.create(model=MODEL, max_tokens=N, **GREEDY, tools=[tool], messages=turn2)
    ref = chat_text(srv, [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": uses[0].id, "type": "function", "function": {"name": "get_weather", "arguments": uses[0].input}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18 C and sunny"}],
        tools=[{"type": "function", "function": WEATHER}])
    msg = ref["choices"][0]["message"]
    if msg.get("tool_calls"):
        assert [b.name for b in m2.content if b.type == "tool_use"] == [t["function"]["name"]
                                                                        for t in msg["tool_calls"]]
    else:
        assert "".join(b.text for b in m2.content if b.type == "text") == msg["content"]


def test_messages_output_format_is_structured_output(srv):
    m = claude(srv).messages.create(model=MODEL, max_tokens=60, **GREEDY, messages=[
        {"role": "user", "content": "A city and its population, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": CITY_SCHEMA}})
    jsonschema.validate(json.loads(m.content[0].text), CITY_SCHEMA)


def test_count_tokens_is_the_tokenizers_count(srv):
    from inferd.gguf_file import default_model_path, read_gguf_metadata
    from inferd.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"}]
    c = claude(srv)
    n = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs).input_tokens
    assert n == len(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *msgs],
                                            add_generation_prompt=True, tokenize=True))
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    with_tools = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs, tools=[tool]).input_tokens
    m = c.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=msgs, tools=[tool])
    assert with_tools == m.usage.input_tokens + m.usage.cache_read_input_tokens > n


def test_anthropic_errors_have_anthropics_shape(srv):
    c = claude(srv)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "system", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages[0].role is 'system': a role is user or assistant "
                                                    "(the system prompt is the top-level system field)"}}
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(srv, key="wrong").messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image", "source": png}]}])
    assert e.value.body["error"]["message"] == (f"messages[0].content[1]: image parts are not supported by model "
                                                f"`{MODEL}` (it takes text only)")


def test_what_claude_code_sends_is_taken(srv):
    """Headers, ?beta=true, system as blocks, cache_control, metadata, thinking, tools: as Claude
    Code sends them (its key as x-api-key)."""
    body = {
        "model": MODEL, "max_tokens": 4, "stream": True, "temperature": 1, "metadata": {"user_id": "user_abc"},
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use the tools when useful.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "Run a command.", "input_schema": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
            "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "list files",
                                                   "cache_control": {"type": "ephemeral"}}]}],
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"}
    with httpx.stream("POST", srv.base + "/v1/messages?beta=true", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        names = [line[6:].strip() for line in r.iter_lines() if line.startswith("event:")]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    r = httpx.post(srv.base + "/v1/messages/count_tokens?beta=true", json={k: body[k] for k in (
        "model", "system", "tools", "messages")}, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


# -- Ollama's API --------------------------------------------------------------------------------------

def test_ollama_chat_and_generate_equal_chat(srv):
    c = olla(srv)
    opts = {"temperature": 0, "num_predict": N}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ref = chat_text(srv, msgs)["choices"][0]["message"]["content"]
    r = c.chat(model=MODEL, messages=msgs, options=opts, stream=False)
    assert r.message.content == ref and r.done and r.done_reason == "length" and r.eval_count == N
    parts = list(c.chat(model=MODEL, messages=msgs, options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == ref and parts[-1].done and not parts[0].done
    g = c.generate(model=MODEL, system=SYSTEM, prompt=QUESTION, options=opts, stream=False)
    assert g.response == ref and g.prompt_eval_count + 0 >= 0
    gs = list(c.generate(model=MODEL, system=SYSTEM, prompt=QUESTION, options=opts, stream=True))
    assert "".join(p.response for p in gs) == ref and gs[-1].done


def test_ollama_list_show_ps_version(srv):
    c = olla(srv)
    names = [m.model for m in c.list().models]
    assert MODEL in names
    info = c.show(MODEL)
    assert "completion" in info.capabilities and "tools" in info.capabilities
    assert info.modelinfo["llama.context_length"] == 2048 and info.details.family == "llama"
    assert info.details.format == "gguf" and info.template
    running = c.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length == 2048
    assert httpx.get(srv.base + "/api/version", headers=srv.auth, timeout=10).json()["version"]
    assert c.chat(model=MODEL + ":latest", messages=[{"role": "user", "content": "hi"}],
                  options={"num_predict": 1}).done


def test_ollama_format_and_options(srv):
    c = olla(srv)
    r = c.chat(model=MODEL, messages=[{"role": "user", "content": "A city and its population, as JSON."}],
               format=CITY_SCHEMA, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(r.message.content), CITY_SCHEMA)
    r = c.generate(model=MODEL, prompt="Say something as JSON.", format="json", options={"num_predict": 8,
                                                                                         "seed": 7, "top_k": 5})
    assert r.done
    # num_ctx bounds prompt + output: a prompt past it is refused, an output stops at it
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model=MODEL, prompt=QUESTION, options={"num_ctx": 8})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    n_prompt = claude(srv).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}]
                                                 ).input_tokens  # the same one user turn
    r = c.generate(model=MODEL, prompt=QUESTION, options={"num_ctx": n_prompt + 3, "num_predict": 500})
    assert r.eval_count == 3 and r.done_reason == "length"


def test_ollama_tool_calls(srv):
    c = olla(srv)
    tool = {"type": "function", "function": WEATHER}
    r = httpx.post(srv.base + "/api/chat", headers=srv.auth, timeout=TIMEOUT, json={
        "model": MODEL, "stream": False, "tools": [tool], "options": {"temperature": 0, "num_predict": 16},
        "messages": [{"role": "user", "content": "Weather in Paris? Call get_weather."}]})
    assert r.status_code == 200, r.text
    # Ollama has no tool_choice: the model decides; a call it makes comes back whole, its arguments an object
    for call in r.json()["message"].get("tool_calls") or ():
        assert isinstance(call["function"]["arguments"], dict)
    out = c.chat(model=MODEL, tools=[tool], options={"temperature": 0, "num_predict": N}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_name": "get_weather"}])
    assert out.done


def test_ollama_errors_have_ollamas_shape(srv):
    c = olla(srv)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "nope" in e.value.error
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
        r = httpx.post(srv.base + path, headers=srv.auth, json={"model": "x"}, timeout=10)
        assert r.status_code == 400 and set(r.json()) == {"error"} and "inferd serve --model" in r.json()["error"]
    r = httpx.request("DELETE", srv.base + "/api/delete", headers=srv.auth, json={"model": "x"}, timeout=10)
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    r = httpx.post(srv.base + "/api/chat", timeout=10, json={"model": MODEL})
    assert r.status_code == 401 and r.json() == {"error": "invalid or missing API key"}
    # Ollama's docs post JSON with curl -d: a form's content type, read as JSON all the same
    r = httpx.post(srv.base + "/api/generate", headers={**srv.auth, "Content-Type": "application/x-www-form-urlencoded"},
                   content=json.dumps({"model": MODEL, "prompt": "hi", "stream": False,
                                       "options": {"num_predict": 1}}), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["done"], r.text
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?", "images": ["iVBORw0KGgo="]}])
    assert e.value.status_code == 400 and "messages[0].images[0]" in e.value.error


def test_every_dialect_takes_its_key_its_way(srv):
    """401 without the key, in each dialect's shape; Anthropic's x-api-key beside Bearer."""
    for path, body, shape in (("/v1/responses", {"input": "x"}, "openai"),
                              ("/v1/messages", {"max_tokens": 1, "messages": []}, "anthropic"),
                              ("/api/tags", None, "ollama")):
        r = httpx.request("POST" if body is not None else "GET", srv.base + path, json=body, timeout=10)
        assert r.status_code == 401, (path, r.text)
        b = r.json()
        if shape == "openai":
            assert b["error"]["type"] == "authentication_error"
        elif shape == "anthropic":
            assert b == {"type": "error", "error": {"type": "authentication_error",
                                                    "message": "invalid or missing API key"}}
        else:
            assert b == {"error": "invalid or missing API key"}
    assert httpx.get(srv.base + "/v1/models", headers={"x-api-key": KEY}, timeout=10).status_code == 200
    assert httpx.get(srv.base + "/v1/models", headers={"x-api-key": "no"}, timeout=10).status_code == 401
    # both clients read /v1/models
    assert MODEL in [m.id for m in oai(srv).models.list().data]
    assert MODEL in [m.id for m in claude(srv).models.list().data]


# -- agent turns: the second is a prefix-cache hit in every dialect -------------------------------------

AGENT_SYSTEM = ("You are a coding agent working in a repository. You read files, run commands and edit code to "
                "finish the user's task. Think about which tool fits before you call it, call one tool at a time, "
                "and answer briefly once the task is done. Never invent file contents: read them first. ") * 3


def _drain(events):
    for _ in events:
        pass


def _ttft(before: dict, after: dict) -> float:
    """The server's mean time to first token over the requests between two /metrics readings
    (from the request's arrival: HTTP, template, queue and prefill)."""
    n = after["inferd:time_to_first_token_seconds_count"] - before["inferd:time_to_first_token_seconds_count"]
    return (after["inferd:time_to_first_token_seconds_sum"] - before["inferd:time_to_first_token_seconds_sum"]) / n


@pytest.mark.parametrize("dialect", ["responses", "messages", "ollama"])
def test_second_agent_turn_is_a_prefix_cache_hit(srv, dialect):
    system = f"[{dialect} {uuid.uuid4().hex[:8]}] " + AGENT_SYSTEM  # a new prefix: no hit from other turns
    read = {"name": "read_file", "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                           "required": ["path"]}}
    ask = "Read README.md and tell me what the project is."
    call_args, result = '{"path": "README.md"}', "inferd: an LLM inference engine."

    def turn(second: bool):
        if dialect == "responses":
            items = [{"role": "user", "content": ask}]
            if second:
                items += [{"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": call_args},
                          {"type": "function_call_output", "call_id": "call_1", "output": result}]
            return oai(srv).responses.create(model=MODEL, instructions=system, input=items, store=False,
                                             tools=[{"type": "function", **read}], max_output_tokens=8,
                                             temperature=0, stream=True)
        if dialect == "messages":
            msgs = [{"role": "user", "content": ask}]
            if second:
                msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                            "input": json.loads(call_args)}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": result}]}]
            tool = {"name": read["name"], "description": read["description"], "input_schema": read["parameters"]}
            return claude(srv).messages.create(model=MODEL, max_tokens=8, **GREEDY, stream=True, messages=msgs,
                                               system=[{"type": "text", "text": system,
                                                        "cache_control": {"type": "ephemeral"}}], tools=[tool])
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        if second:
            msgs += [{"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "read_file", "arguments": json.loads(call_args)}}]},
                {"role": "tool", "content": result, "tool_name": "read_file"}]
        return olla(srv).chat(model=MODEL, messages=msgs, tools=[{"type": "function", "function": read}],
                              options={"temperature": 0, "num_predict": 8}, stream=True)

    m0 = metrics(srv)
    _drain(turn(False))
    m1 = metrics(srv)
    _drain(turn(True))
    m2 = metrics(srv)
    hits1 = m1["inferd:prefix_cache_hits_total"] - m0["inferd:prefix_cache_hits_total"]
    hits2 = m2["inferd:prefix_cache_hits_total"] - m1["inferd:prefix_cache_hits_total"]
    prompt1 = m1["inferd:prompt_tokens_total"] - m0["inferd:prompt_tokens_total"]
    block = 16
    assert hits1 < prompt1 / 2  # the first turn's prefix was new
    assert hits2 >= (prompt1 // block - 1) * block > 0, (hits1, hits2, prompt1)
    print(f"\n{dialect}: first turn {prompt1:.0f} prompt tokens, TTFT {_ttft(m0, m1) * 1000:.0f} ms; second turn "
          f"{hits2:.0f} found in the prefix cache, TTFT {_ttft(m1, m2) * 1000:.0f} ms")


# -- a thinking model: its reasoning apart in every dialect ------------------------------------------------

def test_chat_reasoning_content(think):
    r = httpx.post(think.base + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0})
    msg = r.json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (THINKING_REASONING, THINKING_ANSWER)
    chunks = [d for _, d in sse(think, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "stream": True})
        if d != "[DONE]" and isinstance(d, dict)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THINKING_REASONING
    assert "".join(d.get("content") or "" for d in deltas) == THINKING_ANSWER
    off = httpx.post(think.base + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}}).json()["choices"][0]["message"]
    assert off["content"] == THINKING_ANSWER and not off.get("reasoning_content")


def test_responses_reasoning_item_and_codex_round_trip(think):
    c = oai(think, key="x")
    r = c.responses.create(model="think.gguf", input="hi", max_output_tokens=100000, temperature=0, store=False,
                           include=["reasoning.encrypted_content"], reasoning={"effort": "medium", "summary": "auto"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.content[0].text == THINKING_REASONING and reasoning.encrypted_content
    assert r.output_text == THINKING_ANSWER and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(c.responses.create(model="think.gguf", input="hi", max_output_tokens=20, temperature=0,
                                     stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING_REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == THINKING_ANSWER
    # Codex's next turn: store false, the whole history, the reasoning item as it came (only its
    # opaque content: Codex drops the text), which reaches the template as that turn's reasoning
    opaque = {"type": "reasoning", "id": reasoning.id, "summary": [],
              "encrypted_content": reasoning.encrypted_content}
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}, opaque,
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r.output_text}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}]
    body = {"model": "think.gguf", "input": history, "store": False, "stream": False, "max_output_tokens": 20,
            "include": ["reasoning.encrypted_content"], "tool_choice": "auto", "parallel_tool_calls": False,
            "prompt_cache_key": "session-1", "reasoning": {"effort": "medium", "summary": "auto"},
            "instructions": "You are Codex.", "text": {"verbosity": "medium"}}
    with_r = httpx.post(think.base + "/v1/responses", json=body, timeout=TIMEOUT)
    without = httpx.post(think.base + "/v1/responses", json={**body, "input": [history[0], *history[2:]]},
                         timeout=TIMEOUT)
    assert with_r.status_code == 200 and without.status_code == 200, (with_r.text, without.text)
    grow = with_r.json()["usage"]["input_tokens"] - without.json()["usage"]["input_tokens"]
    assert grow >= len(THINKING_REASONING.split()), grow  # "<think>\nLet me think.\n</think>" rendered
    foreign = dict(opaque, encrypted_content="gAAAAB-not-ours")  # another provider's: read as nothing
    r3 = httpx.post(think.base + "/v1/responses", json={**body, "input": [history[0], foreign, *history[2:]]},
                    timeout=TIMEOUT)
    assert r3.status_code == 200 and r3.json()["usage"]["input_tokens"] == without.json()["usage"]["input_tokens"]


def test_messages_thinking_blocks(think):
    c = claude(think, key="x")
    # max_tokens past the context (512) is a ceiling, as Claude Code's 32,000 is meant
    m = c.messages.create(model="think.gguf", max_tokens=32000, **GREEDY, messages=[{"role": "user", "content": "hi"}],
                          thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THINKING_REASONING and m.content[0].signature
    assert m.content[1].text == THINKING_ANSWER and m.stop_reason == "end_turn"
    with c.messages.stream(model="think.gguf", max_tokens=20, **GREEDY,
                           messages=[{"role": "user", "content": "hi"}]) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert final.content[0].thinking == THINKING_REASONING and final.content[1].text == THINKING_ANSWER
    assert "content_block_delta" in kinds
    off = c.messages.create(model="think.gguf", max_tokens=20, **GREEDY, thinking={"type": "disabled"},
                            messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == THINKING_ANSWER
    # an earlier turn's thinking block goes back as that turn's reasoning
    n_with = c.messages.count_tokens(model="think.gguf", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": "again"}]).input_tokens
    n_without = c.messages.count_tokens(model="think.gguf", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": THINKING_ANSWER},
        {"role": "user", "content": "again"}]).input_tokens
    assert n_with > n_without


def test_ollama_thinking(think):
    c = olla(think, key=None)
    r = c.chat(model="think.gguf", messages=[{"role": "user", "content": "hi"}], think=True,
               options={"temperature": 0})
    assert (r.message.thinking, r.message.content) == (THINKING_REASONING, THINKING_ANSWER)
    parts = list(c.chat(model="think.gguf", messages=[{"role": "user", "content": "hi"}], stream=True,
                        options={"temperature": 0}))
    assert "".join(p.message.thinking or "" for p in parts) == THINKING_REASONING
    assert "".join(p.message.content for p in parts) == THINKING_ANSWER
    g = c.generate(model="think.gguf", prompt="hi", think=False, options={"temperature": 0})
    assert g.response == THINKING_ANSWER and not g.thinking
    assert "thinking" in c.show("think.gguf").capabilities


def test_ollama_keep_alive_unloads_and_reloads(think):
    """keep_alive onto the models table: 0 unloads the model once its request is done; the next
    request loads it again; a duration shows in /api/ps."""
    c = olla(think, key=None)
    c.generate(model="think.gguf", prompt="hi", keep_alive="10m", options={"num_predict": 1})
    ten_minutes = c.ps().models[0].expires_at
    c.generate(model="think.gguf", prompt="hi", keep_alive="1h", options={"num_predict": 1})
    an_hour = c.ps().models[0].expires_at
    # each counts from its request's end: 50 minutes apart, plus the second request's time
    assert 3000 <= (an_hour - ten_minutes).total_seconds() < 3600
    c.generate(model="think.gguf", prompt="hi", keep_alive=0, options={"num_predict": 1})
    wait_until(lambda: not c.ps().models, 60, "the model to unload after keep_alive 0")
    r = c.generate(model="think.gguf", prompt="hi", keep_alive=-1, options={"temperature": 0})
    assert r.response == THINKING_ANSWER and c.ps().models
    assert c.generate(model="think.gguf", prompt="", keep_alive=0).done_reason == "unload"
    assert c.generate(model="think.gguf", prompt="").done_reason == "load" and c.ps().models


# -- inferd bench over the new routes ------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["/v1/responses", "/v1/messages"])
def test_bench_loads_the_responses_and_messages_routes(srv, tmp_path, endpoint):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "--base-url", srv.base, "--endpoint", endpoint,
                        "--api-key", KEY, "--dataset", "random", "--input-len", "16", "--output-len", "6",
                        "--num-prompts", "3", "--max-concurrency", "3", "--result-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["failed"] == 0 and res["total_output_tokens"] == 18
    assert res["endpoint_type"] == endpoint.rsplit("/", 1)[-1]
    assert res["output_tokens_source"] == {"usage": 3}
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0


def test_metrics_count_requests_by_route_and_dialect(srv):
    """/metrics: every route's answers by dialect and status (the requests of this module so far)."""
    text = httpx.get(srv.base + "/metrics", headers=srv.auth, timeout=30).text
    seen = {(s.labels["route"], s.labels["dialect"], s.labels["status"])
            for fam in text_string_to_metric_families(text) if fam.name == "inferd:http_requests"
            for s in fam.samples if s.name.endswith("_total")}
    for want in (("/v1/responses", "openai", "200"), ("/v1/responses/{id}", "openai", "404"),
                 ("/v1/messages", "anthropic", "200"), ("/v1/messages", "anthropic", "401"),
                 ("/v1/messages/count_tokens", "anthropic", "200"), ("/api/chat", "ollama", "200"),
                 ("/api/generate", "ollama", "200"), ("/api/tags", "ollama", "200"), ("/api/pull", "ollama", "400"),
                 ("/v1/chat/completions", "openai", "200")):
        assert want in seen, (want, sorted(seen))


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": QUESTION, "stream": True, "max_output_tokens": 1000, "ignore_eos": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": QUESTION}], "stream": True, "max_tokens": 1000,
                      "ignore_eos": True}),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                   "options": {"num_predict": 1000}}),
])
def test_a_client_that_leaves_a_stream_frees_its_request(srv, path, body):
    """Closing the connection mid-stream aborts the engine request: nothing runs, no KV block held."""
    with httpx.stream("POST", srv.base + path, json=body, headers=srv.auth, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)

    def idle():
        m = metrics(srv)
        return m["inferd:num_requests_running"] == 0 and m["inferd:kv_cache_usage_perc"] == 0

    wait_until(idle, 60, "the abandoned request to be aborted")

"""Hostile and faulty conditions: schemathesis over the OpenAPI document (every dialect's routes),
request limits (413, 431, 408, counts), numbers past 64 bits and non-finite floats, malformed
prompts, messages, roles and content parts (the wording and param of each), unsupported output
constraints, OpenAI error shapes everywhere (Anthropic's and Ollama's on their routes, each
refusal's wording), the constant-time key check (Bearer and x-api-key), a stalled reader, faults injected into engine steps, the UTF-8 cut at max_tokens, and SIGTERM
draining open streams (leaving no engine socket behind)."""
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import socket

import httpx
import pytest

from conftest import ServerProc, make_tiny_model
from helpers import engine_socket_dirs, wait_until

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def servers(tiny_chat_gguf):
    """Every server this module needs, started at once (their start-up overlaps): the limits one
    (also fuzzed by schemathesis), one with an injected fault, and two to send signals to."""
    common = ["--model", tiny_chat_gguf, "--threads", "1"]
    procs = {
        # the body timeout leaves room for the CPU the other three take while they start
        "main": ServerProc([*common, "--max-model-len", "64", "--max-request-body-bytes", str(LIMIT),
                            "--request-body-timeout", "5"]),
        "fault": ServerProc([*common, "--max-model-len", "64"], env={"INFERD_INJECT_FAULT": "detokenize@12"}),
        "drain": ServerProc([*common, "--max-model-len", "1024"]),
        "twice": ServerProc([*common, "--max-model-len", "1024", "--drain-timeout", "600"]),
    }
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers["main"].wait_ready()


def post(srv, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(srv.base + path, content=data, headers={"Content-Type": "application/json"}, timeout=30, **kw)


def assert_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)
    return err


def test_body_over_the_limit_is_413_before_it_is_read(srv):
    big = {"prompt": "x" * (LIMIT + 10), "max_tokens": 1}
    assert_error(post(srv, "/v1/completions", big), 413, str(LIMIT))

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(srv.base + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                   timeout=30)
    assert_error(r, 413, str(LIMIT))


def test_headers_over_the_limit_are_431(srv):
    r = httpx.get(srv.base + "/v1/models", headers={"X-Big": "h" * 20000}, timeout=30)
    assert_error(r, 431)


def test_a_body_that_trickles_in_is_408(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b'"error"' in data


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a"] * 65, "max_tokens": 1}, "prompt"),
    ({"prompt": "a", "n": 17, "temperature": 1}, "n"),
    ({"prompt": "a", "best_of": 17, "temperature": 1}, "best_of"),
    ({"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "max_tokens": 2**64}, "max_tokens"),
    ({"prompt": [2**40], "max_tokens": 1}, "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
])
def test_counts_and_ranges_are_400_naming_the_field(srv, body, param):
    err = assert_error(post(srv, "/v1/completions", body), 400)
    assert err["param"] and err["param"].startswith(param), err


def test_chat_message_count_is_bounded(srv):
    msgs = [{"role": "user", "content": "a"}] * 1025
    err = assert_error(post(srv, "/v1/chat/completions", {"messages": msgs}), 400)
    assert err["param"].startswith("messages") and "1024" in err["message"]


# -- malformed prompts, messages, roles and content parts: one plain line each, naming the place ----

SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"
ONE_KIND = "a list holds strings only, token ids only, or token-id lists only"
ROLES = "system, user, assistant, tool, developer"


def served_name(srv) -> str:
    return httpx.get(srv.base + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("prompt,message", [
    ([], f"prompt is an empty list: give {SHAPES}"),
    (None, f"prompt is null: give {SHAPES}"),
    ({"text": "a"}, f"prompt is an object: give {SHAPES}"),
    (["a", 1] * 2500, f"prompt mixes strings and token ids (prompt[1] is an integer): {ONE_KIND}"),
    ([1, 2, "a"], f"prompt mixes token ids and strings (prompt[2] is a string): {ONE_KIND}"),
    ([[1, 2], 3], f"prompt mixes token-id lists and token ids (prompt[1] is an integer): {ONE_KIND}"),
    ([1, None], "prompt[1] is null: a prompt list holds strings, token ids or token-id lists"),
    ([True], "prompt[0] is a boolean: a prompt list holds strings, token ids or token-id lists"),
    ([1, 2.5], "prompt[1] is a number: a prompt list holds strings, token ids or token-id lists"),
    ([[1], [[2]]], "prompt[1][0] is a list: prompts nest two levels deep at most (a list of token-id lists)"),
    ([[1, "a"]], "prompt[0][1] is a string: a token-id list holds token ids (integers) only"),
    ([[1], []], "prompt[1] is an empty list: each token-id list holds at least one token id"),
    ([5, -1], "prompt[1] is -1: token ids are 0 or more"),
    ([[5], [7, -3]], "prompt[1][1] is -3: token ids are 0 or more"),
    ([2**40], "prompt[0] is 1099511627776: past any vocabulary (token ids are below 2^31)"),
    (["a"] * 65, "prompt holds 65 prompts: at most 64 in one request"),
    ([[1]] * 65, "prompt holds 65 prompts: at most 64 in one request"),
])
def test_a_malformed_prompt_is_one_plain_line(srv, prompt, message):
    err = assert_error(post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1}), 400)
    assert (err["message"], err["param"]) == (message, "prompt")


def test_a_token_id_past_the_vocabulary_names_the_model(srv):
    from gguf import GGUFReader

    name = served_name(srv)
    vocab = len(GGUFReader(srv.cmd[srv.cmd.index("--model") + 1]).fields["tokenizer.ggml.tokens"].data)
    for prompt, where in (([1, vocab], "prompt[1]"), ([[1], [2, 3, vocab + 7]], "prompt[1][2]")):
        err = assert_error(post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1}), 400)
        t = vocab if where == "prompt[1]" else vocab + 7
        assert err["message"] == f"{where} is {t}: past the vocabulary of model `{name}` (token ids 0 to {vocab - 1})"
        assert err["param"] == "prompt"
    ok = post(srv, "/v1/completions", {"prompt": [[1, vocab - 1], [2]], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def user(content):
    return {"role": "user", "content": content}


@pytest.mark.parametrize("messages,param,message", [
    ([], "messages", "messages is an empty list: a chat needs at least one message"),
    ({"role": "user"}, "messages", "messages is an object: give a list of messages"),
    (["hi"], "messages[0]", "messages[0] is a string: a message is an object with a role and content"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role",
     f"messages[0].role is 'wizard': a role is one of {ROLES}"),
    ([user("a"), {"role": "", "content": "hi"}], "messages[1].role",
     f"messages[1].role is '': a role is one of {ROLES}"),
    ([{"role": 3, "content": "hi"}], "messages[0].role", f"messages[0].role is 3: a role is one of {ROLES}"),
    ([{"content": "hi"}], "messages[0].role", f"messages[0].role is missing: give one of {ROLES}"),
    ([{"role": "function", "name": "f", "content": "{}"}], "messages[0].role",
     "messages[0].role is 'function' (OpenAI's deprecated function calling), which this server does not take: "
     "send a function's result as role tool with the tool_call_id it answers"),
    ([user([])], "messages[0].content", "messages[0].content is an empty list: give a string or at least one "
                                        "content part"),
    ([user(7)], "messages[0].content",
     "messages[0].content is an integer: content is a string, a list of content parts, or null"),
    ([user(["hi"])], "messages[0].content[0]",
     'messages[0].content[0] is a string: a content part is an object such as {"type": "text", "text": "..."}'),
    ([user([{"text": "hi"}])], "messages[0].content[0]",
     'messages[0].content[0] has no type: a content part names its type ("text", "image_url", ...)'),
    ([user([{"type": "text"}])], "messages[0].content[0]",
     "messages[0].content[0] is a text part whose text is null, not a string"),
])
def test_a_malformed_chat_is_one_plain_line(srv, messages, param, message):
    for path in ("/v1/chat/completions", "/tokenize"):
        err = assert_error(post(srv, path, {"messages": messages, "max_tokens": 1}), 400)
        assert (err["message"], err["param"]) == (message, param), path


PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("part,kind", [
    ({"type": "image_url", "image_url": {"url": PNG}}, "image_url"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "input_audio"),
    ({"type": "image", "image": PNG}, "image"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
    ({"type": "hologram", "hologram": {}}, "hologram"),
])
def test_content_the_model_cannot_read_is_refused_naming_part_and_model(srv, part, kind):
    messages = [{"role": "system", "content": "Describe."}, user([{"type": "text", "text": "What is this?"}, part])]
    want = (f"messages[1].content[1]: {kind} parts are not supported by model `{served_name(srv)}` "
            "(it takes text only)")
    for path in ("/v1/chat/completions", "/tokenize"):
        err = assert_error(post(srv, path, {"messages": messages, "max_tokens": 1}), 400)
        assert (err["message"], err["param"]) == (want, "messages[1].content[1]"), path


def test_allowed_roles_and_text_parts_are_taken(srv):
    """developer is rendered as system (OpenAI's clients send it); text parts are the text; a tool
    result answering an assistant's call still renders."""
    def ids(messages):
        r = post(srv, "/tokenize", {"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert ids([{"role": "developer", "content": "Be brief."}, user("hi")]) == \
        ids([{"role": "system", "content": "Be brief."}, user("hi")])
    assert ids([user([{"type": "text", "text": "h"}, {"type": "text", "text": "i"}])]) == ids([user("hi")])
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = [user("use f"), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    text = post(srv, "/detokenize", {"tokens": ids(chat)}).json()["prompt"]
    assert "<tool_response>\n42\n</tool_response>" in text and '"name": "f"' in text, text


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "a", "stop": 5}, "stop", "stop: Input should be a valid string, or a valid list"),
    ({"prompt": "a", "stop": ["x", ""]}, "stop[1]", "stop[1]: String should have at least 1 character"),
])
def test_other_fields_errors_name_the_place_not_the_union_branch(srv, body, param, message):
    err = assert_error(post(srv, "/v1/completions", {**body, "max_tokens": 1}), 400)
    assert (err["message"], err["param"]) == (message, param)
    call = {"id": "c", "type": "function", "function": {"arguments": "{}"}}
    chat = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}], "max_tokens": 1}
    err = assert_error(post(srv, "/v1/chat/completions", chat), 400)
    assert err["param"] == "messages[0].tool_calls[0].function.name", err


# -- the other dialects: each refusal in its own shape ---------------------------------------------

def dialect_error(r, status, shape):
    """The error body of the dialect (OpenAI's, Anthropic's, Ollama's): its one message."""
    assert r.status_code == status, r.text
    b = r.json()
    if shape == "anthropic":
        assert set(b) == {"type", "error"} and b["type"] == "error" and set(b["error"]) == {"type", "message"}, b
        return b["error"]["message"]
    if shape == "ollama":
        assert set(b) == {"error"} and isinstance(b["error"], str), b
        return b["error"]
    assert set(b["error"]) >= {"message", "type", "param", "code"}, b
    return b["error"]["message"]


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,status,shape,message", [
    ("/v1/messages", {"max_tokens": 4, "messages": "hi"}, 400, "anthropic",
     "messages is a string: give a list of messages"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": {}}]}]}, 400, "anthropic",
     "messages[0].content[0].type is {}: a content block is one of text, tool_use, tool_result, thinking, "
     "redacted_thinking, image, document, search_result"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "anthropic",
     "messages[0].role is 'system': a role is user or assistant (the system prompt is the top-level system field)"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400,
     "anthropic", "messages[0].content[0] is a tool_result block whose tool_use_id is null, not a string"),
    ("/v1/messages", {"max_tokens": 0, "messages": MSG}, 400, "anthropic", "max_tokens"),
    ("/v1/messages", {"messages": MSG}, 400, "anthropic", "max_tokens: Field required"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG, "temperature": 3}, 400, "anthropic", "temperature"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG, "tools": [{"type": "web_search_20250305",
                                                                   "name": "web_search"}]}, 400, "anthropic",
     "tools[0].type is 'web_search_20250305': this server runs client tools only"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG, "mcp_servers": [{"url": "x"}]}, 400, "anthropic",
     "mcp_servers is not supported by this server"),
    ("/v1/messages", {"max_tokens": 4, "messages": MSG, "tool_choice": {"type": "tool"}, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}]}, 400, "anthropic", "tool_choice of type tool names the tool"),
    ("/v1/messages", b"{not json", 400, "anthropic", "request body is not valid JSON"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": 5}]}, 400, "anthropic",
     "messages[0].content is an integer: content is a string or a list of content blocks"),
    ("/v1/messages/nope", {}, 404, "anthropic", "no such route"),
    ("/v1/responses", {"input": []}, 400, "openai", "input is an empty list: give a string or at least one input item"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "openai",
     "input[0].type is 'item_reference': this server takes input items of type message, function_call, "
     "function_call_output, reasoning"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "output": "x"}]}, 400, "openai",
     "input[0].call_id is null: a function_call_output names the call_id it answers"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "openai",
     "input[0].content[0] is a input_text part whose text is null, not a string"),
    ("/v1/responses", {"input": "x", "background": True}, 400, "openai",
     "background is not supported by this server's Responses API"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "openai",
     "tools[0].type is 'web_search': this server runs function tools only"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_gone"}, 404, "openai", "resp_gone"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "openai",
     "text.format of type json_schema needs a schema"),
    ("/v1/responses", {"input": "x", "max_output_tokens": -1}, 400, "openai", "max_output_tokens"),
    ("/api/chat", {"model": "tiny-chat.gguf", "messages": "hi"}, 400, "ollama",
     "messages is a string: give a list of messages"),
    ("/api/chat", {"model": "tiny-chat.gguf", "messages": [{"role": "wizard", "content": "x"}]}, 400, "ollama",
     "messages[0].role is 'wizard': a role is one of system, user, assistant, tool"),
    ("/api/chat", {"model": "tiny-chat.gguf", "messages": MSG, "options": {"temperature": "hot"}}, 400, "ollama",
     "options.temperature"),
    ("/api/chat", {"model": "tiny-chat.gguf", "messages": MSG, "keep_alive": "forever"}, 400, "ollama",
     "keep_alive is 'forever': give seconds or a duration such as \"5m\" or \"1h30m\""),
    ("/api/chat", {"model": "tiny-chat.gguf", "messages": MSG, "format": "yaml"}, 400, "ollama", "format"),
    ("/api/generate", {"prompt": "x"}, 400, "ollama", "model: Field required"),
    ("/api/generate", {"model": "tiny-chat.gguf", "prompt": "x", "suffix": "y"}, 400, "ollama",
     "suffix is not supported by this server"),
    ("/api/generate", {"model": "nope", "prompt": "x"}, 404, "ollama", "model 'nope' not found"),
    ("/api/generate", {"model": "tiny-chat.gguf", "prompt": "x", "options": {"num_predict": 0}}, 400, "ollama",
     "options.num_predict is 0: give at least 1, or -1 for no limit"),
    ("/api/pull", {"model": "llama3"}, 400, "ollama", "/api/pull is not supported"),
])
def test_each_dialect_refuses_in_its_own_shape(srv, path, body, status, shape, message):
    got = dialect_error(post(srv, path, body), status, shape)
    assert message in got, got


def test_a_405_names_every_method_of_the_path(srv):
    r = httpx.request("OPTIONS", srv.base + "/v1/responses/resp_1", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers
    r = httpx.get(srv.base + "/v1/messages", timeout=10)
    assert r.status_code == 405 and dialect_error(r, 405, "anthropic") == "Method Not Allowed"


def test_a_body_over_the_limit_is_413_in_each_dialects_shape(srv):
    big = "x" * (LIMIT + 10)
    assert str(LIMIT) in dialect_error(post(srv, "/v1/messages", {"max_tokens": 1, "messages": [
        {"role": "user", "content": big}]}), 413, "anthropic")
    assert str(LIMIT) in dialect_error(post(srv, "/api/chat", {"model": "m", "messages": [
        {"role": "user", "content": big}]}), 413, "ollama")
    assert str(LIMIT) in dialect_error(post(srv, "/v1/responses", {"input": big}), 413, "openai")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_floats_are_400(srv, literal):
    assert_error(post(srv, "/v1/completions", '{"prompt": "a", "temperature": %s}' % literal), 400)


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("guided_whitespace_pattern", " "), ("tool_choice", "required"),
                                         ("suffix", "tail")])
def test_output_constraints_not_implemented_are_400_not_ignored(srv, field, value):
    path = "/v1/completions" if field == "suffix" else "/v1/chat/completions"
    body = {"prompt": "a"} if field == "suffix" else {"messages": [{"role": "user", "content": "hi"}]}
    err = assert_error(post(srv, path, {**body, "max_tokens": 2, field: value}), 400)
    assert err["param"] == field


def test_neutral_values_of_those_fields_are_accepted(srv):
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                           "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_every_error_has_the_openai_shape(srv):
    assert_error(post(srv, "/v1/completions", b"{not json"), 400)
    assert_error(post(srv, "/v1/completions", b"[1, 2]"), 400)
    assert_error(httpx.get(srv.base + "/v1/nope", timeout=10), 404)
    assert_error(httpx.get(srv.base + "/v1/completions", timeout=10), 405)
    assert_error(httpx.post(srv.base + "/v1/completions", content=b"\xff\xfe", timeout=10,
                            headers={"Content-Type": "application/json"}), 400)


def test_utf8_cut_by_max_tokens_is_dropped_not_replaced(srv):
    from inferd.loading.loader import load_model

    tok = load_model(srv.cmd[srv.cmd.index("--model") + 1], with_tokenizer=True).tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # its first token is half a character
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0, "logit_bias": {str(ids[0]): 100}}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 1 and choice["text"] == ""
    with httpx.stream("POST", srv.base + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert streamed == choice["text"] == ""


def test_api_key_is_compared_in_constant_time(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from inferd.server import limits

    calls = []
    real = limits.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(limits.hmac, "compare_digest", spy)
    inner = Starlette(routes=[Route("/v1/x", lambda r: PlainTextResponse("ok"))])
    app = limits.Front(inner, "s3cret", limits.Limits(), state=None)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            bad = await c.get("/v1/x", headers={"Authorization": "Bearer wrong"})
            good = await c.get("/v1/x", headers={"Authorization": "Bearer s3cret"})
            x_key = await c.get("/v1/x", headers={"x-api-key": "s3cret"})  # Anthropic's clients
            return bad, good, x_key

    bad, good, x_key = asyncio.run(go())
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert good.status_code == 200 and x_key.status_code == 200
    assert calls == [(b"Bearer wrong", b"Bearer s3cret"), (b"Bearer s3cret", b"Bearer s3cret"), (b"s3cret", b"s3cret")]


def test_a_client_that_stops_reading_is_aborted():
    """A stream's write that waits on its client past the stall timeout ends the stream and closes
    the generator behind it (which aborts the engine request)."""
    from inferd.server.generation import SSEResponse

    closed = asyncio.Event()

    async def body():
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0)
        finally:
            closed.set()

    async def blocked_send(msg):
        if msg["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the client never reads: the socket stays full

    async def go():
        await SSEResponse(body(), stall_timeout=0.2).stream_response(blocked_send)

    asyncio.run(go())  # returns: the blocked write was given up on
    assert closed.is_set()


def _engine_with_faults(spec, **kw):
    from inferd.engine.engine import LLMEngine
    from inferd.faults import Faults

    eng = LLMEngine(loaded=make_tiny_model(), kv_cache_memory="16MiB", max_num_seqs=8, **kw)
    eng.faults = Faults(spec)
    return eng


def _run(eng, prompts, n=8):
    from inferd.engine.request import SamplingParams

    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p in prompts]
    outs = {i: [] for i in ids}
    errors = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.error:
                errors[o.request_id] = o.error
            outs[o.request_id].extend(o.new_token_ids)
    return ids, outs, errors


def test_a_failed_forward_fails_its_step_and_the_engine_goes_on():
    from inferd.engine.reference import reference_generate

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], [40, 41]]
    eng = _engine_with_faults("forward@3", enable_prefix_caching=True)
    ids, outs, errors = _run(eng, prompts)
    assert set(errors) == set(ids) and all("injected fault" in e for e in errors.values())  # all in that step
    assert eng.block_manager.num_used == 0 and not eng.requests and eng.stats.failed == 3
    # the engine serves on; the same prompts (a prefix cache that must hold nothing of the failed
    # step) give the reference's tokens
    ids2, outs2, errors2 = _run(eng, prompts)
    assert not errors2
    ref = [reference_generate(eng.model, p, 8).token_ids for p in prompts]
    for i, r in zip(ids2, ref):
        assert outs2[i] == list(r), (outs2[i], r)
    assert eng.block_manager.num_used == 0


def test_a_failed_batched_sample_is_retried_per_request():
    from inferd.engine.reference import reference_generate

    prompts = [[5, 6, 7], [30, 31, 32]]
    eng = _engine_with_faults("sample@2")
    ids, outs, errors = _run(eng, prompts)
    assert not errors  # the batch failed once; each request alone succeeded
    for i, p in zip(ids, prompts):
        assert outs[i] == reference_generate(eng.model, p, 8).token_ids


def test_a_failed_request_alone_gets_500_and_the_rest_complete(servers):
    s = servers["fault"]
    try:
        s.wait_ready()
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        async def one(c, stream):
            if not stream:
                r = await c.post("/v1/completions", json=body)
                return r.status_code, r.json()
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            return r.status_code, events

        async def go():
            async with httpx.AsyncClient(base_url=s.base, timeout=60) as c:
                return await asyncio.gather(one(c, False), one(c, True), one(c, False))

        results = asyncio.run(go())
        failed = [r for r in results if r[0] == 500 or (isinstance(r[1], list) and any('"error"' in e for e in r[1]))]
        assert len(failed) == 1, results
        status, got = failed[0]
        if status == 500:
            assert got["error"]["code"] == "internal_error" and "injected fault" in got["error"]["message"]
        else:
            assert got[-1] == "[DONE]" and "injected fault" in got[-2]
        texts = [r[1]["choices"][0]["text"] for r in results if r[0] == 200 and isinstance(r[1], dict)]
        again = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and all(t == again.json()["choices"][0]["text"] for t in texts)
        metrics = httpx.get(s.base + "/metrics", timeout=10).text
        assert 'inferd:kv_cache_usage_perc{' in metrics
        usage = [line for line in metrics.splitlines() if line.startswith("inferd:kv_cache_usage_perc")]
        assert usage and float(usage[0].split()[-1]) == 0.0
        assert s.alive()
        assert s.log_text().count("Traceback") == 1  # logged once, with its traceback
    finally:
        s.stop()


@contextlib.contextmanager
def _open_stream(s, max_tokens=1000):
    """A greedy completion stream on server s, once its first event came: (first event, the rest);
    its last chunk before [DONE] carries the usage."""
    body = {"prompt": "Once", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        yield first[6:], (line[6:] for line in lines if line.startswith("data: "))


def _refuses_connections(s) -> bool:
    """A new request on a new connection fails to connect: the listener is closed, which uvicorn
    does only after the signal handler ran (a draining server that still listens answers 503)."""
    try:
        httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=5)
    except httpx.HTTPError:
        return True
    return False


def test_sigterm_drains_open_streams_then_exits_0(servers):
    s = servers["drain"].wait_ready()
    try:
        with _open_stream(s) as (first, events):
            s.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _refuses_connections(s), 30, "the draining server to close its listener")
            with pytest.raises(httpx.HTTPError):  # no new connections while it drains
                httpx.post(s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=5)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        n = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in [first, *rest[:-1]] if json.loads(e)["choices"])
        assert n > 100  # the stream ran to its end after the signal
        usage = json.loads(rest[-2])["usage"]  # every token was generated and counted, none cut by the drain
        assert usage["completion_tokens"] == 1000, usage
        assert s.proc.wait(60) == 0
        assert not engine_socket_dirs(s.proc.pid)  # the engine's sockets went with it
    finally:
        s.stop()


def test_a_second_signal_exits_at_once(servers):
    s = servers["twice"].wait_ready()
    try:
        with _open_stream(s) as (_, events):
            s.proc.send_signal(signal.SIGTERM)
            # the second signal must find the first one handled: it is, once the listener is closed
            wait_until(lambda: _refuses_connections(s), 30, "the draining server to close its listener")
            s.proc.send_signal(signal.SIGTERM)
            code = s.proc.wait(60)  # --drain-timeout is 600 s: only the second signal can end it this soon
            try:
                rest = list(events)
            except httpx.HTTPError:  # the connection dropped mid-stream
                rest = []
        assert code == 0 and "[DONE]" not in rest  # it exited without finishing the open stream
        assert not engine_socket_dirs(s.proc.pid)
    finally:
        s.stop()


# -- schemathesis against the server's own OpenAPI document ----------------------------------------

# Schema-valid requests the server still refuses, by rules JSON Schema cannot state: cross-field
# ones (best_of >= n, min_tokens <= max_tokens, n > 1 needs temperature > 0, max_tokens 0 only
# with echo), a prompt longer than --max-model-len, token ids past this model's vocabulary, and a
# model name other than the served one (404). schemathesis' positive-data check is told those are
# 400 and 404; every other check keeps its defaults.
# An invalid body past --max-request-body-bytes (1025 messages with every field; a 65 kB regex) is
# refused for its size before it is parsed: 413, which the negative-data check is told is a refusal.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404"]

[checks.negative_data_rejection]
expected-statuses = ["400", "401", "404", "405", "413", "422"]
"""


def test_openapi_document_declares_errors_and_bounds(srv):
    doc = httpx.get(srv.base + "/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        resp = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(resp), (path, set(resp))
        assert "422" not in resp
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]

    def bounded(p):
        opts = p.get("anyOf", [p])
        nums = [o for o in opts if o.get("type") in ("integer", "number")]
        return all(("maximum" in o or "exclusiveMaximum" in o) and ("minimum" in o or "exclusiveMinimum" in o)
                   for o in nums)

    numeric = [k for k, p in props.items() if any(o.get("type") in ("integer", "number") for o in p.get("anyOf", [p]))]
    assert {"max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "min_tokens"} <= set(numeric)
    assert all(bounded(props[k]) for k in numeric), [k for k in numeric if not bounded(props[k])]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(srv, tmp_path):
    st = shutil.which("st") or os.path.join(os.path.dirname(sys.executable), "st")
    cfg = tmp_path / "schemathesis.toml"
    cfg.write_text(CONFIG)
    junit = tmp_path / "junit.xml"
    cmd = [st, "--config-file", str(cfg), "run", srv.base + "/openapi.json", "--max-examples", "100",
           "--request-timeout", "20", "--workers", "1", "--seed", "1", "--generation-deterministic",
           "--phases", "examples,coverage,fuzzing", "--no-color", "--report", "junit",
           # an open-ended event stream (the dashboard's): every case would wait out the request timeout
           "--exclude-path", "/v1/engine/state/stream",
           "--report-junit-path", str(junit)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    # run where its cache (.schemathesis/) lands in the test's own directory, not the repository
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    out = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, out
    m = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 1000, out  # every operation (the three dialects' included); the bodies get ~100 each
    assert "Traceback" not in srv.log_text(), srv.log_text()
    # nothing left behind: no sequence running or waiting, no KV block held
    metrics = httpx.get(srv.base + "/metrics", timeout=10).text
    gauges = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("inferd:kv_cache_usage_perc", "inferd:num_requests_running",
                                  "inferd:num_requests_waiting"))}
    assert gauges and all(v == 0 for v in gauges.values()), gauges
    assert srv.alive()

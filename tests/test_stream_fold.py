"""Stream and non-stream are one answer: at a fixed seed, `stream: true` and `stream: false` give the
same choices (text, finish_reason, token logprobs) and usage, for /v1/completions and
/v1/chat/completions with n=2, logprobs and a stop string. Then best_of: kept by cumulative logprob
when not streamed, a 400 when streamed.

One `inferd serve` on the default model for the module; every request is sent alone, so both modes
see the same batches.
"""
from __future__ import annotations

import json

import httpx
import pytest

from helpers import LOGPROB_ATOL, assert_logprobs_close

MODEL = "smollm2-135m"
TIMEOUT = 120.0
MAX_TOKENS = 12
PROMPT = "Once upon a time, in a small village,"
MESSAGES = [{"role": "user", "content": "Tell me a short story about a fox."}]
SAMPLING = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 1234, "n": 2}


@pytest.fixture(scope="module")
def base(default_gguf_path):
    from conftest import running_server

    with running_server(["--model", MODEL, "--dtype", "float32", "--host", "127.0.0.1",
                         "--kv-cache-memory", "256MiB"]) as url:
        yield url


def post(base, path, body) -> dict:
    r = httpx.post(base + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream(base, path, body) -> list[dict]:
    """The JSON chunks of an SSE response, checked to end with [DONE]."""
    with httpx.stream("POST", base + path, json={**body, "stream": True,
                                                 "stream_options": {"include_usage": True}},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data:"):].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def stop_in(text: str) -> str:
    """A 2-character piece of `text` near its middle whose first occurrence is there."""
    mid = len(text) // 2
    for j in sorted(range(len(text) - 1), key=lambda j: abs(j - mid)):
        s = text[j:j + 2]
        if j > 0 and s.strip() and text.find(s) == j:
            return s
    pytest.fail(f"no stop string in {text!r}")


# -- /v1/completions ----------------------------------------------------------------------------
def fold_completion_stream(chunks):
    """Client-side accumulation of a completions stream: {index: choice}, usage."""
    got: dict[int, dict] = {}
    for c in chunks[:-1]:
        assert c["object"] == "text_completion" and "usage" not in c
        for ch in c["choices"]:
            acc = got.setdefault(ch["index"], {"text": "", "finish_reason": None, "tokens": [],
                                               "token_logprobs": [], "top_logprobs": []})
            assert acc["finish_reason"] is None, f"chunk after finish_reason for choice {ch['index']}"
            acc["text"] += ch["text"]
            acc["finish_reason"] = ch["finish_reason"]
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                acc[key] += ch["logprobs"][key]
    assert chunks[-1]["choices"] == [], chunks[-1]
    return got, chunks[-1]["usage"]


def test_completions_stream_equals_nonstream(base):
    body = {**SAMPLING, "prompt": PROMPT, "logprobs": 2}
    probe = post(base, "/v1/completions", body)
    stop = stop_in(probe["choices"][0]["text"])
    body["stop"] = stop

    full = post(base, "/v1/completions", body)
    got, usage = fold_completion_stream(stream(base, "/v1/completions", body))

    assert sorted(ch["index"] for ch in full["choices"]) == [0, 1]
    assert sorted(got) == [0, 1]
    finishes = []
    for ch in full["choices"]:
        g, lp = got[ch["index"]], ch["logprobs"]
        what = f"choice {ch['index']}"
        assert g["text"] == ch["text"], what
        assert stop not in ch["text"], (stop, ch["text"])
        assert g["finish_reason"] == ch["finish_reason"], what
        assert g["tokens"] == lp["tokens"] and len(lp["tokens"]) >= 1, what
        assert_logprobs_close(g["token_logprobs"], lp["token_logprobs"], what)
        for j, (a, b) in enumerate(zip(g["top_logprobs"], lp["top_logprobs"])):
            assert sorted(a) == sorted(b), (what, j)
            assert_logprobs_close([a[t] for t in sorted(a)], [b[t] for t in sorted(b)], f"{what} top {j}")
        finishes.append(ch["finish_reason"])
    assert "stop" in finishes, (stop, full["choices"])  # choice 0 meets the stop string, at least
    assert usage == full["usage"]
    assert usage["completion_tokens"] >= 2


# -- /v1/chat/completions -----------------------------------------------------------------------
def fold_chat_stream(chunks):
    got: dict[int, dict] = {}
    for c in chunks[:-1]:
        assert c["object"] == "chat.completion.chunk" and "usage" not in c
        for ch in c["choices"]:
            acc = got.setdefault(ch["index"], {"role": None, "content": "", "finish_reason": None,
                                               "logprobs": []})
            assert acc["finish_reason"] is None, f"chunk after finish_reason for choice {ch['index']}"
            acc["role"] = ch["delta"].get("role", acc["role"])
            acc["content"] += ch["delta"].get("content") or ""
            acc["finish_reason"] = ch["finish_reason"]
            acc["logprobs"] += (ch["logprobs"] or {"content": []})["content"]
    assert chunks[-1]["choices"] == [], chunks[-1]
    return got, chunks[-1]["usage"]


def test_chat_stream_equals_nonstream(base):
    body = {**SAMPLING, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    probe = post(base, "/v1/chat/completions", body)
    stop = stop_in(probe["choices"][0]["message"]["content"])
    body["stop"] = stop

    full = post(base, "/v1/chat/completions", body)
    got, usage = fold_chat_stream(stream(base, "/v1/chat/completions", body))

    assert sorted(ch["index"] for ch in full["choices"]) == [0, 1]
    assert sorted(got) == [0, 1]
    finishes = []
    for ch in full["choices"]:
        g, msg, lp = got[ch["index"]], ch["message"], ch["logprobs"]["content"]
        what = f"choice {ch['index']}"
        assert g["role"] == msg["role"] == "assistant", what
        assert g["content"] == msg["content"], what
        assert stop not in msg["content"], (stop, msg["content"])
        assert g["finish_reason"] == ch["finish_reason"], what
        assert [e["token"] for e in g["logprobs"]] == [e["token"] for e in lp] and lp, what
        assert_logprobs_close([e["logprob"] for e in g["logprobs"]], [e["logprob"] for e in lp], what)
        for j, (a, b) in enumerate(zip(g["logprobs"], lp)):
            assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]], (what, j)
            assert_logprobs_close([t["logprob"] for t in a["top_logprobs"]], [t["logprob"] for t in b["top_logprobs"]],
                         f"{what} top {j}")
        finishes.append(ch["finish_reason"])
    assert "stop" in finishes, (stop, full["choices"])
    assert usage == full["usage"]
    assert usage["completion_tokens"] >= 2


# -- best_of ------------------------------------------------------------------------------------
def test_best_of_keeps_the_best_sample(base):
    """best_of=3 samples with the seeds n=3 uses (seed + sample index): the one kept is the n=3
    sample with the highest cumulative logprob, for each prompt of a two-prompt request."""
    prompts = [PROMPT, "The recipe for a good soup starts with"]
    body = {**SAMPLING, "prompt": prompts, "logprobs": 0}
    three = post(base, "/v1/completions", {**body, "n": 3})
    best = post(base, "/v1/completions", {**body, "n": 1, "best_of": 3})
    assert len(three["choices"]) == 6
    assert [ch["index"] for ch in best["choices"]] == [0, 1]
    for p in range(2):
        mine = [ch for ch in three["choices"] if ch["index"] // 3 == p]
        sums = [sum(ch["logprobs"]["token_logprobs"]) for ch in mine]
        # the n=3 run is another batch shape than best_of's: sums within MAX_TOKENS x LOGPROB_ATOL tie
        tops = [(ch["text"], ch["finish_reason"]) for ch, s in zip(mine, sums)
                if max(sums) - s <= MAX_TOKENS * LOGPROB_ATOL]
        kept = best["choices"][p]
        assert (kept["text"], kept["finish_reason"]) in tops, (p, kept["text"], [ch["text"] for ch in mine], sums)
    assert best["usage"] == three["usage"]  # all best_of samples are generated, and counted


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": MESSAGES})])
def test_best_of_one_choice_and_no_stream(base, path, extra):
    body = {**SAMPLING, **extra, "n": 1, "best_of": 3}
    r = post(base, path, body)
    assert len(r["choices"]) == 1 and r["choices"][0]["index"] == 0, r
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] >= 3  # three samples ran

    r = httpx.post(base + path, json={**body, "stream": True}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and "best_of" in err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == "best_of", err
    assert "code" in err

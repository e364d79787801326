"""`inferd serve` end to end: a real server subprocess on a loopback port, spoken to over real HTTP
(the official `openai` client, raw httpx and SSE), checked against the offline engine.

Two server start-ups in all: the main one (module scope) and one with `--api-key` and a tiny
`--max-waiting` for the auth and overload tests.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import conftest
from helpers import assert_logprobs_close, compare_texts_by_gaps, top2_gap
from inferd import LLM, SamplingParams

MODEL = "smollm2-135m"
READY_TIMEOUT = 120.0
HTTP_TIMEOUT = 120.0
API_KEY = "sekret"

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TOKEN_ID_TEXT = "The quick brown fox"
TWO_PROMPTS = ["Water boils at", "The three primary colors are"]
EMOJI_PROMPT = "Emoji and Chinese: 🌍🚀 你好世界 🌍🚀 你好世界 🌍🚀 你好"
EMOJI_CHAT = [{"role": "user", "content": "Repeat exactly: 你好世界 🌍🚀 café"}]
ECHO_PROMPT = "The capital of France is Paris, and the capital of Italy is"
LONG_PROMPT = "Count from 1 to 1000: 1, 2, 3, 4, 5,"
_TOPICS = ["the ocean", "a dragon", "Paris", "the moon", "a robot", "coffee", "winter", "a library",
           "mountains", "a cat", "the desert", "music", "a train", "the forest", "rain", "a castle",
           "bicycles", "the sun", "a garden", "chess", "the river", "a pirate", "snow", "a bakery",
           "volcanoes", "an owl", "the city", "a violin", "the stars", "a lighthouse", "bees", "a clock"]
CONC_PROMPTS = [f"Write one sentence about {t}:" for t in _TOPICS]
assert len(set(CONC_PROMPTS)) == 32


# -- server processes ---------------------------------------------------------------------------
def ServerProc(*extra: str, api_key: str | None = None):
    """conftest's ServerProc with this module's model and flags."""
    return conftest.ServerProc(["--model", MODEL, "--quantization", "none", "--dtype", "float32", "--host", "127.0.0.1", "--kv-cache-memory",
                                "256MiB", *extra], api_key=api_key, timeout=READY_TIMEOUT)


_SERVERS: list = []


@pytest.fixture(scope="module")
def server_proc():
    srv = ServerProc("--max-num-seqs", "64")
    _SERVERS.append(srv)
    yield srv
    _SERVERS.remove(srv)
    srv.stop()


@pytest.fixture(scope="module")
def server(server_proc):
    return server_proc.wait_ready()


@pytest.fixture(scope="module")
def small_server():
    """--api-key and a tiny waiting queue; started only for the last tests of the module."""
    srv = ServerProc("--max-waiting", "4", "--max-num-seqs", "2", api_key=API_KEY)
    _SERVERS.append(srv)
    try:
        yield srv.wait_ready()
    finally:
        _SERVERS.remove(srv)
        srv.stop()


@pytest.fixture(autouse=True)
def _server_log_on_failure(request):
    """On a failed test, print the tail of every live server's log straight to the terminal; and a
    server that died during a test fails it."""
    failed_before = request.session.testsfailed
    yield
    dead = [s for s in _SERVERS if s.ready and not s.alive()]
    if request.session.testsfailed > failed_before or dead:
        tr = request.config.pluginmanager.getplugin("terminalreporter")
        for s in _SERVERS:
            msg = f"\n----- server log ({' '.join(s.cmd[3:])}) -----\n{s.log_text()}\n"
            if tr is not None:
                tr.write_line(msg)
            else:
                sys.__stderr__.write(msg)
    if dead:
        pytest.fail(f"server process died (exit {[s.proc.returncode for s in dead]})")


def client(srv, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=key, timeout=HTTP_TIMEOUT, max_retries=0)


# -- the offline engine and its reference outputs ------------------------------------------------
@pytest.fixture(scope="module")
def llm(server_proc):  # depends on server_proc so the server loads while this does
    return LLM(model=MODEL, quantization="none", dtype="float32", kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def chat_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


@pytest.fixture(scope="module")
def refs(llm, tok):
    """Every greedy reference the module needs, in one offline batch (top-2 logprobs kept so a
    mismatch can be checked for a near tie)."""
    jobs: dict[str, tuple] = {
        "cmp": (COMPLETION_PROMPT, 16),
        "chat": (chat_ids(tok, CHAT_MESSAGES), 16),
        "ids": (tok.encode(TOKEN_ID_TEXT), 8),
        "two0": (TWO_PROMPTS[0], 8),
        "two1": (TWO_PROMPTS[1], 8),
        "emoji": (EMOJI_PROMPT, 40),
        "emoji_chat": (chat_ids(tok, EMOJI_CHAT), 40),
    }
    for i, p in enumerate(CONC_PROMPTS):
        jobs[f"c{i}"] = (p, 16)
    keys = list(jobs)
    params = [SamplingParams(max_tokens=jobs[k][1], temperature=0, logprobs=2) for k in keys]
    keys.append("echo")
    params.append(SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1))
    prompts = [jobs[k][0] for k in keys[:-1]] + [ECHO_PROMPT]
    outs = llm.generate(prompts, params)
    return dict(zip(keys, outs))


def assert_greedy_text(got: str, ref, tok, what: str = ""):
    """`got` is the offline greedy text; where it is not, the first divergence must sit at a near
    tie of the offline top-2 logprobs (batch composition may flip such a tie): 1e-3 here, the
    offline run's logprobs being a batch's, not the fp32 reference loop's."""
    if got == ref.text:  # the offline run's own text (its detokenizer's, as the server's)
        return
    gaps = [top2_gap([lp for _, lp in e[2]]) if len(e[2]) >= 2 else float("inf") for e in ref.logprobs or []]
    if compare_texts_by_gaps([got], [(ref.token_ids, gaps)], tok, max_ties=1, gap=1e-3, what=what):
        print(f"near tie accepted ({what}): server {got!r} vs offline {ref.text!r}")


# -- helpers ------------------------------------------------------------------------------------
def metrics(srv: ServerProc) -> dict[str, float]:
    """Every sample of /metrics, summed over labels, by sample name."""
    r = httpx.get(srv.base + "/metrics", timeout=30, headers=srv.auth)
    assert r.status_code == 200, r.text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


_MISSING = object()


def metric(m: dict[str, float], name: str, default=_MISSING) -> float:
    """A sample by name; a counter's `_total` suffix may be given or not. `default` for a
    labelled family with no samples yet (a fresh server)."""
    if name in m:
        return m[name]
    alt = name[: -len("_total")] if name.endswith("_total") else name + "_total"
    if alt in m:
        return m[alt]
    if default is not _MISSING:
        return default
    raise KeyError(f"{name} not in /metrics; have {sorted(k for k in m if k.startswith('inferd:'))}")


def assert_error_body(r: httpx.Response, what: str = ""):
    try:
        body = r.json()
    except ValueError:
        pytest.fail(f"{what}: error response is not JSON: {r.status_code} {r.text[:300]!r}")
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{what}: {body!r}"
    e = body["error"]
    assert isinstance(e.get("message"), str) and e["message"], f"{what}: {body!r}"
    assert isinstance(e.get("type"), str) and e["type"], f"{what}: {body!r}"
    assert "param" in e and "code" in e, f"{what}: {body!r}"


def sse_events(r: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    return [line[len("data:"):].strip() for line in r.iter_lines() if line.startswith("data:")]


def stream_completion_text(srv, body: dict, headers=None) -> tuple[str, list[str], str | None]:
    """Stream /v1/completions over raw SSE: (concatenated text, deltas, finish_reason)."""
    deltas, finish = [], None
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", srv.base + "/v1/completions", json={**body, "stream": True},
                      headers=headers) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
    assert events and events[-1] == "[DONE]", events[-3:]
    for ev in events[:-1]:
        chunk = json.loads(ev)
        for ch in chunk.get("choices") or []:
            deltas.append(ch.get("text") or "")
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    return "".join(deltas), deltas, finish


def stream_chat_text(srv, body: dict) -> tuple[str, list[str], str | None]:
    deltas, finish = [], None
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", srv.base + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
    assert events and events[-1] == "[DONE]", events[-3:]
    for ev in events[:-1]:
        chunk = json.loads(ev)
        assert chunk["object"] == "chat.completion.chunk"
        for ch in chunk.get("choices") or []:
            deltas.append((ch.get("delta") or {}).get("content") or "")
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    return "".join(deltas), deltas, finish


# == 8. plain routes ============================================================================
def test_models(server):
    r = httpx.get(server.base + "/v1/models", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert client(server).models.list().data[0].id == MODEL


def test_tokenize_detokenize(server, tok):
    r = httpx.post(server.base + "/tokenize", json={"prompt": "Hello world"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok.encode("Hello world")
    assert body["tokens"] == want
    assert body["count"] == len(want)
    assert isinstance(body["max_model_len"], int) and body["max_model_len"] > len(want)
    r = httpx.post(server.base + "/detokenize", json={"tokens": want}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(want)}
    assert r.json()["prompt"].endswith("Hello world")


def test_health(server):
    r = httpx.get(server.base + "/health", timeout=10)
    assert r.status_code == 200


# == 1. official openai client ==================================================================
def test_openai_completion_greedy_matches_offline(server, refs, tok):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert_greedy_text(r.choices[0].text, refs["cmp"], tok, "completion")
    assert r.choices[0].finish_reason in ("length", "stop")
    u = r.usage
    assert u is not None
    assert u.prompt_tokens == len(tok.encode(COMPLETION_PROMPT))
    assert 1 <= u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if r.choices[0].text == refs["cmp"].text:
        assert u.completion_tokens == len(refs["cmp"].token_ids)
        assert r.choices[0].finish_reason == refs["cmp"].finish_reason


def test_openai_chat_greedy_matches_offline(server, refs, tok):
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert_greedy_text(msg.content, refs["chat"], tok, "chat")
    u = r.usage
    assert u is not None
    assert u.prompt_tokens == len(chat_ids(tok, CHAT_MESSAGES))
    assert 1 <= u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_offline_chat_and_prompt_dicts_take_the_plain_path(server, llm, tok, default_gguf_path):
    """vLLM's offline forms: `LLM.chat` renders a conversation as transformers' apply_chat_template
    does (tools and template variables too), and its greedy tokens are those of the same ids given
    as {"prompt_token_ids": ...} and the server's chat answer; {"prompt": text} is the text. A bad
    prompt in a batch is one error and leaves nothing queued."""
    import os

    transformers = pytest.importorskip("transformers")
    from inferd.errors import InferdError

    from helpers import hf_gguf_tokenizer

    hf = hf_gguf_tokenizer(default_gguf_path)

    def hf_ids(messages, **kw):
        return hf.encode(hf.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)

    sp = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
    other = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    chats = llm.chat([CHAT_MESSAGES, other], sp)
    want = [hf_ids(m, add_generation_prompt=True) for m in (CHAT_MESSAGES, other)]
    assert [c.prompt_token_ids for c in chats] == want
    plain = llm.generate([{"prompt_token_ids": ids} for ids in want], sp)
    for c, g in zip(chats, plain):
        assert_greedy_text(c.text, g, tok, "LLM.chat vs prompt_token_ids")
    one = llm.chat(CHAT_MESSAGES, sp)
    assert len(one) == 1 and one[0].prompt_token_ids == want[0]
    r = client(server).chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=16, temperature=0)
    assert_greedy_text(r.choices[0].message.content, one[0], tok, "server chat vs LLM.chat")
    # the template's variables, as Hugging Face passes them
    brief = SamplingParams(max_tokens=1, temperature=0)
    for kw in (dict(add_generation_prompt=False), dict(tools=TOOLS), dict(chat_template_kwargs={"extra": 1})):
        got = llm.chat(CHAT_MESSAGES, brief, **kw)[0].prompt_token_ids
        hf_kw = {"add_generation_prompt": kw.get("add_generation_prompt", True), "tools": kw.get("tools"),
                 **kw.get("chat_template_kwargs", {})}
        assert got == hf_ids(CHAT_MESSAGES, **hf_kw), kw
    # prompt dicts: the text, the ids, and both beside a plain string in one batch
    outs = llm.generate([{"prompt": COMPLETION_PROMPT}, {"prompt_token_ids": tok.encode(COMPLETION_PROMPT)},
                         COMPLETION_PROMPT], sp)
    assert len({tuple(o.prompt_token_ids) for o in outs}) == 1
    for o in outs:
        assert_greedy_text(o.text, outs[2], tok, "prompt dict vs string")
    for bad, words in (({"prompt_token_ids": [1, "x"]}, "integer token ids"), ({"prompt_token_ids": "12"}, "a list"),
                       ({"prompt": [1, 2]}, "prompt must be a string"), ({"text": "hi"}, "key 'text'")):
        with pytest.raises(InferdError, match=words):
            llm.generate([COMPLETION_PROMPT, bad], brief)
        assert not llm.engine.has_unfinished()
    for bad, words in (([{"role": "wizard", "content": "hi"}], "role 'wizard'"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url")):
        with pytest.raises(InferdError, match=words):
            llm.chat(bad, brief)


def test_openai_completion_stream_equals_nonstream_seeded(server):
    c = client(server)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=123)
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks, "no chunks"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join(ch.choices[0].text for ch in chunks[:-1] if ch.choices)
    assert text == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_openai_chat_stream_equals_nonstream_seeded(server):
    c = client(server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a short story."}],
              max_tokens=16, temperature=0.8, seed=123)
    full = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join((ch.choices[0].delta.content or "") for ch in chunks[:-1] if ch.choices)
    assert text == full.choices[0].message.content
    roles = [ch.choices[0].delta.role for ch in chunks[:-1] if ch.choices and ch.choices[0].delta.role]
    assert roles and roles[0] == "assistant"


def test_openai_stream_without_usage_option(server):
    chunks = list(client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                                      stream=True))
    assert chunks and all(ch.usage is None for ch in chunks)
    assert all(ch.choices for ch in chunks)


# == 8. prompt forms, n, raw SSE ================================================================
def test_completion_token_id_prompt(server, refs, tok):
    ids = tok.encode(TOKEN_ID_TEXT)
    r = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert_greedy_text(r.choices[0].text, refs["ids"], tok, "token-id prompt")
    assert r.usage.prompt_tokens == len(ids)


def test_completion_two_prompts(server, refs, tok):
    r = client(server).completions.create(model=MODEL, prompt=TWO_PROMPTS, max_tokens=8, temperature=0)
    assert len(r.choices) == 2
    by_index = {ch.index: ch for ch in r.choices}
    assert sorted(by_index) == [0, 1]
    assert_greedy_text(by_index[0].text, refs["two0"], tok, "prompt 0")
    assert_greedy_text(by_index[1].text, refs["two1"], tok, "prompt 1")
    assert by_index[0].text != by_index[1].text
    n_prompt = len(tok.encode(TWO_PROMPTS[0])) + len(tok.encode(TWO_PROMPTS[1]))
    assert r.usage.prompt_tokens == n_prompt


def test_n2_sampling(server):
    r = client(server).completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8,
                                          temperature=1.0, n=2, seed=7)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert all(isinstance(ch.text, str) for ch in r.choices)
    r = client(server).chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=8,
                                               temperature=1.0, n=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1]


def test_raw_sse_ends_with_done(server):
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}),
                           ("/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 4,
                                                     "temperature": 0})):
            with c.stream("POST", server.base + path, json={**body, "model": MODEL, "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                events = sse_events(r)
            assert len(events) >= 2 and events[-1] == "[DONE]", (path, events)
            assert events.count("[DONE]") == 1
            for ev in events[:-1]:
                obj = json.loads(ev)
                assert obj["object"] in ("text_completion", "chat.completion.chunk"), obj


# == 2. concurrency ==============================================================================
class MetricsPoller(threading.Thread):
    def __init__(self, srv, period: float = 0.05):
        super().__init__(daemon=True)
        self.srv, self.period = srv, period
        self.stop_evt = threading.Event()
        self.max_running = 0.0
        self.polls = 0
        self.errors: list[str] = []

    def run(self):
        with httpx.Client(timeout=30) as c:
            while not self.stop_evt.is_set():
                try:
                    r = c.get(self.srv.base + "/metrics", headers=self.srv.auth)
                    m = {}
                    for fam in text_string_to_metric_families(r.text):
                        for s in fam.samples:
                            m[s.name] = m.get(s.name, 0.0) + s.value
                    self.max_running = max(self.max_running, metric(m, "inferd:num_requests_running"))
                    self.polls += 1
                except Exception as e:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(e))
                self.stop_evt.wait(self.period)


def test_32_concurrent_streams(server, refs, tok):
    poller = MetricsPoller(server)
    poller.start()
    c = client(server)
    barrier = threading.Barrier(32)

    def one(i):
        barrier.wait(timeout=60)
        parts, finish = [], None
        for ch in c.completions.create(model=MODEL, prompt=CONC_PROMPTS[i], max_tokens=16, temperature=0,
                                       stream=True):
            if ch.choices:
                parts.append(ch.choices[0].text or "")
                finish = ch.choices[0].finish_reason or finish
        return "".join(parts), finish

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(32) as ex:
            results = list(ex.map(one, range(32)))
    finally:
        poller.stop_evt.set()
        poller.join(30)
    dt = time.monotonic() - t0
    print(f"32 streams in {dt:.1f} s; max running {poller.max_running} over {poller.polls} polls")
    for i, (text, finish) in enumerate(results):
        assert finish in ("length", "stop"), (i, finish)
        assert_greedy_text(text, refs[f"c{i}"], tok, f"stream {i}")
    assert poller.polls > 0, poller.errors[:3]
    assert poller.max_running >= 8, (
        f"max inferd:num_requests_running seen = {poller.max_running} over {poller.polls} polls in {dt:.1f} s")


# == 3. client disconnect =======================================================================
def test_stream_disconnect_frees_everything(server):
    before = metrics(server)
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        with c.stream("POST", server.base + "/v1/completions",
                      json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0,
                            "stream": True}) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    assert line.strip() != "data: [DONE]", "stream ended before 3 chunks"
                    n += 1
                    if n == 3:
                        break
            r.close()
    deadline = time.monotonic() + 10
    m = metrics(server)
    while time.monotonic() < deadline:
        m = metrics(server)
        if metric(m, "inferd:num_requests_running") == 0 and metric(m, "inferd:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert metric(m, "inferd:num_requests_running") == 0
    assert metric(m, "inferd:num_requests_waiting") == 0
    assert metric(m, "inferd:kv_cache_usage_perc") == 0, "KV blocks still held after the client left"
    gen = metric(m, "inferd:generation_tokens_total", 0) - metric(before, "inferd:generation_tokens_total", 0)
    assert gen < 400, f"the abandoned request ran to completion ({gen} tokens)"
    # and the server still serves
    r = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


# == 6. unicode streaming and stop strings ======================================================
def test_stream_emoji_cjk_completion(server, refs, tok):
    text, deltas, finish = stream_completion_text(
        server, {"model": MODEL, "prompt": EMOJI_PROMPT, "max_tokens": 40, "temperature": 0})
    bad = [d for d in deltas if "\ufffd" in d]
    assert not bad, f"U+FFFD in streamed deltas: {bad!r}"
    assert_greedy_text(text, refs["emoji"], tok, "emoji completion")
    assert any(ord(ch) > 0xFFFF for ch in text) or any("\u4e00" <= ch <= "\u9fff" for ch in text), text
    full = client(server).completions.create(model=MODEL, prompt=EMOJI_PROMPT, max_tokens=40, temperature=0)
    assert full.choices[0].text == text
    assert "\ufffd" not in full.choices[0].text


def test_stream_emoji_cjk_chat(server, refs, tok):
    text, deltas, finish = stream_chat_text(
        server, {"model": MODEL, "messages": EMOJI_CHAT, "max_tokens": 40, "temperature": 0})
    bad = [d for d in deltas if "\ufffd" in d]
    assert not bad, f"U+FFFD in streamed chat deltas: {bad!r}"
    assert_greedy_text(text, refs["emoji_chat"], tok, "emoji chat")
    assert finish in ("length", "stop")


def _boundary_stop(text: str, ids: list[int], tok) -> str:
    """A 3-character string of `text` spanning a token boundary (one char before it, two after),
    near the middle, whose first occurrence is right there."""
    bounds = []
    for k in range(1, len(ids)):
        pre = tok.decode(ids[:k], skip_special_tokens=True)
        if "\ufffd" in pre or not text.startswith(pre):
            continue
        bounds.append(len(pre))
    mid = len(text) / 2
    for b in sorted(set(bounds), key=lambda b: abs(b - mid)):
        if b < 2 or b + 2 > len(text):
            continue
        s = text[b - 1: b + 2]
        if s.strip() and text.find(s) == b - 1:
            return s
    pytest.fail(f"no boundary-spanning stop string in {text!r}")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_string_across_token_boundary(server, refs, tok, kind):
    c = client(server)
    if kind == "completion":
        ref = refs["cmp"]
        full = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0)
        text = full.choices[0].text
        base = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 16, "temperature": 0}
    else:
        ref = refs["chat"]
        full = c.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=16, temperature=0)
        text = full.choices[0].message.content
        base = {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": 16, "temperature": 0}
    assert text == ref.text, "greedy text differs from offline; token boundaries unknown"
    stop = _boundary_stop(text, ref.token_ids, tok)
    want = text[: text.index(stop)]
    streamer = stream_completion_text if kind == "completion" else stream_chat_text
    got, deltas, finish = streamer(server, {**base, "stop": [stop]})
    assert stop not in got, (stop, got)
    assert got == want, (stop, got, want)
    assert finish == "stop"
    # non-streamed, the same cut
    if kind == "completion":
        r = c.completions.create(stop=[stop], **{k: v for k, v in base.items()})
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    else:
        r = c.chat.completions.create(stop=[stop], **{k: v for k, v in base.items()})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")


# == 7. echo + logprobs =========================================================================
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs(server, refs, tok, max_tokens):
    r = httpx.post(server.base + "/v1/completions", timeout=HTTP_TIMEOUT, json={
        "model": MODEL, "prompt": ECHO_PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"].startswith(ECHO_PROMPT), ch["text"]
    lp = ch["logprobs"]
    ref = refs["echo"]
    prompt_ids = ref.prompt_token_ids
    assert prompt_ids == tok.encode(ECHO_PROMPT)
    P = len(prompt_ids)
    tl = lp["token_logprobs"]
    assert len(tl) == P + max_tokens, (len(tl), P, max_tokens)
    assert len(lp["tokens"]) == len(tl)
    assert tl[0] is None
    # served against offline: other batch shapes, so the values within LOGPROB_ATOL
    assert_logprobs_close(tl[1:P], [ref.prompt_logprobs[i][0] for i in range(1, P)], "prompt token logprobs")
    if max_tokens == 1:
        assert ch["text"] == ECHO_PROMPT + ref.text
        assert_logprobs_close(tl[P], ref.logprobs[0][0], "the generated token's logprob")
    else:
        assert ch["text"] == ECHO_PROMPT


# == 5. metrics ==================================================================================
def test_metrics_counters_move(server):
    names = ["inferd:generation_tokens_total", "inferd:prompt_tokens_total",
             "inferd:time_to_first_token_seconds_count", "inferd:e2e_request_latency_seconds_count",
             "inferd:attention_prefill_calls_total", "inferd:attention_prefill_tiles_total"]
    before = metrics(server)
    for n in ["inferd:num_requests_running", "inferd:num_requests_waiting", "inferd:kv_cache_usage_perc"]:
        metric(before, n)  # present
    r = client(server).completions.create(model=MODEL, prompt="The weather today is", max_tokens=8,
                                          temperature=0)
    deadline = time.monotonic() + 5
    while True:
        after = metrics(server)
        d = {n: metric(after, n, 0) - metric(before, n, 0) for n in names}
        if all(v > 0 for v in d.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert d["inferd:generation_tokens_total"] >= r.usage.completion_tokens, d
    assert d["inferd:prompt_tokens_total"] >= r.usage.prompt_tokens, d
    assert d["inferd:time_to_first_token_seconds_count"] >= 1, d
    assert d["inferd:e2e_request_latency_seconds_count"] >= 1, d
    # the prompt's attention ran through the native paged kernel, tile by tile (the counters that prove it)
    assert d["inferd:attention_prefill_calls_total"] >= 1 and d["inferd:attention_prefill_tiles_total"] >= 1, d
    for n in names + ["inferd:attention_decode_calls_total", "inferd:attention_decode_splits_total",
                      "inferd:kv_cache_int8_rows_written_total"]:
        metric(after, n)  # present under one of its names


# == 4. malformed and hostile requests ===========================================================
_C, _CH = "/v1/completions", "/v1/chat/completions"
_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
_OKC = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    ("malformed json", _C, b'{"prompt": "Hello", "max_tokens": ', (400,)),
    ("malformed json chat", _CH, b"{not json at all", (400,)),
    ("non-object json (list)", _C, b"[1, 2, 3]", (400,)),
    ("non-object json (string)", _CH, b'"hello"', (400,)),
    ("prompt is a number", _C, {**_OK, "prompt": 42}, (400,)),
    ("temperature is a string", _C, {**_OK, "temperature": "hot"}, (400,)),
    ("messages not a list", _CH, {**_OKC, "messages": "Hi"}, (400,)),
    ("max_tokens 0 without echo", _C, {**_OK, "max_tokens": 0}, (400,)),
    ("max_tokens negative", _C, {**_OK, "max_tokens": -5}, (400,)),
    ("chat max_tokens negative", _CH, {**_OKC, "max_tokens": -1}, (400,)),
    ("negative temperature", _C, {**_OK, "temperature": -0.5}, (400,)),
    ("top_p 0", _C, {**_OK, "top_p": 0}, (400,)),
    ("top_p 1.5", _CH, {**_OKC, "top_p": 1.5}, (400,)),
    ("n 1000", _C, {**_OK, "n": 1000, "temperature": 1.0}, (400,)),
    ("n 2 with temperature 0", _C, {**_OK, "n": 2, "temperature": 0}, (400,)),
    ("max_tokens past the context", _C, {**_OK, "max_tokens": 100000}, (400,)),
    ("chat max_tokens past the context", _CH, {**_OKC, "max_tokens": 100000}, (400,)),
    ("unknown model", _C, {**_OK, "model": "gpt-9000"}, (400, 404)),
    ("unknown model chat", _CH, {**_OKC, "model": "gpt-9000"}, (400, 404)),
    ("empty messages", _CH, {**_OKC, "messages": []}, (400,)),
    ("message without role", _CH, {**_OKC, "messages": [{"content": "Hi"}]}, (400,)),
    ("token id outside the vocabulary", _C, {**_OK, "prompt": [99999999]}, (400,)),
    ("negative token id", _C, {**_OK, "prompt": [1, -3]}, (400,)),
    ("empty prompt", _C, {**_OK, "prompt": ""}, (400,)),
    ("logprobs 50", _C, {**_OK, "logprobs": 50}, (400,)),
    ("chat top_logprobs 50", _CH, {**_OKC, "logprobs": True, "top_logprobs": 50}, (400,)),
    ("presence_penalty 5", _C, {**_OK, "presence_penalty": 5}, (400,)),
    ("missing prompt", _C, {"model": MODEL, "max_tokens": 4}, (400,)),
    ("logit_bias key not an integer", _C, {**_OK, "logit_bias": {"abc": 1}}, (400,)),
    ("logit_bias key outside the vocabulary", _C, {**_OK, "logit_bias": {"99999999": 1}}, (400,)),
    ("mixed prompt list", _C, {**_OK, "prompt": [1, "a"]}, (400,)),
    ("detokenize id outside the vocabulary", "/detokenize", {"tokens": [99999999]}, (400,)),
    ("tokenize wrong type", "/tokenize", {"prompt": 5}, (400,)),
]


def test_malformed_requests(server):
    assert len(BAD_REQUESTS) >= 20
    failures = []
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        for what, path, body, statuses in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = c.post(server.base + path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(server.base + path, json=body)
            if r.status_code not in statuses:
                failures.append(f"{what}: POST {path} {body!r} -> {r.status_code} {r.text[:200]!r} "
                                f"(want {statuses})")
                continue
            try:
                assert_error_body(r, what)
            except AssertionError as e:
                failures.append(f"{what}: bad error body: {e}")
        # the same through streaming requests: errors come before the stream starts
        for what, path, body, statuses in BAD_REQUESTS:
            if isinstance(body, bytes) or path not in (_C, _CH):
                continue
            r = c.post(server.base + path, json={**body, "stream": True})
            if r.status_code not in statuses:
                failures.append(f"{what} (stream): -> {r.status_code} {r.text[:200]!r} (want {statuses})")
    assert not failures, "\n".join(failures)
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    r = client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1


def test_openai_client_raises_on_bad_request(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        c.chat.completions.create(model="nope", messages=CHAT_MESSAGES, max_tokens=4)


def test_echo_allows_max_tokens_zero_only_with_echo(server):
    r = httpx.post(server.base + "/v1/completions", timeout=HTTP_TIMEOUT,
                   json={"model": MODEL, "prompt": "Hello", "echo": True, "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello"


# == 8. --api-key ===============================================================================
def test_api_key(small_server):
    base = small_server.base
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=HTTP_TIMEOUT) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = c.request(method, base + path, json=body if method == "POST" else None, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code, r.text)
                assert_error_body(r, f"401 {path}")
        good = {"Authorization": f"Bearer {API_KEY}"}
        r = c.post(base + "/v1/completions", json=body, headers=good)
        assert r.status_code == 200, r.text
        r = c.get(base + "/v1/models", headers=good)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert c.get(base + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(small_server, key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    r = client(small_server, key=API_KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                             temperature=0)
    assert r.usage.completion_tokens >= 1


# == 4. overload: 2,000 requests past --max-waiting =============================================
def test_burst_past_max_waiting(small_server):
    base = small_server.base
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    statuses: dict[int, int] = {}
    bad: list[str] = []
    lock = threading.Lock()

    with httpx.Client(timeout=60, limits=limits, headers=headers) as c:
        def post(i):
            return c.post(base + "/v1/completions",
                          json={"model": MODEL, "prompt": f"Number {i}:", "max_tokens": 4, "temperature": 0})

        def one(i):
            try:
                try:
                    r = post(i)
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    # a pooled keep-alive connection reset as it was reused: the request never
                    # reached the server, so it is sent again once, as HTTP clients do
                    r = post(i)
            except httpx.HTTPError as e:
                with lock:
                    statuses[-1] = statuses.get(-1, 0) + 1
                    if len(bad) < 10:
                        bad.append(f"{i}: {e!r}")
                return
            with lock:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 503:
                try:
                    assert r.headers.get("retry-after"), "503 without Retry-After"
                    assert_error_body(r, "503")
                except AssertionError as e:
                    with lock:
                        if len(bad) < 10:
                            bad.append(f"{i}: {e}")
            elif r.status_code != 200:
                with lock:
                    if len(bad) < 10:
                        bad.append(f"{i}: {r.status_code} {r.text[:200]!r}")

        t0 = time.monotonic()
        with ThreadPoolExecutor(64) as ex:
            list(ex.map(one, range(2000)))
        dt = time.monotonic() - t0
    assert small_server.alive(), "server crashed under the burst"
    print(f"burst: {statuses} in {dt:.1f} s")
    assert sum(statuses.values()) == 2000
    assert not bad, f"statuses {statuses} in {dt:.1f} s; e.g. {bad}"
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.get(503, 0) > 0, f"no 503 past --max-waiting 4: {statuses}"
    assert statuses.get(200, 0) > 0, statuses
    # and it serves normally afterwards, with nothing left queued
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    r = client(small_server, key=API_KEY).completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                                             temperature=0)
    assert r.usage.completion_tokens >= 1
    deadline = time.monotonic() + 10
    while True:
        m = metrics(small_server)
        if metric(m, "inferd:num_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metric(m, "inferd:num_requests_running") == 0
    assert metric(m, "inferd:num_requests_waiting") == 0
    assert metric(m, "inferd:kv_cache_usage_perc") == 0

"""The chat page (/) and the live dashboard (/dashboard), driven in Debian's headless Chromium through
Playwright (pointed at /usr/bin/chromium: no browser download), against a real `inferd serve` of
the default model with an API key.

What a person would do: give the key, chat, stop a long answer, watch the dashboard under load.
What is checked behind the page: the greedy answer equals the API's, a stopped answer is an abort
in the server's counters with its blocks freed, the dashboard's KV map counts the blocks the state
endpoint counts for the same step, markup typed into the chat runs nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

import conftest

pytestmark = pytest.mark.slow

KEY = "sk-web-test"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTEFACTS = os.environ.get("INFERD_TEST_ARTEFACTS", os.path.join(os.path.dirname(__file__), "..", "artefacts"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = conftest.ServerProc(["--served-model-name", "smol", "--max-model-len", "2048", "--kv-cache-memory", "256MiB"],
                              log_path=tmp_path_factory.mktemp("web") / "serve.log", api_key=KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no headless Chromium (`make test` installs Debian's chromium where apt-get works)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-background-networking", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1300, "height": 1000})
    pg = ctx.new_page()
    pg.errors = []  # uncaught exceptions and CSP violations: a page that throws fails its test
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.errors.append(m.text) if "Content Security Policy" in m.text else None)
    yield pg
    ctx.close()


def give_key(pg):
    pg.wait_for_selector("#key-box:not([hidden])")
    pg.fill("#key-input", KEY)
    pg.click("#key-form button")


def state(server, **params) -> dict:
    r = httpx.get(server.base + "/v1/engine/state", params=params, headers=server.auth, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def open_chat(pg, server, max_tokens: int):
    """The chat page with the key given, its model loaded, greedy, at most max_tokens an answer."""
    pg.goto(server.base + "/")
    give_key(pg)
    pg.wait_for_function("() => document.getElementById('model').textContent.startsWith('smol')")
    pg.fill("#temperature", "0")
    pg.fill("#max-tokens", str(max_tokens))
    return pg


def chat(pg, text: str):
    pg.fill("#prompt", text)
    pg.press("#prompt", "Enter")


# -- the chat page ------------------------------------------------------------------------------

def test_chat_streams_the_apis_greedy_answer_and_renders_markup_as_text(server, page):
    pg = open_chat(page, server, max_tokens=48)
    pg.fill("#system", "You are a terse assistant.")
    # every change of the answer's text, as it happens: streamed means several, not one at the end
    pg.evaluate("""() => { window.lengths = [];
        new MutationObserver(() => { const c = document.querySelector('.msg.assistant .content');
            if (c) window.lengths.push(c.textContent.length); })
        .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }""")
    prompt = 'Say hello. <script>window.pwned = 1</script><img src="x" onerror="window.pwned = 2"> <b>bold</b>'
    chat(pg, prompt)
    pg.wait_for_selector(".msg.assistant[data-state=done]", timeout=60000)
    answer = pg.text_content(".msg.assistant .content")
    lengths = pg.evaluate("window.lengths")
    assert len(set(lengths) - {0}) >= 3, f"the answer arrived in one piece, not streamed: {lengths}"

    # the API's own greedy answer to the same conversation
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.auth, timeout=60, json={
        "model": "smol", "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": prompt}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert answer == body["choices"][0]["message"]["content"]
    stats = pg.text_content(".msg.assistant .stats")
    assert f"{body['usage']['completion_tokens']} tokens" in stats and "TTFT" in stats and "tok/s" in stats

    # the markup is the message's text: nothing ran, no element was made from it
    assert pg.evaluate("window.pwned") is None
    assert pg.text_content(".msg.user .content") == prompt
    assert pg.evaluate("document.querySelectorAll('#messages script, #messages img, #messages b').length") == 0
    assert not page.errors, page.errors


def test_stop_aborts_the_request_and_frees_its_blocks(server, page):
    pg = open_chat(page, server, max_tokens=1500)
    aborted_before = metric(server, "inferd:request_success_total", finished_reason="abort")
    chat(pg, "Count from 1 to 1000, one number a line.")
    pg.wait_for_function("() => { const m = document.querySelector('.msg.assistant[data-state=streaming] .content');"
                         " return m && m.textContent.length > 30; }", timeout=60000)
    running = state(server)["engines"][0]
    assert running["num_running"] == 1 and running["kv"]["used_blocks"] > 0
    req_id = running["running"][0]["id"]
    pg.click("#stop")
    pg.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=10000)
    shown = len(pg.text_content(".msg.assistant .content"))

    deadline = time.monotonic() + 20
    while True:  # the server notices the closed connection, then the engine aborts at its next step
        st = state(server)["engines"][0]
        done = [r for r in st["finished"]["rows"] if r[1] == req_id]
        if done and st["num_running"] == 0:
            break
        assert time.monotonic() < deadline, f"request {req_id} was not aborted: {st['running']}"
        time.sleep(0.1)
    fields = st["finished"]["fields"]
    row = dict(zip(fields, done[0]))
    assert row["finish_reason"] == "abort"
    assert row["output_tokens"] < 1500 and shown > 0
    assert st["kv"]["used_blocks"] == 0 and "u" not in st["kv"]["map"] and "s" not in st["kv"]["map"]
    assert metric(server, "inferd:request_success_total", finished_reason="abort") == aborted_before + 1
    assert not page.errors, page.errors


# -- the dashboard ------------------------------------------------------------------------------

def test_dashboard_under_load_matches_the_state_endpoint(server, page):
    pg = page
    # under load: the bench client, 32 requests 8 at a time, in the background
    bench = subprocess.Popen(
        [sys.executable, "-m", "inferd", "bench", "--base-url", server.base, "--api-key", KEY, "--dataset", "random",
         "--input-len", "96", "--output-len", "48", "--num-prompts", "32", "--max-concurrency", "8",
         "--extra-body", '{"ignore_eos": true}', "--seed", "1", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        pg.goto(server.base + "/dashboard")
        give_key(pg)
        pg.wait_for_selector("#status[data-state=live]", timeout=20000)
        # a moment with a batch on screen: >1 running, and both prefill and decode bars in the chart
        pg.wait_for_function("""() => { const s = document.querySelector('section.engine[data-engine="0"]');
            if (!s) return false;
            const c = s.querySelector('.step-chart');
            return +s.querySelector('.running').textContent > 1 && +c.dataset.prefillBars > 0
                   && +c.dataset.decodeBars > 0; }""", timeout=60000)
        pg.click("#pause")  # freeze the page on that moment: what it shows is one state
        pg.wait_for_selector("#status[data-state=paused]")
        shown = pg.evaluate("""() => { const s = document.querySelector('section.engine[data-engine="0"]');
            const c = s.querySelector('.step-chart');
            return {step: +s.dataset.step, used: +s.querySelector('canvas.kv-map').dataset.used,
                    mapStep: +s.querySelector('canvas.kv-map').dataset.step,
                    running: +s.querySelector('.running').textContent,
                    tile: s.querySelector('.kv-used-tile').textContent,
                    prefill: +c.dataset.prefillBars, decode: +c.dataset.decodeBars,
                    rows: s.querySelectorAll('table.requests tbody tr').length}; }""")
        os.makedirs(ARTEFACTS, exist_ok=True)
        shot = os.path.join(ARTEFACTS, "dashboard.png")
        pg.screenshot(path=shot, full_page=True)
    finally:
        out, _ = bench.communicate(timeout=180)
    assert bench.returncode == 0, out.decode()[-3000:]
    assert shown["running"] > 1 and shown["prefill"] > 0 and shown["decode"] > 0
    assert shown["mapStep"] == shown["step"] and shown["rows"] >= shown["running"]
    # the same step's state, as the endpoint kept it
    doc = state(server, engine=0, step=shown["step"])
    st = doc["engines"][0]
    assert st["step"] == shown["step"]
    assert st["kv"]["used_blocks"] == shown["used"] > 0
    assert shown["tile"].startswith(f"{shown['used']} / {st['kv']['num_blocks']}")
    assert st["num_running"] == shown["running"]
    assert os.path.getsize(shot) > 10_000
    # the load's requests reached the latency panel
    pg.click("#pause")
    pg.wait_for_function("""() => document.querySelector('.dist-title[data-metric="ttft"]').textContent
                            .includes('of the last')""", timeout=20000)
    assert not page.errors, page.errors


def test_api_key_gates_the_data_not_the_pages(server, page):
    base = server.base
    for path in ("/", "/dashboard", "/static/dashboard.js", "/static/theme.css"):
        r = httpx.get(base + path, timeout=10)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert r.headers["x-content-type-options"] == "nosniff"
    for path in ("/v1/engine/state", "/v1/engine/state/stream", "/v1/models"):
        r = httpx.get(base + path, timeout=10)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/static/..%2Fapp.py", "/static/%2E%2E%2Fweb.py", "/static/web.py", "/static/nope.js"):
        assert httpx.get(base + path, timeout=10).status_code == 404, path  # only the page files, nothing else

    pg = page
    pg.goto(base + "/dashboard")
    pg.wait_for_selector("#key-box:not([hidden])")
    assert pg.get_attribute("#status", "data-state") == "auth"
    assert pg.evaluate("document.querySelectorAll('section.engine').length") == 0  # nothing shown without the key
    pg.fill("#key-input", "sk-wrong")
    pg.click("#key-form button")
    pg.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
    assert pg.evaluate("document.querySelectorAll('section.engine').length") == 0
    pg.fill("#key-input", KEY)
    pg.click("#key-form button")
    pg.wait_for_selector("#status[data-state=live]")
    pg.wait_for_selector('section.engine[data-engine="0"][data-step]')
    assert not page.errors, page.errors


def test_state_stream_sends_only_new_rows(server):
    with httpx.stream("GET", server.base + "/v1/engine/state/stream", params={"interval": 0.1}, headers=server.auth,
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        docs = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                docs.append(json.loads(line[5:]))
            if len(docs) == 3:
                break
    first, later = docs[0]["engines"][0], docs[2]["engines"][0]
    assert first["steps"]["rows"], "earlier tests ran steps: the first event carries them"
    assert later["steps"]["rows"] == [] and later["finished"]["rows"] == []  # idle: nothing new
    assert later["step"] == first["step"] and later["kv"]["map"] == first["kv"]["map"]
    r = httpx.get(server.base + "/v1/engine/state", params={"engine": 0, "step": 10**9}, headers=server.auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "step"
    r = httpx.get(server.base + "/v1/engine/state", params={"engine": 5}, headers=server.auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "engine"


def test_the_router_serves_the_dashboard_of_its_backends(server, page):
    """`inferd router` in front: the same pages, and the state of every backend's engines (here one
    server, and one backend that is down), the API key passed through to the backend."""
    dead = f"http://127.0.0.1:{conftest.free_port()}"
    router = conftest.ServerProc(["--backend", server.base, "--backend", dead, "--health-interval", "0.5"],
                                 command="router")
    try:
        router.wait_ready()
        assert httpx.get(router.base + "/v1/engine/state", timeout=10).status_code == 401  # the backend's answer
        doc = httpx.get(router.base + "/v1/engine/state", headers=server.auth, timeout=10).json()
        assert [(e["engine"], e["backend"]) for e in doc["engines"]] == [(0, server.base), (1, dead)]
        assert "kv" in doc["engines"][0] and doc["engines"][1]["dead"].startswith("unreachable")
        page_ = httpx.get(router.base + "/dashboard", timeout=10)
        assert page_.status_code == 200 and page_.headers["content-security-policy"].startswith("default-src 'self'")
        pg = page
        pg.goto(router.base + "/dashboard")
        give_key(pg)
        pg.wait_for_selector("#status[data-state=live]")
        pg.wait_for_selector('section.engine[data-engine="0"][data-step]')
        pg.wait_for_selector('section.engine.dead[data-engine="1"]')
        assert server.base in pg.text_content('section.engine[data-engine="0"] .engine-title')
        assert not page.errors, page.errors
        # SIGTERM with the dashboard still open: its stream ends, so the router exits (it waited forever)
        router.proc.terminate()
        assert router.proc.wait(15) == 0
    finally:
        router.stop()

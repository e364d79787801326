"""Several models behind one `inferd serve` (inferd.server.models): picked by the request's `model`,
loaded on their first request, unloaded after their keep-alive or to make room, and the operator's
load/unload routes. Real servers on 127.0.0.1, real engine processes, the official `openai` client."""
from __future__ import annotations

import os
import shutil
import threading

import httpx
import openai
import pytest
from conftest import ServerProc
from helpers import wait_until

from inferd.server.models import process_rss

HTTP_TIMEOUT = 120
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, tiny_chat_gguf):
    """Two tiny chat GGUFs with SmolLM2's tokenizer: one file under two names (two engines all the
    same: what these tests count is loads, unloads and answers, not which weights answer)."""
    d = tmp_path_factory.mktemp("models")
    a, b = str(d / "tiny-a.gguf"), str(d / "tiny-b.gguf")
    shutil.copyfile(tiny_chat_gguf, a)
    shutil.copyfile(tiny_chat_gguf, b)
    return a, b


def client(srv, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=key, timeout=HTTP_TIMEOUT, max_retries=0)


def complete(srv, model: str, max_tokens: int = 12, key: str = "x") -> str:
    r = client(srv, key).completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert r.model == model
    return r.choices[0].text


def cards(srv, key: str | None = None) -> dict[str, dict]:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    data = httpx.get(srv.base + "/v1/models", headers=h, timeout=10).json()["data"]
    return {c["id"]: c for c in data}


def status(srv, name: str, key: str | None = None) -> str:
    return cards(srv, key)[name]["status"]["value"]


def engine_pids(srv, key: str | None = None) -> dict[str, int]:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    st = httpx.get(srv.base + "/v1/engine/state", params={"steps": 0}, headers=h, timeout=10).json()
    return {e["model"]: e["pid"] for e in st["engines"]}


def pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and ("Z" in line.split()[1]) for line in f)
    except FileNotFoundError:
        return True


def metric(srv, name: str, **labels) -> float:
    text = httpx.get(srv.base + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def serve(args, **kw) -> ServerProc:
    return ServerProc([*args, "--kv-cache-memory", "64MiB", "--threads", "1"], **kw).wait_ready()


def test_two_models_answer_as_each_served_alone(tiny_pair):
    """The default SmolLM2 and a tiny model in one server: each answers by `model` what it answers
    served alone; the tiny one loads on its first request, the default is preloaded by the flag."""
    tiny = tiny_pair[0]
    alone = {}
    for name, args in (("smollm2-135m", []), ("tiny", ["--model", tiny, "--served-model-name", "tiny"])):
        srv = serve(args)
        try:
            alone[name] = complete(srv, name)
        finally:
            srv.stop()
    srv = serve(["--model", "default", "--model", f"tiny={tiny}"])
    try:
        assert {n: c["status"]["value"] for n, c in cards(srv).items()} == {"default": "unloaded", "tiny": "unloaded"}
        assert complete(srv, "tiny") == alone["tiny"]
        assert status(srv, "tiny") == "loaded" and status(srv, "default") == "unloaded"
        assert complete(srv, "default") == alone["smollm2-135m"]
        assert complete(srv, "tiny") == alone["tiny"]  # both loaded now: each still its own
        chat = client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0)
        assert chat.model == "tiny"
        pids = engine_pids(srv)
        assert set(pids) == {"default", "tiny"} and pids["default"] != pids["tiny"]  # a process each
        assert metric(srv, "inferd:generation_tokens_total", model_name="tiny") > 0
        assert metric(srv, "inferd:generation_tokens_total", model_name="default") > 0
        assert metric(srv, "inferd:model_loaded", model_name="tiny") == 1
    finally:
        srv.stop()


def test_keep_alive_unloads_an_idle_model_and_frees_its_memory(tiny_pair):
    a, b = tiny_pair
    srv = serve(["--model", f"a={a}", "--model", f"b={b}", "--keep-alive", "1"])
    try:
        complete(srv, "a")  # one round first: what the API process keeps for good (imports, pools)
        wait_until(lambda: status(srv, "a") == "unloaded", 60, "model a unloaded after its keep-alive")
        before = process_rss(srv.proc.pid)
        complete(srv, "b")
        pid = engine_pids(srv)["b"]
        assert process_rss(pid) > 0
        wait_until(lambda: status(srv, "b") == "unloaded", 60, "model b unloaded after its keep-alive")
        wait_until(lambda: pid_gone(pid), 30, "model b's engine process gone")
        after = process_rss(srv.proc.pid)
        assert abs(after - before) <= 0.05 * before, (before, after)
        assert metric(srv, "inferd:model_unloads_total", model_name="b", reason="keep_alive") == 1
        assert complete(srv, "b")  # and it loads again
    finally:
        srv.stop()


def test_one_loaded_model_and_eight_clients_lose_nothing(tiny_pair):
    """--max-loaded-models 1, 8 clients alternating between two models: every request gets its
    answer or a 503 with Retry-After; none hangs, none is lost; the models took turns."""
    a, b = tiny_pair
    srv = serve(["--model", f"a={a}", "--model", f"b={b}", "--max-loaded-models", "1"])
    per_client, results, lock = 4, [], threading.Lock()

    def run(i):
        with httpx.Client(base_url=srv.base, timeout=HTTP_TIMEOUT) as c:
            for j in range(per_client):
                model = "ab"[(i + j) % 2]
                r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                    "temperature": 0})
                with lock:
                    results.append((model, r.status_code, r.headers.get("retry-after"), r.json()))

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HTTP_TIMEOUT * per_client)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(results) == 8 * per_client
        ok = [m for m, code, _, _ in results if code == 200]
        refused = [(code, ra, body) for _, code, ra, body in results if code != 200]
        assert all(code == 503 and ra and body["error"]["code"] == "models_busy" for code, ra, body in refused), refused
        assert {"a", "b"} <= set(ok)
        assert all(body["model"] == m and body["choices"][0]["text"] for m, code, _, body in results if code == 200)
        loaded = [c["status"]["value"] for c in cards(srv).values()]
        assert loaded.count("loaded") <= 1
        assert metric(srv, "inferd:model_unloads_total", reason="evicted") >= 1
    finally:
        srv.stop()


def test_load_unload_routes_and_faults(tiny_pair, tmp_path):
    """The operator's routes behind --api-key; unknown names are 404s naming the models; a model that
    cannot load fails its request clearly and the server serves the others; an unload with a
    request in flight waits for it or refuses (409), never drops it."""
    a, _ = tiny_pair
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    key = "sekret"
    srv = serve(["--model", "a=default", "--model", f"tiny={a}", "--model", f"broken={broken}"], api_key=key)
    h = {"Authorization": f"Bearer {key}"}
    try:
        assert httpx.post(srv.base + "/models/load", json={"model": "a"}).status_code == 401
        r = httpx.post(srv.base + "/models/load", json={"model": "a"}, headers=h, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200 and r.json()["status"]["value"] == "loaded" and r.json()["load_seconds"] > 0
        pid = engine_pids(srv, key)["a"]

        r = httpx.post(srv.base + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=h)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "a" in r.json()["error"]["message"] and "broken" in r.json()["error"]["message"]
        assert httpx.post(srv.base + "/models/unload", json={"model": "nope"}, headers=h).status_code == 404

        with pytest.raises(openai.InternalServerError) as err:
            complete(srv, "broken", key=key)
        assert err.value.status_code == 500 and "failed to load" in err.value.message
        card = cards(srv, key)["broken"]["status"]
        assert card["value"] == "unloaded" and card["failed"] and card["error"]
        assert complete(srv, "tiny", key=key)  # the others are served

        # an unload while a stream is open: refused past wait_s, else it waits for the stream's end
        done = {}

        def stream():
            with httpx.Client(timeout=HTTP_TIMEOUT) as c, c.stream(
                    "POST", srv.base + "/v1/completions", headers=h,
                    json={"model": "a", "prompt": PROMPT, "max_tokens": 300, "stream": True,
                          "ignore_eos": True}) as resp:
                done["events"] = [line for line in resp.iter_lines() if line.startswith("data: ")]

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: metric(srv, "inferd:num_requests_running", model_name="a") >= 1, 30, "the stream running")
        r = httpx.post(srv.base + "/models/unload", json={"model": "a", "wait_s": 0}, headers=h, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
        r = httpx.post(srv.base + "/models/unload", json={"model": "a"}, headers=h, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200 and r.json()["status"]["value"] == "unloaded"
        t.join(HTTP_TIMEOUT)
        assert done["events"][-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in done["events"][-2] or '"finish_reason":"length"' in done["events"][-2]
        wait_until(lambda: pid_gone(pid), 30, "the engine process gone")
        assert metric(srv, "inferd:model_unloads_total", model_name="a", reason="api") == 1
    finally:
        srv.stop()


def test_models_file_gives_each_model_its_own_engine_options(tiny_pair, tmp_path):
    """The YAML config's models: list: per-model engine options, preload, a name."""
    a, b = tiny_pair
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - name: first\n    model: {a}\n    num_kv_blocks: 37\n    preload: true\n"
                   f"  - name: second\n    model: {b}\n    num-kv-blocks: 41\n    quantization: none\n"
                   f"    dtype: float32\n")
    srv = serve(["--config", str(cfg)])
    try:
        assert status(srv, "first") == "loaded" and status(srv, "second") == "unloaded"
        assert complete(srv, "second")
        assert metric(srv, "inferd:cache_config_info", model_name="first", num_gpu_blocks="37") == 1
        assert metric(srv, "inferd:cache_config_info", model_name="second", num_gpu_blocks="41") == 1
        assert cards(srv)["first"]["aliases"] == [os.path.basename(a)]
    finally:
        srv.stop()


def test_bad_models_configuration_is_one_line(tmp_path, tiny_pair):
    import subprocess
    import sys

    a, _ = tiny_pair
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"models:\n  - model: {a}\n    warp_speed: 9\n")
    r = subprocess.run([sys.executable, "-m", "inferd", "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown option 'warp_speed'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    from inferd.cli import build_parser
    from inferd.errors import InferdError
    from inferd.server.serve import model_specs

    for args, want in ((["--model", f"x={a}", "--model", f"x={a}"], "two models are named 'x'"),
                       (["--model", a, "--model", a, "--served-model-name", "y"], "--served-model-name names one")):
        with pytest.raises(InferdError, match=want):  # what the command prints as its one line
            model_specs(build_parser().parse_args(["serve", *args]))


def test_a_memory_budget_unloads_the_least_recently_used_idle_model(tiny_pair):
    """--models-memory-budget: loading past it unloads the least recently used idle model first (a
    1-byte budget leaves room for one model at a time: the first always loads)."""
    a, b = tiny_pair
    srv = serve(["--model", f"a={a}", "--model", f"b={b}", "--models-memory-budget", "1"])
    try:
        complete(srv, "a")
        complete(srv, "b")
        assert status(srv, "a") == "unloaded" and status(srv, "b") == "loaded"
        complete(srv, "a")
        assert status(srv, "b") == "unloaded"
        assert metric(srv, "inferd:model_unloads_total", reason="evicted") == 2
    finally:
        srv.stop()

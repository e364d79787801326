"""`inferd serve --data-parallel-size 2` (inferd.distributed.data_parallel): two engine processes, each
pinned to its own core, both serving (their own step counters in /metrics), the vLLM metric names
a Kubernetes router reads with the same values as inferd's, one engine's death ending its requests
only while the other's finish, and -- on the real model in fp32 -- the reference loop's tokens."""
import json
import re
import threading
import time

import httpx
import pytest

import conftest
from conftest import ServerProc
from helpers import compare_texts, engine_socket_dirs, wait_until


def samples(text: str) -> dict[tuple, float]:
    """{(name, frozenset of label pairs): value}: label order is the exposition's business."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def series(m: dict, name: str, **labels) -> dict[frozenset, float]:
    want = {(k, str(v)) for k, v in labels.items()}
    return {lab: v for (n, lab), v in m.items() if n == name and want <= lab}


def engine_pids(srv: ServerProc) -> dict[int, tuple[int, str]]:
    found = {}
    for _ in range(100):
        found = {int(e): (int(p), cores) for e, p, cores in
                 re.findall(r"engine (\d+): process (\d+) on cores (\[[^\]]*\])", srv.log_text(100_000))}
        if len(found) == 2:
            return found
        time.sleep(0.1)
    raise AssertionError("no engine pids in the log:\n" + srv.log_text())


@pytest.fixture(scope="module")
def tiny(tiny_chat_gguf):
    gguf = tiny_chat_gguf
    srv = ServerProc(["--model", gguf, "--data-parallel-size", "2", "--max-model-len", "2048",
                      "--kv-cache-memory", "64MiB"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def stream(base: str, prompt: str, max_tokens: int, out: list):
    """Appends its events list to `out` at once and fills it as they arrive (a test can see the
    stream under way)."""
    events = []
    out.append(events)
    try:
        with httpx.stream("POST", base + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                                "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append(repr(e))


def test_both_engines_serve_pinned_apart_with_vllm_metric_names(tiny):
    pids = engine_pids(tiny)
    affinity = {}
    for e, (pid, _) in pids.items():
        with open(f"/proc/{pid}/status") as f:
            affinity[e] = re.search(r"Cpus_allowed_list:\s*(\S+)", f.read()).group(1)
    if len(conftest.os.sched_getaffinity(0)) >= 2:
        assert affinity[0] != affinity[1], affinity
    assert len(engine_socket_dirs(tiny.proc.pid)) == 2  # a private directory for each engine's sockets
    outs: list = []
    ts = [threading.Thread(target=stream, args=(tiny.base, f"request {i}: " + "word " * (20 + i), 24, outs))
          for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(o[-1] == "[DONE]" for o in outs)
    m = samples(httpx.get(tiny.base + "/metrics", timeout=10).text)
    steps = [sum(series(m, "inferd:engine_steps_total", engine=e).values()) for e in (0, 1)]
    assert steps[0] > 0 and steps[1] > 0, steps
    # the vLLM names carry inferd's values, label for label
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum"):
        ours, theirs = series(m, f"inferd:{name}"), series(m, f"vllm:{name}")
        assert ours and ours == theirs, name
        assert {("engine", "0"), ("engine", "1")} <= {p for lab in ours for p in lab}, name
    info = series(m, "vllm:cache_config_info")
    assert len(info) == 2 and all(("block_size", "16") in lab for lab in info), info
    # the dashboard's state crosses both process boundaries: each engine answers for itself
    st = httpx.get(tiny.base + "/v1/engine/state", timeout=10).json()["engines"]
    assert [e["engine"] for e in st] == [0, 1]
    assert {e["pid"] for e in st} == {pid for pid, _ in pids.values()}
    assert [e["step"] for e in st] == steps  # the same step counts /metrics shows, engine by engine
    assert all(e["finished"]["rows"] and e["kv"]["used_blocks"] == 0 for e in st)
    assert sum(len(e["finished"]["rows"]) for e in st) == 8


def test_one_engine_dying_fails_its_requests_the_other_finishes_then_exit(tiny):
    srv = tiny  # the last test of this server: it ends it
    try:
        pids = engine_pids(srv)
        outs: list = []
        # two new prefixes on an idle server: one to each engine
        ts = [threading.Thread(target=stream, args=(srv.base, f"long {i}", 1500, outs)) for i in range(2)]
        for t in ts:
            t.start()

        def both_streaming():
            m = samples(httpx.get(srv.base + "/metrics", timeout=10).text)
            running = [sum(series(m, "inferd:num_requests_running", engine=e).values()) for e in (0, 1)]
            return len(outs) == 2 and all(outs) and running == [1, 1]
        wait_until(both_streaming, 120, "a stream under way on each engine")
        conftest.os.kill(pids[1][0], 9)
        r = None
        for _ in range(100):  # new requests are refused once the fault is seen
            try:
                r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            except httpx.TimeoutException:
                raise AssertionError("a request hung after the engine died:\n" + srv.log_text()) from None
            if r.status_code == 503:
                break
            time.sleep(0.1)
        assert r.status_code == 503 and "error" in r.json()
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 503
        for t in ts:
            t.join(120)
        failed = [o for o in outs if any(isinstance(e, dict) and "error" in e for e in o)]
        finished = [o for o in outs if any(isinstance(e, dict) and e.get("choices") and
                                           e["choices"][0].get("finish_reason") == "length" for e in o)]
        assert len(failed) == 1 and len(finished) == 1, outs
        assert srv.proc.wait(60) == 3
        assert engine_socket_dirs(srv.proc.pid) == []  # both engines' socket directories, the dead one's too
    finally:
        srv.stop()


# -- the real model -------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are", "Water boils at a temperature of", "My favourite book is"]


@pytest.mark.slow
def test_dp2_greedy_fp32_equals_the_reference_loop():
    from inferd.engine.reference import reference_generate
    from inferd.loading.loader import load_model

    srv = ServerProc(["--quantization", "none", "--dtype", "float32", "--data-parallel-size", "2", "--kv-cache-memory", "64MiB"])
    try:
        loaded = load_model(None, dtype="float32")
        tok = loaded.tokenizer
        refs = [reference_generate(loaded.model, tok.encode(p), 12, keep_logits=True) for p in PROMPTS]
        srv.wait_ready()
        outs: dict = {}

        def one(i):
            r = httpx.post(srv.base + "/v1/completions", timeout=120,
                           json={"prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            outs[i] = r.json()["choices"][0]["text"]
        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        compare_texts(outs, [(r.token_ids, r.logits) for r in refs], tok, max_ties=1)
        m = samples(httpx.get(srv.base + "/metrics", timeout=10).text)
        served = [sum(series(m, "inferd:request_success_total", engine=e).values()) for e in (0, 1)]
        assert all(s > 0 for s in served), served  # both engines answered some of them
    finally:
        srv.stop()

"""`inferd serve` with the engine core in its own process (inferd.engine.core), the default.

The whole server suite (tests/test_server.py) runs against this mode; here: the process really is
separate (its own pid, and the API process never loads the weights), a client disconnect crosses
the boundary and frees the request's KV blocks, and an engine that dies mid-stream is a fault the
server reports and exits on -- /health 503, the open stream ends with an error event, new requests
get a 503 error body, the server exits non-zero within a bounded time."""
import json
import os
import re
import time

import httpx
import pytest

import conftest
from helpers import stream_then_kill

ARGS = ["--dtype", "float32", "--host", "127.0.0.1", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4"]


def core_pid(srv) -> int:
    for _ in range(100):
        m = re.search(r"engine core: process (\d+)", srv.log_text(100_000))
        if m:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError("no engine core pid in the server log:\n" + srv.log_text())


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = conftest.ServerProc(ARGS, log_path=tmp_path_factory.mktemp("core") / "serve.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_the_engine_runs_in_another_process(server):
    pid = core_pid(server)
    assert pid != server.proc.pid and os.path.exists(f"/proc/{pid}")
    with open(f"/proc/{pid}/status") as f:
        assert f"PPid:\t{server.proc.pid}" in f.read()  # the server's own child, spawned
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                          "temperature": 0}, timeout=120)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]


def test_disconnect_frees_blocks_through_the_boundary(server):
    body = {"prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as r:
        got = 0
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    # read while the stream is still held: leaving the loop closes the generator and
                    # with it the connection, and the server's abort could win the race
                    m = httpx.get(server.base + "/metrics").text
                    assert metric(m, "inferd:kv_cache_usage_perc") > 0  # it was really running when the client left
                    break
    for _ in range(200):
        m = httpx.get(server.base + "/metrics").text
        if metric(m, "inferd:num_requests_running") == 0 and metric(m, "inferd:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.05)
    assert metric(m, "inferd:num_requests_running") == 0
    assert metric(m, "inferd:kv_cache_usage_perc") == 0, "KV blocks still held after the client left"


def test_killed_engine_is_a_fault_the_server_exits_on(tmp_path):
    srv = conftest.ServerProc(ARGS, log_path=tmp_path / "serve.log")
    try:
        srv.wait_ready()
        pid = core_pid(srv)
        body = {"prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = stream_then_kill(srv.base, body, pid)
        # the stream ended, cleanly: an error event, then [DONE]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert "error" in err and "engine" in err["error"]["message"], events[-3:]
        h = httpx.get(srv.base + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "error"
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        srv.proc.wait(30)  # bounded: the server exits by itself
        assert srv.proc.returncode == 3
        assert "Traceback" not in srv.log_text(100_000)
    finally:
        srv.stop()


def test_engine_in_process_mode_serves_the_same_tokens(server, tmp_path):
    """--engine-in-process (the engine on a thread of the server) stays available and gives the
    process mode's greedy tokens."""
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    want = httpx.post(server.base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    srv = conftest.ServerProc([*ARGS, "--engine-in-process"], log_path=tmp_path / "serve.log")
    try:
        srv.wait_ready()
        assert "engine core: process" not in srv.log_text(100_000)
        got = httpx.post(srv.base + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert got == want
        # the dashboard's state comes from the engine thread: this process, one finished request
        st = httpx.get(srv.base + "/v1/engine/state", timeout=10).json()["engines"]
        assert len(st) == 1 and st[0]["pid"] == srv.proc.pid and len(st[0]["finished"]["rows"]) == 1
        assert st[0]["steps"]["rows"][-1][0] == st[0]["step"] > 0
    finally:
        srv.stop()

"""`inferd serve` with the engine core in its own process (inferd.engine.core), the default.

The whole server suite (tests/test_server.py) runs against this mode; here: the process really is
separate (its own pid, and the API process never loads the weights), a client disconnect crosses
the boundary and frees the request's KV blocks, and an engine that dies mid-stream is a fault the
server reports and exits on -- /health 503, the open stream ends with an error event, new requests
get a 503 error body, the server exits non-zero within a bounded time. The two unix sockets between
the processes live in a private directory that no kind of exit leaves behind."""
import json
import os
import re
import time

import httpx
import pytest

import conftest
from helpers import engine_socket_dirs, stream_then_kill

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
        assert engine_socket_dirs(srv.proc.pid) == []  # os._exit skips atexit: removed before it
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


# -- the engine's sockets: a private directory, gone at every exit ----------------------------------

def _gone(pid: int) -> bool:
    """pid runs no more (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_no_engine_socket_outlives_its_server(tiny_chat_gguf, tmp_path):
    """Counted in a private TMPDIR (the servers' only one): a SIGINT, a SIGKILL, a failed start and a
    SIGTERM while the model loads. What the killed server left, the next start sweeps; at the end
    the directory is empty. (SIGTERM of a serving server and the fault exit: test_hardening's drain
    tests and test_killed_engine_is_a_fault_the_server_exits_on.)"""
    import signal
    import shutil
    import tempfile

    from helpers import wait_until

    tmp = tempfile.mkdtemp(prefix="serve-exits-")  # short: a unix socket's path holds 107 bytes
    env = {"TMPDIR": tmp}
    args = ["--model", tiny_chat_gguf, "--threads", "1", "--max-model-len", "64", "--kv-cache-memory", "16MiB"]
    procs = [conftest.ServerProc(args, env=env), conftest.ServerProc(args, env=env)]  # their starts overlap
    try:
        stopped = procs[0].wait_ready()
        assert len(engine_socket_dirs(stopped.proc.pid, tmp)) == 1
        stopped.proc.send_signal(signal.SIGINT)
        assert stopped.proc.wait(60) == 0
        assert engine_socket_dirs(stopped.proc.pid, tmp) == []

        killed = procs[1].wait_ready()
        core = core_pid(killed)
        killed.proc.kill()
        killed.proc.wait(30)
        left = engine_socket_dirs(killed.proc.pid, tmp)
        assert len(left) == 1 and sorted(os.listdir(os.path.join(tmp, left[0]))) == ["in", "out"]
        wait_until(lambda: _gone(core), 60, "the killed server's engine core to notice and exit")

        cut = tmp_path / "cut.gguf"  # a failed start: the engine process cannot read the file
        cut.write_bytes(open(tiny_chat_gguf, "rb").read(200_000))
        failed = conftest.ServerProc(["--model", str(cut), "--threads", "1"], env=env)
        procs.append(failed)
        assert failed.proc.wait(120) == 2
        log = failed.log_text()
        assert f"removed 1 temporary socket/rendezvous entry left in {tmp} by exited processes " \
               f"(pids {killed.proc.pid})" in log, log
        assert "invalid GGUF file" in log and os.listdir(tmp) == []

        loading = conftest.ServerProc(args, env=env)
        procs.append(loading)
        deadline = time.monotonic() + 120
        while not engine_socket_dirs(loading.proc.pid, tmp) and loading.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine_socket_dirs(loading.proc.pid, tmp), loading.log_text()
        loading.proc.send_signal(signal.SIGTERM)  # the engine process is loading the model
        assert loading.proc.wait(60) == 143, loading.log_text()
        assert "while loading: stopping" in loading.log_text()
        assert os.listdir(tmp) == []
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_sweep_removes_only_what_dead_processes_left(tmp_path):
    import socket
    import subprocess
    import sys

    from inferd.distributed import tmpdirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process (until reused, which the next lines would show)
    assert not os.path.exists(f"/proc/{dead.pid}")
    mine, alive = os.getpid(), os.getppid()
    for name in (f"inferd-core-{dead.pid}-a1", f"inferd-tp-{dead.pid}-b2", f"inferd-core-{alive}-c3",
                 f"inferd-core-{mine}-d4", f"inferd-coreX-{dead.pid}-e5", "inferd-core-x-f6"):
        (tmp_path / name).mkdir()
    (tmp_path / f"inferd-core-{dead.pid}-a1" / "in").write_bytes(b"")
    legacy = socket.socket(socket.AF_UNIX)  # the loose socket files of earlier versions
    legacy.bind(str(tmp_path / f"inferd-core-{dead.pid}-0123abcd-in"))
    legacy.close()
    (tmp_path / f"inferd-core-{dead.pid}-notes.txt").write_text("a file, not a socket: not ours")
    removed = tmpdirs.sweep(str(tmp_path))
    assert sorted(removed) == sorted([f"inferd-core-{dead.pid}-a1", f"inferd-tp-{dead.pid}-b2",
                                      f"inferd-core-{dead.pid}-0123abcd-in"])
    assert sorted(os.listdir(tmp_path)) == sorted([f"inferd-core-{alive}-c3", f"inferd-core-{mine}-d4",
                                                   f"inferd-coreX-{dead.pid}-e5", "inferd-core-x-f6",
                                                   f"inferd-core-{dead.pid}-notes.txt"])


def test_a_private_directory_is_the_owners_alone_and_removed(monkeypatch, tmp_path):
    import stat

    from inferd.distributed import tmpdirs

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = tmpdirs.make("core")
    assert os.path.basename(path).startswith(f"inferd-core-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    tmpdirs.remove(path)
    tmpdirs.remove(path)  # twice: harmless
    other = tmpdirs.make("tp")
    tmpdirs.remove_all()  # what atexit and the server's fault exit call
    assert not os.path.exists(other) and os.listdir(tmp_path) == []

"""Shared plumbing of the serving benchmarks: start a server, wait for it, drive it with
`inferd bench`, stop it, print a comparison table.

Servers run in their own process group so that stopping one never touches anything else on the
machine; every server started here is stopped on the way out, even after an error or Ctrl-C.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.normpath(os.path.join(HERE, "..", "src"))


def inferd_env() -> dict:
    # Child processes must import this checkout's inferd, not whatever the venv has installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerDied(RuntimeError):
    """A server process ended on its own: before it was ready, or during the run."""

    def __init__(self, msg: str, returncode: int | None):
        super().__init__(msg)
        self.returncode = returncode


_running: dict[str, tuple[subprocess.Popen, str]] = {}  # base URL -> (process, log path), while up


def ensure_alive(base_url: str) -> None:
    """Raise ServerDied if the server at base_url (started by server()) has exited: a run against a
    server that died part-way is no row."""
    proc, log_path = _running[base_url]
    if proc.poll() is not None:
        raise ServerDied(f"server {base_url} exited with {proc.returncode} during the run; log: {log_path}\n"
                         + _tail(log_path), proc.returncode)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerDied(f"server exited with {proc.returncode} before it was ready; log: {log_path}\n"
                             + _tail(log_path), proc.returncode)
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # still loading (llama-server answers 503 while it loads the model)
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; log: {log_path}\n" + _tail(log_path))


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    # SIGTERM first: both servers shut down cleanly on it; SIGKILL only if one hangs.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def server(cmd: list[str], name: str, env: dict | None = None, ready_timeout: float = 300):
    """Run `cmd` (which must listen on the port given as --port) and yield its base URL."""
    port = int(cmd[cmd.index("--port") + 1])
    base_url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
    print(f"[{name}] {' '.join(cmd)}  (log: {log.name})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        t0 = time.monotonic()
        wait_ready(base_url, proc, ready_timeout, log.name)
        print(f"[{name}] ready in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        _running[base_url] = (proc, log.name)
        yield base_url
        ensure_alive(base_url)
    finally:
        _running.pop(base_url, None)
        _stop(proc)
        log.close()


def inferd_serve_cmd(*args: str, port: int) -> list[str]:
    return [sys.executable, "-m", "inferd", "serve", "--host", "127.0.0.1", "--port", str(port), *args]


def run_bench(base_url: str, *args: str, timeout: float = 1800) -> dict:
    """`inferd bench ... --result-json` against base_url; returns the result JSON."""
    with tempfile.TemporaryDirectory(prefix="inferd-bench-") as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "inferd", "bench", "--base-url", base_url, "--result-json", out, *args]
        print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
        # The bench's own report goes to stderr/stdout; keep it visible but out of the tables.
        proc = subprocess.run(cmd, env=inferd_env(), timeout=timeout, stdout=subprocess.PIPE, text=True)
        if proc.returncode not in (0, 3):
            raise RuntimeError(f"inferd bench exited with {proc.returncode}:\n{proc.stdout[-3000:]}")
        with open(out) as f:
            res = json.load(f)
    if res.get("failed"):
        print(f"[bench] WARNING: {res['failed']} requests failed: {res.get('failure_reasons')} "
              f"{res.get('errors', [])[:3]}", file=sys.stderr, flush=True)
    for w in res.get("warnings") or ():
        print(f"[bench] warning: {w}", file=sys.stderr, flush=True)
    # One line per run as it finishes: a long comparison shows its numbers before the last table.
    print("[bench] " + ", ".join(f"{label} {fmt(res.get(key), spec)}" for label, key, spec in METRICS),
          file=sys.stderr, flush=True)
    return res


# (label, result key, format): what every table shows.
METRICS = [
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.3f}"),
    ("mean TTFT ms", "mean_ttft_ms", "{:.0f}"),
    ("p99 TTFT ms", "p99_ttft_ms", "{:.0f}"),
    ("mean TPOT ms", "mean_tpot_ms", "{:.1f}"),
]


def fmt(v, spec: str) -> str:
    return "-" if v is None else spec.format(v)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [title,
             "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))),
             "-" * (sum(widths) + 2 * (len(widths) - 1))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    text = "\n".join(lines)
    print(text, flush=True)
    return text

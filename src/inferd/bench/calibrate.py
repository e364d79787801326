"""Calibrating the bench client against `inferd mock-server`: start the mock, read its send log,
and compare each request's client-side arrival times with the mock's actual send times.

Both processes time with `time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC, one clock for
the whole machine: a trace's `t0_perf_ns + event time` and the mock's `perf_ns` are directly
comparable when both run on the same host.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _boost():  # pragma: no cover - runs in the child
    try:
        os.nice(-10)  # timing runs should not wait behind other work on a shared machine (root only)
    except OSError:
        pass


def spawn_mock(ttft_ms: float, tpot_ms: float, output_len: int, tokens_per_chunk: int = 1,
               role_chunk: bool = False, log: str | None = None, boost: bool = True,
               timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start `inferd mock-server` on a free port; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "inferd", "mock-server", "--port", "0", "--ttft-ms", str(ttft_ms),
           "--tpot-ms", str(tpot_ms), "--output-len", str(output_len), "--tokens-per-chunk", str(tokens_per_chunk)]
    if role_chunk:
        cmd.append("--role-chunk")
    if log:
        cmd += ["--log", log]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_boost if boost else None)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if "listening on " not in line or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError(f"mock-server did not start: {line!r} {proc.stderr.read()[:500]!r}")
    url = line.split("listening on ", 1)[1].split()[0]
    return proc, url


def read_mock_log(path: str) -> dict[str, dict]:
    """{request id: {"request": {...}, "chunks": [...]}} from a mock-server --log file."""
    out: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            e = out.setdefault(d["id"], {"request": None, "chunks": []})
            if d.get("event") == "request":
                e["request"] = d
            else:
                e["chunks"].append(d)
    return out


def wait_for_log(path: str, ids: set[str], timeout: float = 10.0) -> dict[str, dict]:
    """The mock writes its log when idle: wait until every id in `ids` has its [DONE] logged."""
    deadline = time.monotonic() + timeout
    while True:
        log = read_mock_log(path) if os.path.exists(path) else {}
        if all(i in log and any(c["kind"] == "done" for c in log[i]["chunks"]) for i in ids):
            return log
        if time.monotonic() > deadline:
            missing = [i for i in ids if i not in log][:3]
            raise TimeoutError(f"mock log {path} lacks requests {missing}")
        time.sleep(0.05)


def compare(header: dict, requests: list[dict], log: dict[str, dict]) -> list[dict]:
    """Per request (ms): client arrival - mock send of the first and last content chunk, the mock's
    own lateness against its schedule, and the client's TTFT/E2EL next to the mock's."""
    t0 = header["t0_perf_ns"]
    rows = []
    for r in requests:
        if r.get("warmup") or not r.get("ok"):
            continue
        m = log[r["response_id"]]
        mc = [c for c in m["chunks"] if c["kind"] == "content"]
        cc = [e for e in r["events"] if e[1] == "content"]
        send = t0 + r["send_ns"]
        rows.append({
            "id": r["response_id"], "index": r["index"], "chunks_client": len(cc), "chunks_mock": len(mc),
            "tokens_client": [e[2] for e in cc], "tokens_mock": [c["tokens"] for c in mc],
            "ttft_client_ms": (t0 + cc[0][0] - send) / 1e6, "ttft_mock_ms": (mc[0]["perf_ns"] - send) / 1e6,
            "e2el_client_ms": (t0 + cc[-1][0] - send) / 1e6, "e2el_mock_ms": (mc[-1]["perf_ns"] - send) / 1e6,
            "first_delta_ms": (t0 + cc[0][0] - mc[0]["perf_ns"]) / 1e6,
            "last_delta_ms": (t0 + cc[-1][0] - mc[-1]["perf_ns"]) / 1e6,
            "chunk_delta_max_ms": max((t0 + a[0] - b["perf_ns"]) / 1e6 for a, b in zip(cc, mc)),
            "mock_late_max_ms": max((c["perf_ns"] - c["sched_ns"]) / 1e6 for c in mc),
            "request_to_mock_ms": (m["request"]["recv_ns"] - send) / 1e6,
        })
    return rows

"""A latency SLA as a test: TTFT < 500 ms and TPOT < 50 ms at p99, against a live server.

Marked `integration`: deselected by default, run with `make test-integration` (never by CI: timing
thresholds do not belong on shared machines). Point it at any OpenAI-compatible server with
INFERD_BENCH_URL=http://host:port (and INFERD_BENCH_MODEL if the name matters); without it the test
starts `inferd serve` on the default model. It measures one user at a time (INFERD_BENCH_CONCURRENCY
raises that). On the 2-core dev VM the default server does not reliably meet this SLA: p99 TPOT was
50-59 ms alone and 68 ms with two streams (p99 TTFT well under 500 ms) -- the test reports that.
"""
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port

pytestmark = pytest.mark.integration

SLA = "p99_ttft_ms<500,p99_tpot_ms<50"


@pytest.fixture(scope="module")
def endpoint():
    url = os.environ.get("INFERD_BENCH_URL")
    if url:
        yield url.rstrip("/")
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", str(port), "--max-num-seqs", "8",
                             "--kv-cache-memory", "256MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "inferd serve did not come up"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_latency_sla(endpoint, tmp_path):
    res_json = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "inferd", "bench", "--base-url", endpoint, "--dataset", "wikitext",
           "--input-len", "64", "--output-len", "32", "--num-prompts", "12",
           "--max-concurrency", os.environ.get("INFERD_BENCH_CONCURRENCY", "1"),
           "--warmup", "2", "--sla", SLA, "--result-json", str(res_json)]
    if os.environ.get("INFERD_BENCH_MODEL"):
        cmd += ["--model", os.environ["INFERD_BENCH_MODEL"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode in (0, 3), r.stderr  # 3: the SLA was violated; the asserts below say by how much
    res = json.loads(res_json.read_text())
    assert res["failed"] == 0
    assert res["p99_ttft_ms"] < 500, f"p99 TTFT {res['p99_ttft_ms']:.0f} ms"
    assert res["p99_tpot_ms"] < 50, f"p99 TPOT {res['p99_tpot_ms']:.1f} ms"
    assert r.returncode == 0

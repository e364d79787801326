"""`inferd bench` against `inferd serve` on the default model: concurrency 1, 8 and 32, every output
(console, JSON, CSV, trace), and `inferd bench report` reproducing the JSON exactly from the trace."""
import json
import subprocess
import sys

import pytest

IN, OUT = 32, 16


@pytest.fixture(scope="module")
def server(default_gguf_path):
    from conftest import running_server

    with running_server(["--model", "smollm2-135m", "--dtype", "float32", "--max-num-seqs", "32",
                         "--kv-cache-memory", "256MiB"]) as url:
        yield url


def bench(*args):
    return subprocess.run([sys.executable, "-m", "inferd", "bench", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("conc,n,endpoint,tokenizer", [
    (1, 4, "/v1/completions", None),
    (8, 16, "/v1/chat/completions", None),
    (32, 32, "/v1/completions", "server"),
])
@pytest.mark.slow
def test_bench_against_inferd_serve(server, tmp_path, conc, n, endpoint, tokenizer):
    trace, res_json, csv_path, res2 = (tmp_path / "t.jsonl", tmp_path / "r.json", tmp_path / "r.csv",
                                       tmp_path / "r2.json")
    args = ["--base-url", server, "--endpoint", endpoint, "--dataset", "random", "--input-len", str(IN),
            "--output-len", str(OUT), "--num-prompts", str(n), "--max-concurrency", str(conc),
            "--goodput", "ttft:60000", "tpot:5000", "--trace", str(trace), "--result-json", str(res_json),
            "--csv", str(csv_path)]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    r = bench(*args)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    assert "Serving Benchmark Result" in r.stdout and "Mean TTFT (ms):" in r.stdout
    res = json.loads(res_json.read_text())
    assert res["completed"] == n and res["failed"] == 0
    assert res["total_output_tokens"] == n * OUT and res["output_len_mismatch"] == 0
    assert res["output_tokens_source"] == {"usage": n}
    assert res["itl_per_token_available"]
    assert res["max_concurrent_requests"] == conc
    assert res["total_input_tokens"] == n * IN
    if endpoint == "/v1/completions":  # the prompts are exactly IN tokens under the server's own tokenizer
        assert res["total_input_tokens_server"] == n * IN
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert res[key] is not None and res[key] > 0
    assert len(csv_path.read_text().splitlines()) == n + 1
    lines = trace.read_text().splitlines()
    assert len(lines) == n + 2
    # per request: E2EL - TTFT is the sum of the ITLs
    for line in lines[1:-1]:
        q = json.loads(line)
        c = [e for e in q["events"] if e[1] == "content"]
        assert sum(e[2] for e in c) == OUT
    rr = bench("report", str(trace), "--result-json", str(res2))
    assert rr.returncode == 0, rr.stderr
    assert json.loads(res2.read_text()) == res
    assert rr.stdout == r.stdout


def crosscheck_run(server, tmp_path) -> tuple[subprocess.CompletedProcess, dict, object, object]:
    """A gentle load (16 requests, 4 in flight, 2 warm-up) with the cross-check: the bench's run, its
    result's cross-check block, the trace and the HTML page."""
    res_json, trace, page = tmp_path / "r.json", tmp_path / "t.jsonl", tmp_path / "r.html"
    r = bench("--base-url", server, "--dataset", "random", "--input-len", str(IN), "--output-len", str(OUT),
              "--num-prompts", "16", "--max-concurrency", "4", "--warmup", "2", "--result-json", str(res_json),
              "--trace", str(trace), "--html", str(page))
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    res = json.loads(res_json.read_text())
    cc = res["crosscheck"]
    assert cc["available"], cc
    return r, res, trace, page


def test_client_vs_server_crosscheck(server, tmp_path):
    """The server's own /metrics histograms over the run's window, next to the client's means: each
    gap is (client - server) in % of the server's, the warm-up outside the window, the same in the
    HTML page and in `bench report` of the trace."""
    r, res, trace, page = crosscheck_run(server, tmp_path)
    assert "Client vs server" in r.stdout
    m = res["crosscheck"]["metrics"]
    for key in ("ttft", "e2el", "queue", "itl"):
        assert m[key]["server_metric"].startswith("inferd:")
    for key, field in (("ttft", "mean_ttft_ms"), ("e2el", "mean_e2el_ms")):
        assert m[key]["server_count"] == 16  # the warm-up requests are outside the window
        row = m[key]
        assert row["client_mean_ms"] == res[field]
        assert row["gap_pct"] == pytest.approx(100 * (row["client_mean_ms"] - row["server_mean_ms"])
                                               / row["server_mean_ms"])
    assert "Client vs server" in page.read_text()
    # the scrapes travel in the trace: the report shows the same cross-check
    rr = bench("report", str(trace))
    assert rr.returncode == 0 and rr.stdout == r.stdout


@pytest.mark.integration
def test_client_vs_server_agree_within_10_percent(server, tmp_path):
    """The server counts from the HTTP request's arrival; the client adds the network, the HTTP parsing
    and the SSE delivery: on a quiet machine that is within 10 % on mean TTFT and E2EL (a busy one
    stretches the client's side, so `make test-integration` only)."""
    _, res, _, _ = crosscheck_run(server, tmp_path)
    m = res["crosscheck"]["metrics"]
    for key in ("ttft", "e2el"):
        assert abs(m[key]["gap_pct"]) <= 10.0, (key, m[key])

"""Scaling out on one box, in one run: one server on all threads vs `--data-parallel-size 2` (one
thread each, pinned) vs `inferd router` over two one-thread servers (pinned with taskset).

For each: output tok/s, TTFT and TPOT p50/p99 at each concurrency, on a shared-prefix workload
(`--dataset prefix-families`: 8 system prompts of 384 tokens, a 32-token question each) and a
random one (256 in). All `--quantization gguf`, 64 output tokens (ignore_eos). Every server's
prefix-cache hit rate over the whole run is printed beside.

What a 2-core machine can show: replicas do not add cores here. Two engines of one thread each
split the same two cores a single two-thread engine uses; what can differ is how well a batch
uses a core (one-thread matmuls do not wait at OpenMP barriers; two smaller batches are each
less efficient than one big one), and the router adds a third process that takes CPU from
the engines. Scale-out pays on a machine with more cores than one engine can use; this only
shows the overheads and the cache effects.

The last setup puts the router unchanged in front of two llama-servers (built from the sources in
the llama-cpp-python sdist, as benchmarks/llamacpp_server_bench.py does); their hit rate is not
read (llama-server exports no prefix-cache counter).

The header gives the setup and each setup's paths record (its inferd engines' records from
/v1/engine/state, or llama.cpp's build); --json F writes {"cpu", "setup", "rows", "paths", "results"}.

Usage: .venv/bin/python benchmarks/scale_out.py [--concurrency 1,8,32,64] [--workloads prefix,random]
       [--setups 0,1,2,3] [--json F]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import httpx  # noqa: E402

from common import check_rows, merge_paths, report_header, served_paths, write_json  # noqa: E402
from serving import fmt, free_port, inferd_env, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402

OUT_LEN = 64
WORKLOADS = {
    "prefix": ["--dataset", "prefix-families", "--prefix-families", "8", "--input-len", "384",
               "--question-len", "32"],
    "random": ["--dataset", "random", "--input-len", "256"],
}
BASE = ["--quantization", "gguf", "--max-num-seqs", "64"]


def requests_for(c: int) -> int:
    return max(16, 2 * c)


@contextlib.contextmanager
def single():
    with server(inferd_serve_cmd(*BASE, "--threads", "2", port=free_port()), "one-server", env=inferd_env()) as url:
        yield url, [url]


@contextlib.contextmanager
def data_parallel():
    with server(inferd_serve_cmd(*BASE, "--data-parallel-size", "2", port=free_port()), "dp2",
                env=inferd_env()) as url:
        yield url, [url]


@contextlib.contextmanager
def routed():
    taskset = shutil.which("taskset")
    ncpu = len(os.sched_getaffinity(0))

    def pinned(cpu: int, cmd: list[str]) -> list[str]:
        return [taskset, "-c", str(cpu % ncpu), *cmd] if taskset else cmd

    ports = [free_port(), free_port()]
    with contextlib.ExitStack() as st:
        urls = []
        for i, p in enumerate(ports):
            cmd = pinned(i, inferd_serve_cmd(*BASE, "--threads", "1", port=p))
            urls.append(st.enter_context(server(cmd, f"replica{i}", env=inferd_env())))
        rport = free_port()
        rcmd = [sys.executable, "-m", "inferd", "router", "--port", str(rport), "--policy", "prefix",
                *[a for u in urls for a in ("--backend", u)]]
        url = st.enter_context(server(rcmd, "router", env=inferd_env()))
        yield url, urls


@contextlib.contextmanager
def routed_llama():
    """The router unchanged in front of two llama-servers (one core each, prompt cache on,
    --metrics so that the router reads their queue gauges)."""
    from llamacpp import ensure_llama_server, llamacpp_env

    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    from inferd.gguf_file import default_model_path

    binary, gguf = str(ensure_llama_server()), default_model_path()
    ncpu = len(os.sched_getaffinity(0))
    with contextlib.ExitStack() as st:
        urls = []
        for i in range(2):
            port = free_port()
            cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
                   "-np", "32", "-c", str(32 * 1024), "--metrics", "--no-webui"]
            if shutil.which("taskset"):
                cmd = [shutil.which("taskset"), "-c", str(i % ncpu), *cmd]
            urls.append(st.enter_context(server(cmd, f"llama-server{i}", env=llamacpp_env())))
        rport = free_port()
        rcmd = [sys.executable, "-m", "inferd", "router", "--port", str(rport), "--policy", "prefix",
                *[a for u in urls for a in ("--backend", u)]]
        yield st.enter_context(server(rcmd, "router-llama", env=inferd_env())), []


SETUPS = [("one server, 2 threads", single), ("--data-parallel-size 2", data_parallel),
          ("router over 2 x 1 thread", routed), ("router over 2 llama-server", routed_llama)]


def setup_paths(backends: list[str]) -> dict:
    """What a setup's engines ran: each inferd backend's record from /v1/engine/state (counters summed,
    "engines": how many); llama-server's build where the backends are llama-servers (none listed)."""
    if not backends:
        from llamacpp import build_info

        return build_info()
    records = [served_paths(u) for u in backends]
    out = None
    for p in records:
        out = merge_paths(out, p)
    out["engines"] = sum(p["engines"] for p in records)
    return out


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("inferd:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("inferd:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--workloads", default="prefix,random")
    ap.add_argument("--setups", default="0,1,2,3", help="which of: 0 one server, 1 DP=2, 2 router over inferd, "
                                                       "3 router over llama-server")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    setups = [SETUPS[int(i)] for i in a.setups.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    works = a.workloads.split(",")
    results, paths = [], {}
    for name, setup in setups:
        with setup() as (url, backends):
            for w in works:
                h0, q0 = cache_counts(backends) if backends else (0, 0)
                for c in concs:
                    res = run_bench(url, *WORKLOADS[w], "--output-len", str(OUT_LEN), "--num-prompts",
                                    str(requests_for(c)), "--max-concurrency", str(c), "--seed", str(c),
                                    # first-use costs (a kernel compile, page faults) belong to no setup
                                    "--warmup", "2", "--no-server-metrics")
                    results.append({"setup": name, "workload": w, "concurrency": c, **{
                        k: res.get(k) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                                "median_tpot_ms", "p99_tpot_ms", "failed")}})
                h1, q1 = cache_counts(backends) if backends else (0, 0)
                results.append({"setup": name, "workload": w,
                                "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else None})
            paths[name] = setup_paths(backends)
    check_rows(paths)
    setup = {"servers": f"inferd serve {' '.join(BASE)} (one 2-thread server; --data-parallel-size 2; or two "
                        "1-thread servers pinned, behind inferd router --policy prefix); llama-server: 2 x 1 thread",
             "workloads": {w: " ".join(WORKLOADS[w]) for w in works},
             "levels": "; ".join(f"concurrency {c}, {requests_for(c)} requests" for c in concs),
             "output": f"{OUT_LEN} tokens (ignore_eos)", "rounds": "1 (one run a cell: not a headline table)"}
    report_header("scaling out on one box", setup, paths)
    header = ["setup", "conc", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "vs one server"]
    tables = []
    for w in works:
        base = {r["concurrency"]: r["output_throughput"] for r in results
                if r["setup"] == setups[0][0] and r["workload"] == w and "concurrency" in r}
        rows = []
        for r in results:
            if r["workload"] != w or "concurrency" not in r:
                continue
            ratio = (r["output_throughput"] / base[r["concurrency"]]) if base.get(r["concurrency"]) else None
            rows.append([r["setup"], str(r["concurrency"]), fmt(r["output_throughput"], "{:.1f}"),
                         fmt(r["median_ttft_ms"], "{:.0f}"), fmt(r["p99_ttft_ms"], "{:.0f}"),
                         fmt(r["median_tpot_ms"], "{:.1f}"), fmt(r["p99_tpot_ms"], "{:.1f}"),
                         fmt(ratio, "{:.2f}x")])
        hits = ", ".join(f"{r['setup']} {fmt(r['hit_rate'] and 100 * r['hit_rate'], '{:.0f}')} %"
                         for r in results if r["workload"] == w and "hit_rate" in r)
        tables.append(print_table(f"\n{w} workload, {OUT_LEN} output tokens, gguf, one run a cell "
                                  f"(ms; prefix-cache hit rate over the run: {hits})", header, rows))
    rows = [{"label": f"{r['setup']}, {r['workload']}, concurrency {r['concurrency']}, "
                      f"{requests_for(r['concurrency'])} requests", "metric": "output tok/s",
             "median": r["output_throughput"], "runs": [r["output_throughput"]]} for r in results if "concurrency" in r]
    write_json(a.json, setup, rows, paths, results=results)


if __name__ == "__main__":
    main()

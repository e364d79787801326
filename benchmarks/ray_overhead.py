"""What Ray costs, on one machine: the same work through inferd's own machinery and through Ray.

1. Serving: one `inferd bench` workload against `inferd serve -dp 2` (two engine processes behind
   one API process, prefix-aware) and against the Ray Serve application (inferd.ray.serve, two
   engine replicas, the same prefix policy as a Serve request router, an ingress replica and
   Serve's HTTP proxy in front). Throughput and latencies side by side; then the overhead per
   request: the median TTFT of one-token requests sent one at a time (the path's fixed cost, no
   queueing), Ray minus -dp.
2. Tensor parallelism: TP=2 decode steps at batch 1 with ranks started by `mp` and by `ray`, over
   the shared-memory all-reduce (Ray put both ranks on this node) and over gloo: the median step
   time, and Ray's overhead per step (ray - mp).

Medians of one run each (a 2-core machine: the servers share the cores with the proxy, the
ingress and Ray's own daemons; the numbers say what the layers cost here, not what a cluster
gains).

Usage: .venv/bin/python benchmarks/ray_overhead.py [--prompts 48] [--concurrency 8] [--json F]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import report_header, served_paths, write_json  # noqa: E402
from serving import (METRICS, fmt, free_port, inferd_env, inferd_serve_cmd, print_table, run_bench, server,  # noqa: E402
                     wait_ready)

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
SERVE = os.path.join(os.path.dirname(sys.executable), "serve")
KV = "256MiB"


@contextlib.contextmanager
def ray_cluster():
    """A one-node cluster on loopback (its own auth token); RAY_ADDRESS set for this process and its children."""
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex(), RAY_ADDRESS=f"127.0.0.1:{port}")
    subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True, env=env)
    old = dict(os.environ)
    os.environ.update(env)
    try:
        yield env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env)
        os.environ.clear()
        os.environ.update(old)


@contextlib.contextmanager
def ray_serve_app(env: dict, replicas: int):
    import yaml

    port = free_port()
    cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [{"name": "inferd", "route_prefix": "/", "import_path": "inferd.ray.serve:build_app",
                             "args": {"engine": {"kv_cache_memory": KV}, "num_replicas": replicas}}]}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "serve.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        log = os.path.join(d, "serve.log")
        proc = subprocess.Popen([SERVE, "run", path], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, proc, 300, log)
            yield base
        finally:
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def serving(args, env) -> tuple[list[dict], dict]:
    load = ["--dataset", "random", "--input-len", "64", "--output-len", "64", "--num-prompts", str(args.prompts),
            "--max-concurrency", str(args.concurrency), "--seed", "1", "--no-progress"]
    probe = ["--dataset", "random", "--input-len", "16", "--output-len", "1", "--num-prompts", "20",
             "--max-concurrency", "1", "--seed", "2", "--no-progress", "--no-server-metrics"]
    rows, paths = [], {}
    cmd = inferd_serve_cmd("-dp", "2", "--kv-cache-memory", KV, port=free_port())
    with server(cmd, "inferd-dp2", env=inferd_env()) as base:
        paths["inferd serve -dp 2"] = served_paths(base)
        rows.append({"setup": "inferd serve -dp 2", **run_bench(base, *load), "probe": run_bench(base, *probe)})
    with ray_serve_app(env, 2) as base:
        paths["Ray Serve, 2 replicas"] = served_paths(base)
        rows.append({"setup": "Ray Serve, 2 replicas", **run_bench(base, *load), "probe": run_bench(base, *probe)})
    return rows, paths


def step_ms(executor: str, backend: str, tokens: int) -> float:
    from inferd.engine.engine import LLMEngine
    from inferd.engine.request import SamplingParams

    eng = LLMEngine(quantization="none", dtype="float32", tensor_parallel_size=2, distributed_executor_backend=executor,
                    tensor_parallel_backend=backend, kv_cache_memory="64MiB", threads=1)
    try:
        ids = eng.tokenizer.encode("The history of the Roman empire begins with")
        eng.add_request(ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        eng.step()  # prefill
        times = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        assert eng.tp.backend == backend
        return 1e3 * statistics.median(times)
    finally:
        eng.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parts", default="tp,serving", help="which parts to run (tp, serving)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    with ray_cluster() as env:
        # the ranks first: a Serve application's replicas, once stopped, give their CPUs back lazily
        steps = {(ex, be): step_ms(ex, be, args.tokens) for be in ("shm", "gloo") for ex in ("mp", "ray")
                 if "tp" in parts}
        rows, paths = serving(args, env) if "serving" in parts else ([], {})
    setup = {"workload": f"random 64 in / 64 out, {args.prompts} prompts at concurrency {args.concurrency}",
             "probe": "20 one-token requests of 16 prompt tokens, one at a time",
             "tensor parallel": f"TP=2, 1 thread a rank, fp32, batch 1, {args.tokens} decode steps"}
    report_header("Ray's overhead: inferd's own processes vs the same work placed by Ray", setup, paths)
    if rows:
        serving_tables(rows)
    if steps:
        print_table("\nTensor parallelism: median decode step", ["backend", "mp, ms", "ray, ms", "ray - mp, ms"],
                    [[be, f"{steps[('mp', be)]:.2f}", f"{steps[('ray', be)]:.2f}",
                      f"{steps[('ray', be)] - steps[('mp', be)]:+.2f}"] for be in ("shm", "gloo")])
    write_json(args.json, setup, [{k: v for k, v in r.items() if k in ("setup", "probe") or k in
                                   {m[1] for m in METRICS}} for r in rows], paths,
               tp_step_ms={f"{ex}/{be}": v for (ex, be), v in steps.items()})


def serving_tables(rows: list[dict]) -> None:
    print_table("\nServing (one machine)", ["setup", *(m[0] for m in METRICS), "probe TTFT ms (median)"],
                [[r["setup"], *(fmt(r.get(k), s) for _, k, s in METRICS), fmt(r["probe"].get("median_ttft_ms"), "{:.1f}")]
                 for r in rows])
    per_req = rows[1]["probe"]["median_ttft_ms"] - rows[0]["probe"]["median_ttft_ms"]
    print(f"Ray Serve's overhead per request (median one-token TTFT, Ray - dp): {per_req:+.1f} ms")


if __name__ == "__main__":
    main()

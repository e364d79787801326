"""`inferd serve --scheduling continuous` vs `--scheduling static`, through `inferd bench`.

Same server settings (default model, same --max-num-seqs, same threads) and the same seeded
workload for both: random prompts, mixed output lengths (16-512 by default), all sent at once, so
the difference is the scheduler alone. Static scheduling admits a batch only when the previous
one has fully drained, so a batch holding one 512-token request keeps its short neighbours'
slots idle and everyone behind it waiting; that shows in throughput and most of all in p99 TTFT.

Usage: nice -n 10 .venv/bin/python benchmarks/scheduling_bench.py [--num-prompts 64] [--max-num-seqs 16]
An optional benchmark (not part of CI); about 5-10 minutes on a 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cpu_features  # noqa: E402
from serving import METRICS, fmt, free_port, inferd_env, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="64-256")
    ap.add_argument("--output-len", default="16-512")
    ap.add_argument("--request-rate", default="inf", help="inf: all requests at t=0")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `inferd serve` flags for both runs")
    a = ap.parse_args()

    bench_args = ["--endpoint", "/v1/completions", "--dataset", "random", "--num-prompts", str(a.num_prompts),
                  "--input-len", a.input_len, "--output-len", a.output_len, "--request-rate", a.request_rate,
                  "--seed", str(a.seed),
                  # Two throwaway requests first: the first request pays one-off costs (kernel
                  # compile/load, allocator warm-up) that belong to neither scheduler.
                  "--warmup", "2", "--timeout", "3600"]
    results = {}
    for mode in ("continuous", "static"):
        port = free_port()
        cmd = inferd_serve_cmd("--threads", str(a.threads), "--max-num-seqs", str(a.max_num_seqs),
                               "--scheduling", mode, *a.serve_args.split(), port=port)
        with server(cmd, f"inferd-{mode}", env=inferd_env()) as url:
            results[mode] = run_bench(url, *bench_args)

    c, s = results["continuous"], results["static"]
    rows = []
    for label, key, spec in METRICS:
        cv, sv = c.get(key), s.get(key)
        # Ratios read as "how much better continuous is": higher-is-better metrics c/s, latencies s/c.
        better_high = key.endswith("throughput")
        ratio = (cv / sv if better_high else sv / cv) if cv and sv else None
        rows.append([label, fmt(cv, spec), fmt(sv, spec), fmt(ratio, "{:.2f}x")])
    print(f"\n{cpu_features()}; {a.threads} threads")
    print_table(f"{a.num_prompts} requests, input {a.input_len}, output {a.output_len} tokens (ignore_eos), "
                f"request rate {a.request_rate}, max_num_seqs={a.max_num_seqs}, {a.threads} threads, "
                f"completed {c['completed']}/{s['completed']}",
                ["metric", "continuous", "static", "continuous advantage"], rows)


if __name__ == "__main__":
    main()

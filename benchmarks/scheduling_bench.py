"""`inferd serve --scheduling continuous` vs `--scheduling static`, through `inferd bench`.

Same server settings (default model, same --max-num-seqs, same threads) and the same seeded
workload for both: random prompts, mixed output lengths (16-512 by default), all sent at once, so
the difference is the scheduler alone. Static scheduling admits a batch only when the previous
one has fully drained, so a batch holding one 512-token request keeps its short neighbours'
slots idle and everyone behind it waiting; that shows in throughput and most of all in p99 TTFT.

The two alternate --rounds times (a fresh server each run); every cell is the median, and the header
gives the setup and each server's paths record (GET /v1/engine/state after its run). --json F writes
{"cpu", "setup", "rows", "paths"}.

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): 4
requests of 8-16 in / 4-8 out tokens, --max-num-seqs 2, a 64 MiB KV cache, 1 round.

Usage: nice -n 10 .venv/bin/python benchmarks/scheduling_bench.py [--model F.gguf] [--num-prompts 64]
       [--max-num-seqs 16] [--rounds 3] [--json F] [--tiny]
An optional benchmark (not part of CI); about 5-10 minutes a round on a 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, fmt_spread, interleaved, merge_paths, report_header, served_paths, spread, write_json  # noqa: E402
from serving import METRICS, fmt, free_port, inferd_env, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", default="64-256")
    ap.add_argument("--output-len", default="16-512")
    ap.add_argument("--request-rate", default="inf", help="inf: all requests at t=0")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `inferd serve` flags for both runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs of each scheduler; cells are medians")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): 4 requests of 8-16 in / 4-8 out, "
                         "--max-num-seqs 2, a 64 MiB KV cache, 1 round")
    a = ap.parse_args()
    tiny = []
    if a.tiny:
        a.num_prompts, a.input_len, a.output_len, a.max_num_seqs, a.rounds = 4, "8-16", "4-8", 2, 1
        tiny = ["--kv-cache-memory", "64MiB"]

    bench_args = ["--endpoint", "/v1/completions", "--dataset", "random", "--num-prompts", str(a.num_prompts),
                  "--input-len", a.input_len, "--output-len", a.output_len, "--request-rate", a.request_rate,
                  "--seed", str(a.seed),
                  # Two throwaway requests first: the first request pays one-off costs (kernel
                  # compile/load, allocator warm-up) that belong to neither scheduler.
                  "--warmup", "2", "--timeout", "3600"]
    paths: dict[str, dict] = {}

    def run(mode: str):
        def once() -> dict:
            port = free_port()
            cmd = inferd_serve_cmd(*(["--model", a.model] if a.model else []), "--threads", str(a.threads),
                                   "--max-num-seqs", str(a.max_num_seqs), "--scheduling", mode, *tiny,
                                   *a.serve_args.split(), port=port)
            with server(cmd, f"inferd-{mode}", env=inferd_env()) as url:
                res = run_bench(url, *bench_args)
                paths[row(mode)] = merge_paths(paths.get(row(mode)), served_paths(url))
                return res
        return once

    def row(mode: str) -> str:
        return f"inferd {mode}, max_num_seqs={a.max_num_seqs}"

    # continuous, static, continuous, static, ...: a fresh server each run
    runs = interleaved({m: run(m) for m in ("continuous", "static")}, a.rounds, log=False)
    check_rows(paths)

    def med(mode: str, key: str):
        vs = [r.get(key) for r in runs[mode] if r.get(key) is not None]
        return statistics.median(vs) if vs else None

    rows, table = [], []
    for label, key, spec in METRICS:
        cv, sv = med("continuous", key), med("static", key)
        # Ratios read as "how much better continuous is": higher-is-better metrics c/s, latencies s/c.
        better_high = key.endswith("throughput")
        ratio = (cv / sv if better_high else sv / cv) if cv and sv else None
        table.append([label, fmt(cv, spec), fmt(sv, spec), fmt(ratio, "{:.2f}x")])
        for m in ("continuous", "static"):
            vs = [r[key] for r in runs[m] if r.get(key) is not None]
            if vs:
                rows.append({"label": row(m), "metric": key, **spread(vs)})
    done = {m: sum(r["completed"] for r in runs[m]) for m in runs}
    setup = {"threads": a.threads, "requests": f"{a.num_prompts} a run, request rate {a.request_rate} (inf: all at "
             "t=0), seeded random prompts", "lengths": f"input {a.input_len}, output {a.output_len} tokens (ignore_eos)",
             "max_num_seqs": f"{a.max_num_seqs} for both schedulers", "serve flags": a.serve_args or "(defaults)",
             "rounds": f"{a.rounds}, interleaved (continuous, static, again; a fresh server each run); every cell "
                       "is the median, never the best",
             "completed": f"continuous {done['continuous']}/{a.num_prompts * a.rounds}, "
                          f"static {done['static']}/{a.num_prompts * a.rounds}"}
    report_header("inferd serve --scheduling continuous vs static, through inferd bench", setup, paths)
    print_table(f"medians of {a.rounds} interleaved runs", ["metric", "continuous", "static", "continuous advantage"],
                table)
    print("out tok/s per run (min-max): " + "; ".join(
        f"{m} {fmt_spread([r['output_throughput'] for r in runs[m]])}" for m in runs))
    write_json(a.json, setup, rows, paths)


if __name__ == "__main__":
    main()

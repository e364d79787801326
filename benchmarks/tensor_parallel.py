"""Tensor parallelism in one run: TP=1 on all threads against TP=2 at one thread a rank, over the
shared-memory all-reduce and over gloo.

For each setup: decode tok/s at batch 1 and 32 (greedy, ignore_eos, prefill excluded), the
all-reduces a step, the time rank 0 spends inside them (its own copy and sum, the barrier, and the
wait for the slower rank: the default model's 3 KV groups split 2 + 1), that time per call, and its
share of the time per output token. Medians of alternating rounds, every engine loaded once.

What a 2-core machine can show: TP=2 at one thread a rank uses the same two cores as TP=1 at two
threads, so the best it can do is tie; the table measures what the split costs (collectives,
the uneven head split, one-thread GEMVs). The gain of tensor parallelism is on machines with more
memory bandwidth than one rank can use: multi-socket servers (a rank per NUMA node) and multi-GPU.

The header gives each setup's paths record (rank 0's engine: TP size, fused decode steps, weights)
and each setup's label is checked against it; --json F writes {"cpu", "setup", "rows", "paths", ...}.

Usage: .venv/bin/python benchmarks/tensor_parallel.py [--rounds 3] [--tokens 64] [--quantization none]
       [--quantize-activations] [--dtype float32] [--batches 1,32] [--json F]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, fmt_spread, interleaved, report_header, spread, write_json  # noqa: E402

PROMPT = "The history of the Roman empire begins with the founding of the city, and"


def timed(comm) -> dict:
    """Count and time rank 0's all-reduces (the modules call comm.all_reduce_ by attribute)."""
    stats = {"calls": 0, "seconds": 0.0}
    inner = comm.all_reduce_

    def all_reduce_(x):
        t = time.perf_counter()
        inner(x)
        stats["seconds"] += time.perf_counter() - t
        stats["calls"] += 1
    comm.all_reduce_ = all_reduce_
    return stats


def measure(eng, ids: list[int], batch: int, n: int, ar: dict | None) -> dict:
    from inferd.engine.request import SamplingParams

    rids = [eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for _ in range(batch)]
    reqs = [eng.requests[r] for r in rids]
    while not all(r.timings.first_token for r in reqs):  # prefill (and its all-reduces) not counted
        eng.step()
    calls0, secs0, steps0 = (ar["calls"], ar["seconds"], eng.stats.steps) if ar else (0, 0.0, eng.stats.steps)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    steps = eng.stats.steps - steps0
    out = {"tok_s": batch * (n - 1) / dt, "step_ms": 1e3 * dt / steps}
    if ar:
        calls, secs = ar["calls"] - calls0, ar["seconds"] - secs0
        out.update(ar_per_step=calls / steps, ar_us=1e6 * secs / calls, ar_share=secs / dt)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--quantize-activations", action="store_true",
                    help="W4A8/W8A8; adds a TP=1 row without the fused decode step, which TP turns off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    import torch

    from inferd.engine.engine import LLMEngine
    from inferd.engine.paths import engine_paths

    cores = len(os.sched_getaffinity(0))
    setups = [(f"TP=1, {cores} threads", dict(threads=cores)),
              *([(f"TP=1, {cores} threads, eager", dict(threads=cores, enforce_eager=True))]
                if args.quantize_activations else []),
              ("TP=2 shm, 1 thread/rank", dict(tensor_parallel_size=2, tensor_parallel_backend="shm")),
              ("TP=2 gloo, 1 thread/rank", dict(tensor_parallel_size=2, tensor_parallel_backend="gloo"))]
    batches = [int(b) for b in args.batches.split(",")]
    engines, comms = {}, {}
    for name, opts in setups:
        eng = LLMEngine(dtype=args.dtype, quantization=args.quantization, kv_cache_memory="512MiB",
                        quantize_activations=args.quantize_activations, max_num_seqs=max(batches), **opts)
        engines[name] = eng
        comms[name] = timed(eng.runner.comm) if eng.tp is not None else None
        torch.set_num_threads(opts.get("threads", 1))
    ids = engines[setups[0][0]].tokenizer.encode(PROMPT)
    for name, opts in setups:  # warm-up: first-call allocations, kernel paths
        torch.set_num_threads(opts.get("threads", 1))
        measure(engines[name], ids, 2, 4, comms[name])

    def run(name: str, opts: dict, b: int):
        def once() -> dict:
            torch.set_num_threads(opts.get("threads", 1))
            return measure(engines[name], ids, b, args.tokens, comms[name])
        return once

    runs = interleaved({(name, b): run(name, opts, b) for name, opts in setups for b in batches}, args.rounds,
                       log=False)
    results = {name: {b: runs[(name, b)] for b in batches} for name, _ in setups}
    paths = {name: engine_paths(eng) for name, eng in engines.items()}  # rank 0's, for TP=2
    for eng in engines.values():
        eng.close()
    check_rows(paths)

    def med(rows, k):
        vals = [x[k] for x in rows if k in x]
        return statistics.median(vals) if vals else None

    setup = {"model": f"default model, dtype {args.dtype}, quantization {args.quantization}"
                      f"{' (W4A8/W8A8)' if args.quantize_activations else ''}", "cores": cores,
             "requests": f"batch {', '.join(map(str, batches))} of the same prompt, {args.tokens} tokens each "
                         "(greedy, ignore_eos; prefill excluded)",
             "rounds": f"{args.rounds}, interleaved (every setup and batch once a round); each cell is the median"}
    report_header("tensor parallelism", setup, paths)
    print("| setup | batch | decode tok/s (min-max) | vs TP=1 | ms/step | all-reduces/step | µs/all-reduce (rank 0) | all-reduce share of TPOT |")
    print("|---|---|---|---|---|---|---|---|")
    base = {b: med(results[setups[0][0]][b], "tok_s") for b in batches}
    summary, table = {}, []
    for name, _ in setups:
        for b in batches:
            rows = results[name][b]
            tok, ar, us, share = (med(rows, k) for k in ("tok_s", "ar_per_step", "ar_us", "ar_share"))
            summary[f"{name} b{b}"] = {k: med(rows, k) for k in rows[0]}
            table.append({"label": f"{name}, batch {b}", "metric": "decode tok/s", **spread([x["tok_s"] for x in rows]),
                          **{k: med(rows, k) for k in rows[0] if k != "tok_s"}})
            cols = ["-", "-", "-"] if ar is None else [f"{ar:.0f}", f"{us:.0f}", f"{100 * share:.0f} %"]
            print(f"| {name} | {b} | {fmt_spread([x['tok_s'] for x in rows])} | {tok / base[b]:.2f}x | "
                  f"{med(rows, 'step_ms'):.1f} | " + " | ".join(cols) + " |")
    write_json(args.json, setup, table, paths, results=summary)


if __name__ == "__main__":
    main()

"""What serving costs the engine: `inferd serve` (engine core in its own process, and the old
in-process thread for comparison) against the same engine offline, in one run.

Per model configuration (dense, `--quantization gguf`):
  - concurrency 1: the served mean TPOT (`inferd bench`, 128 in / 128 out) beside the offline
    engine's per-token time on a 128-token prompt (engine.rate.decode_rate, prefill excluded);
  - concurrency 8 and 32: served output tok/s beside the offline engine's on the same number of
    128-in / 128-out requests with --max-num-seqs equal to the concurrency (output tokens over the
    wall time from the first add to the last finish, prefill included, as `inferd bench` counts).
The offline prompts are random token ids of the bench's lengths (speed does not depend on which
tokens). Ratios near 1.0 mean serving costs nothing; the bar is within 10 %.

Usage: .venv/bin/python benchmarks/serve_overhead.py [--threads 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import cpu_features  # noqa: E402
from serving import free_port, inferd_env, inferd_serve_cmd, run_bench, server  # noqa: E402

IN_LEN, OUT_LEN = 128, 128
CONFIGS = [("dense (auto dtype)", []), ("gguf", ["--quantization", "gguf"])]


def offline(extra: list[str], threads: int, concs: list[int]) -> dict:
    import torch

    from inferd.engine.engine import LLMEngine
    from inferd.engine.rate import decode_rate
    from inferd.engine.request import SamplingParams
    from inferd.loader import load_model

    torch.set_num_threads(threads)
    quant = extra[extra.index("--quantization") + 1] if "--quantization" in extra else "none"
    lm = load_model(None, quantization=quant)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(IN_LEN)]
    out = {"ms_per_token": 1000 / decode_rate(lm, prompt, OUT_LEN, warmup=True)}
    for c in concs:
        if c == 1:
            continue
        eng = LLMEngine(loaded=lm, kv_cache_memory="1GiB", max_num_seqs=c)
        eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        while eng.has_unfinished():
            eng.step()
        n = 2 * c
        t0 = time.monotonic()
        for _ in range(n):
            eng.add_request([rng.randrange(1000, 20000) for _ in range(IN_LEN)],
                            SamplingParams(max_tokens=OUT_LEN, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        out[f"tok_s_c{c}"] = n * OUT_LEN / (time.monotonic() - t0)
    return out


def served(extra: list[str], in_process: bool, threads: int, concs: list[int]) -> dict:
    port = free_port()
    flags = [*extra, "--threads", str(threads), "--max-num-seqs", str(max(concs)), "--kv-cache-memory", "1GiB"]
    if in_process:
        flags.append("--engine-in-process")
    out = {}
    with server(inferd_serve_cmd(*flags, port=port), "inferd", env=inferd_env()) as url:
        run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", "8", "--num-prompts", "2",
                  "--max-concurrency", "1", "--no-server-metrics")  # warm-up
        for c in concs:
            res = run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
                            "--num-prompts", str(4 if c == 1 else 2 * c), "--max-concurrency", str(c),
                            "--seed", str(c), "--no-server-metrics")
            out[c] = res
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    concs = [int(x) for x in a.concurrency.split(",")]
    rows, results = [], {}
    for label, extra in CONFIGS:
        off = offline(extra, a.threads, concs)
        proc = served(extra, False, a.threads, concs)
        thread = served(extra, True, a.threads, concs)
        results[label] = {"offline": off, "process": {c: r for c, r in proc.items()},
                          "thread": {c: r for c, r in thread.items()}}
        for c in concs:
            if c == 1:
                o = off["ms_per_token"]
                p, t = proc[c]["mean_tpot_ms"], thread[c]["mean_tpot_ms"]
                rows.append((label, "1", "TPOT ms", f"{o:.1f}", f"{p:.1f}", f"{t:.1f}", f"{o / p:.2f}x", f"{o / t:.2f}x"))
            else:
                o = off[f"tok_s_c{c}"]
                p, t = proc[c]["output_throughput"], thread[c]["output_throughput"]
                rows.append((label, str(c), "out tok/s", f"{o:.1f}", f"{p:.1f}", f"{t:.1f}", f"{p / o:.2f}x",
                             f"{t / o:.2f}x"))
    head = ("config", "conc", "metric", "offline", "served (process)", "served (thread)", "process/offline",
            "thread/offline")
    print(f"\n{cpu_features()}; {a.threads} threads; {IN_LEN} in / {OUT_LEN} out; ratio: offline speed over served "
          "(1.00x = serving costs nothing)")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_features(), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()

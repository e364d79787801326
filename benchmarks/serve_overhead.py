"""What serving costs the engine: `inferd serve` (engine core in its own process, and the old
in-process thread for comparison) against the same engine offline, in one run.

Per model configuration (dense, `--quantization gguf`):
  - concurrency 1: the served mean TPOT (`inferd bench`, 128 in / 128 out) beside the offline
    engine's per-token time on a 128-token prompt (engine.rate.decode_rate, prefill excluded);
  - concurrency 8 and 32: served output tok/s beside the offline engine's on the same number of
    128-in / 128-out requests with --max-num-seqs equal to the concurrency (output tokens over the
    wall time from the first add to the last finish, prefill included, as `inferd bench` counts).
The offline prompts are random token ids of the bench's lengths (speed does not depend on which
tokens). Both sides sample as the server does for a request that names no sampling parameters
(temperature 1, every filter off): the bench sends none, and random sampling costs more per step
than greedy (it is part of what is compared, not of what serving adds). Ratios near 1.0 mean serving costs nothing; the bar is within 10 %.

A shared 2-core machine drifts by 10-20 % between minutes, more than the effect measured, so each
cell is the median of --rounds runs, and the rounds interleave: offline, served (process), served
(thread), then again, each server staying up across its rounds. Every run's value is printed too.

Usage: .venv/bin/python benchmarks/serve_overhead.py [--threads 2] [--rounds 3] [--configs gguf,dense]
       [--concurrency 1,8,32] [--no-thread] [--json F]
"""
from __future__ import annotations

import argparse
import contextlib
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
SERVER_TEMPERATURE = 1.0  # the server's default (OpenAI's)
CONFIGS = [("dense (auto dtype)", []), ("gguf", ["--quantization", "gguf"])]


def offline_engine(extra: list[str], threads: int):
    import torch

    from inferd.loading.loader import load_model

    torch.set_num_threads(threads)
    quant = extra[extra.index("--quantization") + 1] if "--quantization" in extra else "none"
    return load_model(None, quantization=quant)


def offline(lm, c: int, seed: int) -> float:
    """ms per token at c == 1, else output tok/s, of the engine without a server."""
    from inferd.engine.engine import LLMEngine
    from inferd.engine.rate import decode_rate
    from inferd.engine.request import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 20000) for _ in range(IN_LEN)]
    if c == 1:
        return 1000 / decode_rate(lm, prompt, OUT_LEN, warmup=True, temperature=SERVER_TEMPERATURE)
    eng = LLMEngine(loaded=lm, kv_cache_memory="1GiB", max_num_seqs=c)
    eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    while eng.has_unfinished():
        eng.step()
    n = 2 * c
    t0 = time.monotonic()
    for _ in range(n):
        eng.add_request([rng.randrange(1000, 20000) for _ in range(IN_LEN)],
                        SamplingParams(max_tokens=OUT_LEN, temperature=SERVER_TEMPERATURE, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return n * OUT_LEN / (time.monotonic() - t0)


def served_cmd(extra: list[str], in_process: bool, threads: int, concs: list[int], port: int) -> list[str]:
    flags = [*extra, "--threads", str(threads), "--max-num-seqs", str(max(concs)), "--kv-cache-memory", "1GiB"]
    if in_process:
        flags.append("--engine-in-process")
    return inferd_serve_cmd(*flags, port=port)


def api_process(url: str):
    """The server's own process (the API side; its engine core is a child of it)."""
    import psutil

    port = url.rsplit(":", 1)[1]
    for p in psutil.Process().children(recursive=True):
        cmd = p.cmdline()
        if "serve" in cmd and port in cmd:
            return p
    raise RuntimeError(f"no server process for {url}")


def cpu_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def served(url: str, c: int, seed: int, api_cpu: list | None = None) -> float:
    """Mean TPOT (ms) at c == 1, else output tok/s, of `inferd bench` against the server at url.
    Appends the API process's CPU ms per output token to api_cpu: unlike wall time it does not
    drift with the machine, and it is what serving takes from the engine's cores."""
    api = api_process(url) if api_cpu is not None else None
    before = cpu_s(api) if api else 0.0
    res = run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
                    "--num-prompts", str(4 if c == 1 else 2 * c), "--max-concurrency", str(c),
                    "--seed", str(seed), "--no-server-metrics")
    if api is not None:
        api_cpu.append(1000 * (cpu_s(api) - before) / max(res["total_output_tokens"], 1))
    return res["mean_tpot_ms"] if c == 1 else res["output_throughput"]


def warm(url: str):
    run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", "8", "--num-prompts", "2",
              "--max-concurrency", "1", "--no-server-metrics")


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def measure(extra: list[str], threads: int, concs: list[int], rounds: int, with_thread: bool) -> dict:
    """{mode: {c: [value per round]}} for mode in offline, process (, thread)."""
    lm = offline_engine(extra, threads)
    modes = ["offline", "process"] + (["thread"] if with_thread else [])
    vals = {m: {c: [] for c in concs} for m in modes}
    vals["api_cpu_ms_per_token"] = {c: [] for c in concs}
    with contextlib.ExitStack() as stack:
        urls = {}
        for m in modes[1:]:
            urls[m] = stack.enter_context(server(served_cmd(extra, m == "thread", threads, concs, free_port()),
                                                 f"inferd-{m}", env=inferd_env()))
            warm(urls[m])
        for r in range(rounds):
            for c in concs:
                vals["offline"][c].append(offline(lm, c, seed=100 * r + c))
                for m in modes[1:]:
                    cpu = vals["api_cpu_ms_per_token"][c] if m == "process" else None
                    vals[m][c].append(served(urls[m], c, seed=100 * r + c, api_cpu=cpu))
                print(f"[round {r + 1}/{rounds}] c={c}: " + ", ".join(f"{m} {vals[m][c][-1]:.1f}" for m in modes),
                      file=sys.stderr, flush=True)
    return vals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="gguf,dense", help="which of: gguf, dense")
    ap.add_argument("--no-thread", action="store_true", help="leave out the in-process (thread) server")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    concs = [int(x) for x in a.concurrency.split(",")]
    wanted = a.configs.split(",")
    rows, results = [], {}
    for label, extra in CONFIGS:
        if label.split()[0] not in wanted:
            continue
        vals = measure(extra, a.threads, concs, a.rounds, not a.no_thread)
        results[label] = vals
        for c in concs:
            o = median(vals["offline"][c])
            p = median(vals["process"][c])
            t = median(vals["thread"][c]) if "thread" in vals else None
            runs = " ".join(f"{x:.1f}" for x in vals["process"][c])
            cpu = f"{median(vals['api_cpu_ms_per_token'][c]):.2f}"
            if c == 1:  # a time: offline over served
                rows.append((label, "1", "TPOT ms", f"{o:.1f}", f"{p:.1f} ({runs})", f"{t:.1f}" if t else "-",
                             f"{o / p:.2f}x", f"{o / t:.2f}x" if t else "-", cpu))
            else:  # a rate: served over offline
                rows.append((label, str(c), "out tok/s", f"{o:.1f}", f"{p:.1f} ({runs})", f"{t:.1f}" if t else "-",
                             f"{p / o:.2f}x", f"{t / o:.2f}x" if t else "-", cpu))
    head = ("config", "conc", "metric", "offline", "served (process) (runs)", "served (thread)", "process/offline",
            "thread/offline", "API CPU ms/token")
    print(f"\n{cpu_features()}; {a.threads} threads; {IN_LEN} in / {OUT_LEN} out; medians of {a.rounds} interleaved "
          "rounds; ratio 1.00x = serving costs nothing")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_features(), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()

"""Long prompts: 8k, 16k and 32k tokens through a Llama-3.2-1B-shaped Q4_K_M (the 131072-token
context of the real model), inferd beside llama.cpp on the same file and threads.

Per depth N (a prompt of N random tokens, then 32 tokens decoded after it), each run in a fresh
process:
  - inferd, as `inferd serve` loads it (--quantization auto, chunked prefill at its default token
    budget, the tiled prefill and split decode attention kernels), once with a bfloat16 KV cache and
    once with an int8 one (q8_0's layout: a scale per 32 values): prefill tok/s (N over the time to
    the first token), decode tok/s at that depth (the 32 tokens after the first over their time),
    the KV bytes the sequence holds (its blocks x a block's bytes) and the process's peak RSS;
  - llama.cpp's `llama-bench -p N -n 0` (prefill from an empty cache) and `-p 0 -n 32 -d N` (decode
    after N tokens in the cache), with flash attention off and on and the KV cache in f16 and q8_0
    (a q8_0 V cache needs flash attention: that setting is not run without it).
A run that does not finish within --dnf-minutes is stopped and reported as DNF, not waited for.
Ratios are inferd's over llama.cpp's best finished setting at that depth. The header gives the CPU
and both builds' paths.

    .venv/bin/python benchmarks/long_context.py                      # 8k, 16k, 32k
    .venv/bin/python benchmarks/long_context.py --depths 8192 --dnf-minutes 10
    .venv/bin/python benchmarks/long_context.py --tiny                # the suite's smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

GEN = 32
KV_DTYPES = ("bfloat16", "int8")
# (label, llama-bench flags); q8_0 for V needs flash attention in llama.cpp
LLAMA_SETTINGS = (("fa off, f16", ["-fa", "0"]), ("fa on, f16", ["-fa", "1"]),
                  ("fa on, q8_0", ["-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0"]))


def inferd_worker(path: str, depth: int, kv: str, threads: int, gen: int) -> dict:
    """In a fresh process: load as `inferd serve` does, one request of `depth` prompt tokens and `gen`
    tokens after it."""
    import resource

    import torch

    from inferd import LLM
    from inferd.engine.paths import engine_paths
    from inferd.engine.request import SamplingParams
    from inferd.worker.kv_pool import KVPool

    torch.set_num_threads(threads)
    need = depth + gen + 64
    llm = LLM(model=path, quantization="auto", max_model_len=need, threads=threads, kv_cache_dtype=kv,
              kv_cache_memory=f"{max(64, need * 40 // 1024 + 64)}MiB")
    eng = llm.engine
    mc = eng.model.cfg
    g = torch.Generator().manual_seed(depth)
    ids = torch.randint(300, mc.vocab_size - 300, (depth,), generator=g).tolist()
    eng.add_request(ids[:16], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    while eng.has_unfinished():
        eng.step()
    rid = eng.add_request(ids, SamplingParams(max_tokens=gen + 1, temperature=0, ignore_eos=True))
    req = eng.requests[rid]
    blocks = 0
    while eng.has_unfinished():
        eng.step()
        blocks = max(blocks, len(req.block_table))
    t = req.timings
    per_block = KVPool.bytes_per_block(mc.num_hidden_layers, eng.config.block_size, mc.num_key_value_heads,
                                       mc.head_dim, eng.pool.dtype)
    return {"prefill": depth / t.ttft, "decode": gen / (t.token_times[-1] - t.token_times[0]),
            "kv_bytes": blocks * per_block, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "paths": engine_paths(eng)}


def run_inferd(path: str, depth: int, kv: str, threads: int, gen: int, limit_s: float) -> dict | None:
    import llamacpp

    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--depths", str(depth), "--kv", kv,
           "--threads", str(threads), "--gen", str(gen)]
    env = {**llamacpp.llamacpp_env(), "OMP_NUM_THREADS": str(threads)}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode:
        raise RuntimeError(f"inferd worker failed: {(r.stderr or r.stdout).strip().splitlines()[-3:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama_bench(path: str, args: list[str], threads: int, limit_s: float) -> float | None:
    """tok/s of one llama-bench test (one repetition), or None when it ran past limit_s."""
    import llamacpp

    exe = llamacpp.build(("llama-bench",))["llama-bench"]
    cmd = [str(exe), "-m", path, "-t", str(threads), "-r", "1", "-o", "json", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=llamacpp.llamacpp_env(),
                           cwd=str(exe.parent))
    except subprocess.TimeoutExpired:
        return None
    if r.returncode:
        raise RuntimeError(f"llama-bench {' '.join(args)} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "DNF" if x is None else spec.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=GEN)
    ap.add_argument("--dnf-minutes", type=float, default=20.0, help="a run past this is stopped: DNF")
    ap.add_argument("--no-llamacpp", action="store_true", help="inferd only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: the tiny shape, 256 and 512 tokens, inferd only")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="bfloat16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(inferd_worker(args.worker, args.depths[0], args.kv, args.threads, args.gen)))
        return

    from common import check_rows, cpu_features, quiet_machine, tiny_skips, write_json
    from real_sizes import model_file

    if args.tiny:
        args.depths, args.no_llamacpp, args.gen = [256, 512], True, 8
    path = model_file("tiny" if args.tiny else "1b", "Q8_0" if args.tiny else "Q4_K_M")
    limit = args.dnf_minutes * 60
    rows = []
    for depth in args.depths:
        row: dict = {"depth": depth}
        for kv in KV_DTYPES:
            if not args.tiny:  # a smoke run's seconds are not a measurement
                quiet_machine()
            t0 = time.monotonic()
            r = run_inferd(path, depth, kv, args.threads, args.gen, limit)
            row[f"inferd, KV {kv}"] = r
            print(f"[{depth}] inferd, {kv} KV: " + ("DNF" if r is None else
                  f"prefill {r['prefill']:.1f} tok/s, decode {r['decode']:.2f} tok/s, KV {r['kv_bytes'] / 2**20:.0f} MiB")
                  + f" ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        if not args.no_llamacpp:
            for label, flags in LLAMA_SETTINGS:
                quiet_machine()
                pp = run_llama_bench(path, ["-p", str(depth), "-n", "0", *flags], args.threads, limit)
                quiet_machine()
                tg = run_llama_bench(path, ["-p", "0", "-n", str(args.gen), "-d", str(depth), *flags], args.threads,
                                     limit)
                row[f"llama.cpp {label}"] = {"prefill": pp, "decode": tg}
                print(f"[{depth}] llama.cpp {label}: prefill {fmt(pp)} tok/s, decode {fmt(tg, '{:.2f}')} tok/s",
                      file=sys.stderr, flush=True)
        rows.append(row)
    paths = {f"{k} at {r['depth']}": v.pop("paths") for r in rows for k, v in r.items()
             if isinstance(v, dict) and "paths" in v}
    check_rows(paths)
    report(rows, path, args)
    if args.tiny:
        tiny_skips("llama-bench")
    write_json(args.json, {"file": path, "threads": args.threads, "gen": args.gen, "dnf_minutes": args.dnf_minutes},
               rows, paths)
    print(f"CPU: {cpu_features()}")


def report(rows: list[dict], path: str, args) -> None:
    print(f"\nlong contexts: {os.path.basename(path)}, {args.threads} threads, {args.gen} tokens decoded after the "
          f"prompt; one run each, a run past {args.dnf_minutes:.0f} min is DNF")
    hdr = f"{'depth':>6} {'engine, KV':<26}{'prefill tok/s':>14}{'decode tok/s':>14}{'KV MiB':>9}{'peak RSS':>10}"
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        for name, r in row.items():
            if name == "depth":
                continue
            if r is None:
                print(f"{row['depth']:>6} {name:<26}{'DNF':>14}{'DNF':>14}")
                continue
            kv = f"{r['kv_bytes'] / 2**20:.1f}" if "kv_bytes" in r else "-"
            rss = f"{r['peak_rss'] / 2**30:.2f} GiB" if "peak_rss" in r else "-"
            print(f"{row['depth']:>6} {name:<26}{fmt(r['prefill']):>14}{fmt(r['decode'], '{:.2f}'):>14}{kv:>9}{rss:>10}")
        theirs = [r for n, r in row.items() if n.startswith("llama.cpp") and r]
        for what in ("prefill", "decode"):
            best = max((r[what] for r in theirs if r[what] is not None), default=None)
            for kv in KV_DTYPES:
                ours = row.get(f"inferd, KV {kv}")
                if ours and best:
                    print(f"{'':>6} {what} inferd {kv} / llama.cpp's best: {ours[what] / best:.2f}x")
        b, q = row.get("inferd, KV bfloat16"), row.get("inferd, KV int8")
        if b and q:
            print(f"{'':>6} int8 KV bytes / bfloat16's: {q['kv_bytes'] / b['kv_bytes']:.3f}")


if __name__ == "__main__":
    main()

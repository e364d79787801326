"""Batch-1 decode against the memory roofline, beside llama.cpp's tg128 on the same GGUF.

What a decode token costs and where its time goes, in one process at --threads threads:
  - the machine: read bandwidth at 1 and 2 threads as a weight-streaming kernel sees it (each thread
    its own contiguous share, vector loads: csrc/bench/read_bw.c);
  - the file: the bytes one batch-1 token reads (the weights as inferd holds them, the KV cache at the
    context), so the roofline is bandwidth / bytes, in tok/s;
  - each kernel alone: each linear's kernel over every layer's copy (so its bytes come from DRAM, as
    in a step) and the head, on one random row, at 1 and 2 threads, in GB/s and as a share of the
    bandwidth at that thread count (a Python call each: the fused step does not pay it, so a small
    layer's rate here is a lower bound); and, at 1 thread, a ~4 MB slice of one layer called again
    and again ("cached"): the kernel's compute ceiling. A kernel whose DRAM rate is far below both its
    cached rate and the read bandwidth is waiting on memory it did not ask for early enough; one whose
    cached rate is near its DRAM rate is bound by its own instructions;
  - the step: the engine's batch-1 decode tok/s (`inferd serve`'s default load, the fused step) and
    `llama-bench -p 0 -n 128` (tg128), interleaved rounds, medians with min-max, each as a share of
    the roofline; peak resident memory of this process;
  - the step split by op: torch.profiler over --profile-steps decode steps, each op's own time a token
    (the fused step calls every kernel through the dispatcher, which the profiler records); what no op
    accounts for is the engine's own work in Python.

    .venv/bin/python benchmarks/decode_roofline.py --shape 1b          # Llama-3.2-1B-shaped Q4_K_M
    .venv/bin/python benchmarks/decode_roofline.py --shape 3b
    .venv/bin/python benchmarks/decode_roofline.py --model F.gguf --threads 2
    .venv/bin/python benchmarks/decode_roofline.py --tiny              # a smoke run (the suite's)

The shapes' files are real_sizes.py's (random weights in the real shapes, made Q4_K_M by llama.cpp's
own llama-quantize). OpenMP's wait policy is llama.cpp's choice for the machine's load (llamacpp.omp_env),
for both sides alike: it is set before torch loads, by re-running this script with it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

if __name__ == "__main__" and "OMP_WAIT_POLICY" not in os.environ:
    from llamacpp import llamacpp_env

    # (GOMP_SPINCOUNT with it: this process idles while llama-bench runs; llamacpp.omp_env)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], llamacpp_env())

import torch  # noqa: E402

from common import (check_rows, cpu_features, fmt_spread, interleaved, median_seconds, report_header, spread,  # noqa: E402
                    stream_bandwidth_gbs, tiny_skips, write_json)


def held_bytes(mod) -> int:
    return sum(t.numel() * t.element_size() for t in [*mod.buffers(), *mod.parameters()])


def kind(mod) -> str:
    name = type(mod).__name__
    t = getattr(mod, "type", None)  # a GGUF block layer's type name, e.g. "Q4_K"
    return f"{name} {t}" if isinstance(t, str) else name


def leaf_parts(mod) -> list:
    """A FusedParts layer's parts (each its own kernel call), else the layer itself."""
    parts = getattr(mod, "parts", None)
    return list(parts) if parts is not None else [mod]


def per_call_s(fn, reps: int) -> float:
    """Median seconds of one call of fn over `reps` timed calls, after two untimed ones."""
    with torch.inference_mode():
        return median_seconds(fn, reps, warmup=2)


# A slice of a layer this small stays in the caches (L2 + a share of L3 on every machine here) when
# called again and again: its rate is the kernel's compute ceiling, with no DRAM in the way.
CACHED_BYTES = 4 << 20


def cached_slice(part):
    """The first columns of a GGUF block layer, about CACHED_BYTES of its records (a pair of 16-column
    groups' records over all of K are contiguous, so a prefix of the buffer is a narrower layer), or
    None for a kernel whose records cannot be cut so."""
    from inferd.quant.gguf_blocks import BlocksLinear, record_bytes

    if not isinstance(part, BlocksLinear) or part.packed is None:
        return None
    pair = record_bytes(part.type, 32, part.in_features)
    n = min(part.out_features, 32 * max(1, CACHED_BYTES // pair))
    records = part.packed.reshape(-1)[: record_bytes(part.type, n, part.in_features)]
    return BlocksLinear.from_packed(part.type, records, n, part.in_features, None, part.dtype)


def layer_kernels(model) -> list[tuple[str, str, list]]:
    """(linear, kernel, [that part in every layer]) for each kernel call of a layer's linears, and the
    head's: timed as a pass over every layer's copy, so that the bytes come from DRAM as in a step
    (one layer's copy called again and again would stream from the cache)."""
    groups: dict[tuple, list] = {}  # a Q4_K_M file mixes types layer by layer: grouped by kernel and shape
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        for layer in model.layers:
            for p in leaf_parts(getattr(layer, name)):
                groups.setdefault((name, kind(p), p.out_features, p.in_features), []).append(p)
    for p in leaf_parts(model.lm_head):
        groups.setdefault(("lm_head", kind(p), p.out_features, p.in_features), []).append(p)
    return [(name, k, parts) for (name, k, _, _), parts in groups.items()]


def op_split(loaded, prompt: list[int], steps: int, threads: int) -> tuple[float, dict[str, float]]:
    """(ms a step, {op: ms a step}) over `steps` batch-1 decode steps under torch.profiler: each
    inferd op's own time; "engine (python)" is the rest of the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    from inferd.engine.engine import LLMEngine
    from inferd.engine.request import SamplingParams

    torch.set_num_threads(threads)
    eng = LLMEngine(loaded=loaded, kv_cache_memory="256MiB", max_num_seqs=1)
    eng.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    for _ in range(4):  # the prefill and the first decode steps (allocations)
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    ops: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("inferd::") or e.key.startswith("aten::"):
            name = e.key if e.key.startswith("inferd::") else "aten (other torch ops)"
            ops[name] = ops.get(name, 0.0) + e.self_cpu_time_total / 1e3 / steps
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    ops["engine (python)"] = max(wall_ms - sum(ops.values()), 0.0)
    return wall_ms, ops


def main() -> None:
    from inferd.engine.paths import engine_paths
    from inferd.engine.rate import decode_rate
    from inferd.loading.loader import load_model

    import real_sizes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(real_sizes.SHAPES), help="real_sizes.py's shape")
    ap.add_argument("--qtype", default="Q4_K_M", help="the shape's file type (llama-quantize's name)")
    ap.add_argument("--model", default=None, help="a .gguf instead of a shape's file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128, help="tokens a decode run (tg128)")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the decode")
    ap.add_argument("--reps", type=int, default=20, help="timed calls a kernel (median)")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="smoke run: the tiny shape in Q8_0, one round, no llama.cpp")
    ap.add_argument("--lm-head-quantization", default="none", choices=["none", "q4_k", "q5_k"],
                    help="also decode with the output layer rounded to this type (a second load; its own row)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tiny:
        a.shape, a.qtype, a.rounds, a.gen, a.reps, a.profile_steps = "tiny", "Q8_0", 1, 8, 3, 4
    path = a.model or real_sizes.model_file(a.shape, a.qtype)
    big = None if not a.tiny else 8 << 20  # a smoke run measures the cache, in seconds
    bw = {t: stream_bandwidth_gbs(t, size=big) for t in sorted({1, a.threads})}

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = load_model(path, quantization="auto")
    load_s = time.perf_counter() - t0
    model = lm.model
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, model.cfg.vocab_size, (a.context,), generator=g).tolist()
    from common import bytes_per_decode_token

    tok_bytes = bytes_per_decode_token(model, a.context + a.gen // 2)
    roof = bw[a.threads] * 1e9 / tok_bytes

    # each kernel alone, at each thread count
    kernels = []
    for lin, k, parts in layer_kernels(model):
        x = torch.randn(1, parts[0].in_features)
        mb = sum(held_bytes(p) for p in parts) / 1e6
        row = {"linear": lin, "kernel": k, "shape": f"{parts[0].out_features} x {parts[0].in_features}",
               "calls": len(parts), "MB": mb}
        for t in bw:
            torch.set_num_threads(t)
            s = per_call_s(lambda parts=parts, x=x: [p(x) for p in parts], a.reps)
            row[f"GB/s {t}t"] = mb / s / 1e3
            row[f"% bw {t}t"] = 100 * mb / s / 1e3 / bw[t]
        cut = cached_slice(parts[0])
        if cut is not None:
            torch.set_num_threads(1)
            # a call is ~0.1 ms: ten times the passes' repetitions for a steady median
            row["GB/s cached 1t"] = held_bytes(cut) / per_call_s(lambda cut=cut, x=x: cut(x), 10 * a.reps) / 1e9
        kernels.append(row)
    torch.set_num_threads(a.threads)

    paths: dict[str, dict] = {}
    ours_paths: dict = {}
    runners = {"inferd": lambda: decode_rate(lm, prompt, a.gen, 1, warmup=True, paths=ours_paths)}
    head = f"inferd, output layer {a.lm_head_quantization}"
    if a.lm_head_quantization != "none":  # the lower-bit head: a second load, its own interleaved row
        low = load_model(path, quantization="auto", lm_head_quantization=a.lm_head_quantization)
        low_paths: dict = {}
        paths[head] = low_paths
        runners[head] = lambda: decode_rate(low, prompt, a.gen, 1, warmup=True, paths=low_paths)
    llama_note = tiny_skips("llama-bench") if a.tiny else None
    if not a.tiny:
        import llamacpp

        runners["llama.cpp tg128"] = lambda: llamacpp.run_llamacpp(
            lambda: llamacpp.llama_bench(path, threads=a.threads, prompt=0, gen=a.gen, reps=1))[f"tg{a.gen}"]
    runs = interleaved(runners, a.rounds)
    paths["inferd"] = ours_paths
    if not a.tiny:
        info = llamacpp.build_info()
        paths[llamacpp.row_name(info)] = info
        runs[llamacpp.row_name(info)] = runs.pop("llama.cpp tg128")
    check_rows(paths)
    step_ms, split = op_split(lm, prompt, a.profile_steps, a.threads)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB

    setup = {"file": f"{os.path.basename(path)} ({os.path.getsize(path) / 2**30:.2f} GiB)", "threads": a.threads,
             "rounds": f"{a.rounds}, interleaved (inferd, llama.cpp), medians [min-max]",
             "decode": f"batch 1, {a.gen} tokens after a {a.context}-token prompt",
             "read bandwidth": ", ".join(f"{v:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, v in bw.items()),
             "bytes a token": f"{tok_bytes / 1e6:.1f} MB (weights as held, KV at {a.context + a.gen // 2} tokens)",
             "roofline": f"{roof:.1f} tok/s at {a.threads} threads",
             "inferd load": f"{load_s:.1f} s; peak RSS of this process {peak:.2f} GiB"}
    if llama_note:
        setup["skipped"] = llama_note
    report_header(f"batch-1 decode against the memory roofline: {setup['file']}", setup, paths)
    rows = []
    print(f"\n{'engine':44s} {'tok/s':>22s} {'% roofline':>10s} {'vs llama.cpp':>12s}")
    base = next((statistics.median(v) for k, v in runs.items() if k.startswith("llama")), None)
    for label, v in runs.items():
        med = statistics.median(v)
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"{label:44s} {fmt_spread(v):>22s} {100 * med / roof:9.0f}% {ratio:>12s}")
        rows.append({"label": label, "metric": "batch-1 decode tok/s", **spread(v), "runs": v,
                     "roofline_pct": 100 * med / roof})
    print("\neach kernel alone, one row, a pass over every layer's copy (a Python call each)")
    hdr = "".join(f" {'GB/s ' + str(t) + 't':>9s} {'%bw':>4s}" for t in bw)
    print(f"{'linear':13s} {'kernel':24s} {'shape':>15s} {'MB':>7s}{hdr} {'cached 1t':>9s}")
    for r in kernels:
        cells = "".join(f" {r[f'GB/s {t}t']:9.1f} {r[f'% bw {t}t']:4.0f}" for t in bw)
        cached = f"{r['GB/s cached 1t']:9.1f}" if "GB/s cached 1t" in r else f"{'-':>9s}"
        print(f"{r['linear']:13s} {r['kernel']:24s} {r['shape']:>15s} {r['MB']:7.1f}{cells} {cached}")
        rows.append({"label": f"{r['linear']} {r['kernel']}", "metric": "kernel GB/s", **r})
    print(f"\nthe step by op (torch.profiler, {a.profile_steps} steps at {a.threads} threads): {step_ms:.2f} ms a step")
    for op, ms in split.items():
        print(f"  {op:40s} {ms:7.3f} ms {100 * ms / step_ms:5.1f} %")
        rows.append({"label": op, "metric": "ms a decode step", "value": ms})
    write_json(a.json, setup, rows, paths, bandwidth_gbs=bw, bytes_per_token=tok_bytes, op_split_ms=split,
               kernels=kernels)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes, for the default configuration (`--quantization auto`) on a GGUF.

One process, --threads threads:
  - the step: decode tok/s at --batch rows (the engine, fused decode step), median of --rounds;
  - the weights: every linear of the model run alone, in model order, on --batch random rows, grouped
    by kernel (W4A8, W8A8, each GGUF block type), with the bytes each group holds and the rate it
    streams them at, against the machine's measured read bandwidth;
  - the call floor: one tiny native op from Python (the eager path pays it per layer; the fused step
    calls the kernels from C++ and pays only the kernel's own set-up);
  - the rest: step - linears - head (attention, norms, rope, the engine's own work per step).
Linears run from Python here, so their time includes a call floor each that the fused step does not
pay: the "rest" is a lower bound.

Usage: .venv/bin/python benchmarks/decode_breakdown.py [--model F.gguf] [--batch 1] [--threads 2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import cpu_features, read_bandwidth_gbs  # noqa: E402


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


def timed(calls: list, reps: int) -> float:
    """Median seconds of one pass over `calls` (each a zero-argument function)."""
    ts = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for c in calls:
                c()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    from inferd.engine.rate import decode_rate
    from inferd.kernels import native
    from inferd.loading.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded default model)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15, help="passes over the linears (median)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, quantization="auto")
    m, B = lm.model, a.batch
    prompt = lm.tokenizer.encode("The history of the printing press begins in the fifteenth century, when " * 8)[:64]
    rates = [decode_rate(lm, prompt, 128, B, warmup=True) for _ in range(a.rounds)]
    step_ms = 1e3 * B / statistics.median(rates)

    groups: dict[str, list] = {}
    for layer in m.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            x = torch.randn(B, lin.in_features)
            for p in leaf_parts(lin):
                groups.setdefault(kind(p), []).append((p, x))
    head = m.lm_head
    groups["lm_head " + kind(head)] = [(head, torch.randn(B, head.in_features))]
    bw = read_bandwidth_gbs(a.threads)
    ops = native.ops()
    xs, ws = torch.randn(B, m.cfg.hidden_size), torch.ones(m.cfg.hidden_size)
    floor_us = timed([lambda: torch.ops.inferd.rms_norm(xs, ws, 1e-5)] * 1000, 5) * 1e3

    print(f"\n{cpu_features()}")
    print(f"where a decode step goes: {os.path.basename(a.model or 'smollm2-135m (default)')}, --quantization auto, "
          f"batch {B}, {a.threads} threads, kernels {ops.isa() if ops is not None else 'none'}")
    print(f"  step: {step_ms:.2f} ms ({statistics.median(rates):.1f} tok/s; runs {', '.join(f'{r:.1f}' for r in rates)})")
    print(f"  read bandwidth measured here: {bw:.1f} GB/s; one tiny native op from Python: {floor_us:.1f} us")
    print(f"{'kernel':24s} {'calls':>5s} {'MB':>7s} {'ms':>7s} {'GB/s':>6s} {'% bw':>5s} {'% step':>6s}")
    total = 0.0
    for k, calls in groups.items():
        sec = timed([(lambda mod=mod, x=x: mod(x)) for mod, x in calls], a.reps)
        mb = sum(held_bytes(mod) for mod, _ in calls) / 1e6
        total += sec * 1e3
        print(f"{k:24s} {len(calls):5d} {mb:7.1f} {sec * 1e3:7.2f} {mb / sec / 1e3:6.1f} "
              f"{100 * mb / sec / 1e3 / bw:5.0f} {100 * sec * 1e3 / step_ms:6.0f}")
    print(f"{'linears + head':24s} {'':5s} {'':7s} {total:7.2f} {'':6s} {'':5s} {100 * total / step_ms:6.0f}")
    print(f"{'the rest (lower bound)':24s} {'':5s} {'':7s} {step_ms - total:7.2f} {'':6s} {'':5s} "
          f"{100 * (step_ms - total) / step_ms:6.0f}")


if __name__ == "__main__":
    main()

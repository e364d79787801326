"""GGUF tensors into the kernels' records and into float32 rows: the native ops (csrc/cpu/repack.cpp)
against the Python route they replace.

Tensors of an 8B model's shapes, made of random bytes with valid fp16 scales (the ops' speed does
not depend on the values): a 14336 x 4096 Q4_K (an MLP projection) and the 128256 x 4096 Q6_K output
layer. For each, best of --reps calls on --threads threads:
  - repack native:    torch.ops.inferd.repack_blocks (GB/s of the file's bytes in)
  - repack python:    gguf_blocks.pack(gguf_blocks.decode(...)) on the first --python-rows rows (it holds
                      int32 [N, K] codes and permuted copies: the whole output layer would take minutes
                      and gigabytes), scaled by bytes
  - dequant native:   torch.ops.inferd.dequant_rows over every row (GB/s of float32 out)
  - dequant gguf:     gguf.quants.dequantize on --python-rows rows
  - embedding step:   dequant_rows of 1 and 64 random ids (microseconds a call)
Beside each native rate, the bytes a CPU-second moves (CPU time of all threads): on a shared
machine the wall time counts the waits for a core, the CPU time does not.
and the W4A8/W8A8 repacks (Q4_0, Q8_0) of the MLP shape. The header prints the CPU, the threads and
the load average.

Usage: .venv/bin/python benchmarks/gguf_repack.py [--threads 2] [--reps 3] [--python-rows 1024] [--small]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import cpu_features  # noqa: E402
from inferd.kernels import native  # noqa: E402
from inferd.quant import gguf_blocks as GB  # noqa: E402

SCALES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q4_0": (0,), "Q8_0": (0,)}
GGML = {"Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34)}


def random_tensor(type_name: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """Random blocks with finite fp16 scales, [N, row bytes]."""
    _, weights, nbytes = GGML[type_name]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (N, K // weights, nbytes), dtype=torch.uint8, generator=g)
    for at in SCALES[type_name]:
        d = (torch.rand(N, K // weights, 1, generator=g) * 0.02 + 1e-3).half()
        raw[..., at:at + 2] = d.view(torch.uint8).view(N, K // weights, 2)
    return raw.view(N, -1)


CPU = {}  # the last best() call's least CPU time (all threads), beside its least wall time


def best(fn, reps: int) -> float:
    """The least wall time of `reps` calls after one warm-up; CPU["s"]: the least CPU time of them
    (on a shared machine the wall time includes waiting for a core; CPU time does not)."""
    fn()
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    CPU["s"] = min(cpu)
    return min(times)


def per_cpu(nbytes: int) -> str:
    return f"{nbytes / CPU['s'] / 1e9:6.2f} GB/s a CPU-second" if CPU["s"] > 0 else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--python-rows", type=int, default=1024)
    ap.add_argument("--small", action="store_true", help="a quarter of each shape's rows")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    assert native.load() is not None, "native kernels unavailable"
    ops = torch.ops.inferd
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    print(f"# CPU: {cpu_features()}; threads {a.threads}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
          f" on {os.cpu_count()} CPUs (a shared machine: wall times move with the neighbours)")
    shapes = [("Q4_K", 14336, 4096), ("Q6_K", 128256, 4096)]
    for type_name, N, K in shapes:
        N = N // 4 if a.small else N
        raw = random_tensor(type_name, N, K)
        gt = GGML[type_name][0]
        mb = raw.numel() / 1e6
        t = best(lambda: ops.repack_blocks([raw], [None], GB.FORMATS[type_name].id), a.reps)
        print(f"{type_name} {N} x {K} ({mb:.0f} MB): repack native  {raw.numel() / t / 1e9:6.2f} GB/s in  "
              f"({t * 1e3:.0f} ms; {per_cpu(raw.numel())})")
        part = raw[:a.python_rows].numpy()
        t = best(lambda: GB.pack(GB.decode(type_name, part)), 1)
        print(f"{type_name} {N} x {K}: repack python  {part.nbytes / t / 1e9:6.3f} GB/s in  "
              f"(first {len(part)} rows; the whole tensor ~{t * N / len(part):.1f} s)")
        ids = torch.arange(N)
        t = best(lambda: ops.dequant_rows(raw, ids, gt), a.reps)
        print(f"{type_name} {N} x {K}: dequant native {N * K * 4 / t / 1e9:6.2f} GB/s out ({t * 1e3:.0f} ms; "
              f"{per_cpu(N * K * 4)})")
        t = best(lambda: dequantize(part, Q(gt)), 1)
        print(f"{type_name} {N} x {K}: dequant gguf   {len(part) * K * 4 / t / 1e9:6.3f} GB/s out (first {len(part)} rows)")
        for n in (1, 64):
            few = torch.randint(0, N, (n,))
            t = best(lambda: ops.dequant_rows(raw, few, gt), 20)
            print(f"{type_name} {N} x {K}: dequant {n:2d} ids  {t * 1e6:7.1f} us")
        del raw
    N, K = 14336 // (4 if a.small else 1), 4096
    for type_name, op in (("Q4_0", lambda r: ops.repack_w4a8([r], [None], 2)), ("Q8_0", lambda r: ops.repack_w8a8([r], [None]))):
        raw = random_tensor(type_name, N, K)
        t = best(lambda: op(raw), a.reps)
        print(f"{type_name} {N} x {K}: repack {'w4a8' if type_name == 'Q4_0' else 'w8a8'}    "
              f"{raw.numel() / t / 1e9:6.2f} GB/s in  ({t * 1e3:.0f} ms; {per_cpu(raw.numel())})")


if __name__ == "__main__":
    main()

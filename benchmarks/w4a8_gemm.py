"""One quantized layer at every batch size: the W4A8/W8A8 kernels against what they replace.

For each layer shape of the default model (qkv 960x576, gate_up 3072x576, down 576x1536, the
lm_head 49152x576) and M = 1 .. 512 rows, in one process, 2 threads, median of --reps calls:
  - w4a8 kernel:  torch.ops.inferd.w4a8_linear (int4 codes packed in 16-column groups x int8 rows)
  - old route:    what M > 64 rows ran before this kernel: round x, dequantize the layer to fp32, one GEMM
  - w8a8 kernel:  the same shape with int8 codes (one scale per 32-block, Q8_0's form)
  - dense fp32:   x @ W.t() on the dequantized weights (PyTorch's GEMM, oneDNN/MKL)
  - int8 peak:    torch._int_mm (oneDNN's s8 x s8 -> s32 GEMM, no scales) on the same shape: the
                  machine's int8 GEMM rate as the best library here reaches it (a few GOP/s on an
                  AVX2-only CPU, where oneDNN has no int8 kernel: the header's instruction peak,
                  common.int8_peak_gops, is the ceiling there)
printed as ms and G(FL)OP/s (2*M*N*K), with the kernel variant and CPU features in the header.

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): each shape cut
to at most 128 x 64, M = 1 and 32, 1 call a cell.

Usage: .venv/bin/python benchmarks/w4a8_gemm.py [--threads 2] [--reps 5] [--json F] [--tiny]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import check_rows, int8_peak_gops, median_seconds as timed, report_header, write_json  # noqa: E402
from inferd.kernels import native  # noqa: E402
from inferd.quant import quantize_int4, quantize_int8, w4a8  # noqa: E402

SHAPES = [("qkv", 960, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
ROWS = [1, 8, 16, 32, 64, 128, 512]
COLUMNS = {"k4": "w4a8 kernel", "old": "old route", "k8": "w8a8 kernel", "fp32": "dense fp32",
           "i8": "int8 peak (torch._int_mm)"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): shapes at most 128 x 64, "
                         "M = 1 and 32, 1 call a cell")
    a = ap.parse_args()
    shapes, rows_m, peak_s = SHAPES, ROWS, 0.5
    if a.tiny:
        shapes, rows_m, peak_s, a.reps = [(n, min(N, 128), min(K, 64)) for n, N, K in SHAPES], [1, 32], 0.05, 1
    torch.set_num_threads(a.threads)
    assert native.load() is not None, "native kernels unavailable"
    ops = torch.ops.inferd
    # what ran: these rows call the native kernels directly (no engine), so the variant is the record
    paths = {f"{k} kernel": {"engine": "inferd kernels", "kernel_variant": str(ops.isa()),
                             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "weight_formats": {cls: 1}, "dtype": "float32"}
             for k, cls in (("w4a8", "W4A8Linear"), ("w8a8", "W8A8Linear"))}
    check_rows(paths)
    setup = {"threads": a.threads, "reps": f"median of {a.reps} calls a cell (after one warm-up call)",
             "shapes": ", ".join(f"{n} {N}x{K}" for n, N, K in shapes), "rows": ", ".join(map(str, rows_m))}
    report_header("one quantized layer at every batch size: ms (G(FL)OP/s)", setup, paths)
    isa, peak = int8_peak_gops(a.threads, peak_s)
    print(f"int8 dot-product instruction peak here ({isa}, {a.threads} threads, no memory traffic): {peak:.0f} GOP/s")
    print(f"{'layer':<8} {'N x K':>11} {'M':>4} {'w4a8 kernel':>17} {'old route':>17} {'w8a8 kernel':>17} "
          f"{'dense fp32':>17} {'int8 peak':>17} {'w4a8/fp32':>9} {'w8a8/fp32':>9}")
    rows = []
    for name, N, K in shapes:
        torch.manual_seed(0)
        q, s, z = quantize_int4(torch.randn(N, K), 32)
        lin = w4a8.W4A8Linear(q, s, z, 32, None, torch.float32)
        lin8 = w4a8.W8A8Linear(*quantize_int8(torch.randn(N, K)), None, torch.float32)
        dense = lin.dequantized()
        w8 = torch.randint(-127, 128, (K, N), dtype=torch.int8).t().contiguous().t()
        for M in rows_m:
            x = torch.randn(M, K)
            x8 = torch.randint(-127, 128, (M, K), dtype=torch.int8)
            t = {
                "k4": timed(lambda: lin(x), a.reps),
                "old": timed(lambda: w4a8.fake_quant_activations(x) @ lin.dequantized().t(), a.reps),
                "k8": timed(lambda: lin8(x), a.reps),
                "fp32": timed(lambda: x @ dense.t(), a.reps),
                "i8": timed(lambda: torch._int_mm(x8, w8), a.reps) if M > 16 else float("nan"),
            }
            g = 2 * M * N * K / 1e9
            cell = {k: f"{v * 1e3:8.3f} ({g / v:5.1f})" if v == v else "-" for k, v in t.items()}
            print(f"{name:<8} {f'{N}x{K}':>11} {M:>4} {cell['k4']:>17} {cell['old']:>17} {cell['k8']:>17} "
                  f"{cell['fp32']:>17} {cell['i8']:>17} {t['fp32'] / t['k4']:>8.2f}x {t['fp32'] / t['k8']:>8.2f}x")
            rows += [{"label": f"{COLUMNS[k]}, {name}", "shape": [N, K], "M": M, "metric": "ms", "median": v * 1e3,
                      "gops": g / v} for k, v in t.items() if v == v]
    write_json(a.json, setup, rows, paths, int8_instruction_peak={"isa": isa, "gops": peak})


if __name__ == "__main__":
    main()

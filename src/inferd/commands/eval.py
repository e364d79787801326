"""`inferd eval`: the quality of quantized configurations beside their speed (inferd.eval)."""
from __future__ import annotations

import json
import os
import sys

import torch

from inferd.errors import InferdError
from inferd.eval import format_table, plot_speed_vs_kl, run_eval, split_config
from inferd.quant import METHODS


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [c.strip() for c in args.quantization.split(",") if c.strip()]
    for c in configs:
        base, a8 = split_config(c)
        if base not in METHODS:
            raise InferdError(f"unknown quantization {c!r} (choose {', '.join(METHODS)}; each but none also "
                              "as +a8: int8 activations, the W4A8/W8A8 kernels)")
        if a8 and base in ("none", "auto"):
            raise InferdError(f"{c}: +a8 applies to quantized weights (auto picks its own; int4, int4-gptq, gguf, awq; int8, int8-gptq)")
    kv_dtypes = [k.strip() for k in args.kv_cache_dtype.split(",") if k.strip()] or ["auto"]
    from inferd.worker.kv_pool import kv_cache_dtype

    for k in kv_dtypes:
        kv_cache_dtype(k, torch.float32)  # an unknown name, or fp8: one line now, not after the reference
    heads = [h.strip().lower() for h in args.lm_head_quantization.split(",") if h.strip()] or ["none"]
    from inferd.quant.kquants import HEAD_TYPES

    for h in heads:
        if h != "none" and h not in HEAD_TYPES:
            raise InferdError(f"--lm-head-quantization {h!r}: choose none, {', '.join(HEAD_TYPES)}")
    if heads != ["none"]:
        if len(kv_dtypes) > 1:
            raise InferdError("--lm-head-quantization and --kv-cache-dtype: one list at a time")
        bad = [c for c in configs if split_config(c)[0] not in ("auto", "gguf")]
        if bad:
            raise InferdError(f"--lm-head-quantization rounds a GGUF's output layer served from its blocks: "
                              f"{', '.join(bad)} is not auto or gguf")
    if args.ctx < 2 or args.windows < 1:
        raise InferdError("--ctx must be >= 2 and --windows >= 1")
    if args.plot and not args.speed:
        raise InferdError("--plot needs the speed columns; drop --no-speed")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise InferdError(f"--plot: no such directory {os.path.dirname(os.path.abspath(args.plot))}")
    if args.awq_path and "awq" not in configs:
        raise InferdError("--awq-path is for the awq configuration: add awq to --quantization")
    res = run_eval(args.model, configs, args.quant_group_size, args.ctx, args.windows, args.dtype,
                   args.quantize_lm_head, args.speed, args.dataset_path, speed_dtype=args.speed_dtype,
                   awq_path=args.awq_path, kv_dtypes=kv_dtypes, heads=heads,
                   progress=lambda i, n: sys.stderr.write(f"\rwindow {i}/{n}") or sys.stderr.flush())
    sys.stderr.write("\n")
    print(format_table(res))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(res, f, indent=2)
    if args.plot:
        plot_speed_vs_kl(res, args.plot)
    return 0

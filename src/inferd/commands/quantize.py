"""`inferd quantize --method awq`: calibrate, search, write a Hugging Face AWQ folder."""
from __future__ import annotations

import os
import sys

import torch

from inferd.errors import InferdError
from inferd.loading.loader import awq_model
from inferd.quant.calibrate import LINEARS


def run(args) -> int:
    from inferd.quant.awq_checkpoint import save_awq

    if args.threads:
        torch.set_num_threads(args.threads)
    out = os.path.expanduser(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise InferdError(f"output folder {out} exists and is not empty")
    if args.calib_samples < 1 or args.calib_seqlen < 2 or args.grid < 1:
        raise InferdError("--calib-samples must be >= 1, --calib-seqlen >= 2 and --grid >= 1")

    def progress(i, n):
        sys.stderr.write(f"\rAWQ: layer {i}/{n}")
        sys.stderr.flush()

    # the codes do not depend on the serving dtype; keep fp32 so the float tensors are not rounded twice
    lm, res = awq_model(args.model, args.group_size, "float32", args.calib, args.calib_samples, args.calib_seqlen,
                        args.grid, args.clip, progress)
    sys.stderr.write("\n")
    extra = {"calibration": f"{args.calib}: {args.calib_samples} x {args.calib_seqlen} tokens"}
    save_awq(out, lm.model, res.codes, args.group_size, lm.tokenizer, lm.source, extra)
    print(res.summary())
    worse = [(i, n) for i, r in enumerate(res.reports) for n in LINEARS if r.awq[n] >= r.rtn[n]]
    mean = lambda d: sum(r.__dict__[d][n] for r in res.reports for n in LINEARS) / (len(res.reports) * len(LINEARS))  # noqa: E731
    print(f"relative output error on the calibration text, mean over linears: round-to-nearest {mean('rtn'):.3e}, "
          f"AWQ {mean('awq'):.3e}; {len(worse)} of {len(res.reports) * len(LINEARS)} linears not improved")
    print(f"calibrated on {res.tokens} tokens in {res.seconds:.0f} s; wrote {out}")
    return 0

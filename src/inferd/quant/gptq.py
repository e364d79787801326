"""GPTQ rounding for the int8 and int4 formats: same packed layouts, better codes.

Round-to-nearest treats every weight alone. A layer's output error is D X^T for a weight error D and
inputs X, so what matters is sum_n D_n H D_n^T with H = X^T X (accumulated on calibration text):
errors along directions the inputs rarely take are cheap, errors on high-energy input channels are
dear. GPTQ (Frantar et al., 2022) rounds one input column at a time and pushes that column's
rounding error onto the columns not yet rounded, along the inverse Hessian, so later roundings cancel
it. Columns go in order of decreasing H diagonal ("act order"): the heavy channels are rounded while
the most columns remain to absorb their error.

The result is an ordinary Int8Linear (symmetric, one scale per output row, the scale RTN would pick)
or Int4Linear (asymmetric groups, scale and min from each group's min/max, fixed before the pass so
act order cannot scramble them): only which integer each weight gets changes. Nothing changes at run
time; the cost is a calibration pass at load (`--quantization int8-gptq`).

On SmolLM2-135M, per-channel int8 by round-to-nearest flips ~3.5 % of top-1 predictions (every
linear's relative error is ~1 %, and the model is that sensitive); GPTQ halves the KL divergence.
"""
from __future__ import annotations

import time

import torch

from inferd.errors import InferdError

DEFAULT_SAMPLES, DEFAULT_SEQLEN = 16, 512


def gptq_round(w: torch.Tensor, h: torch.Tensor, quant_col, damp: float = 0.01, block: int = 128):
    """w [N, K], h [K, K]; quant_col(column [N], index k) -> (dequantized [N], code [N]).
    Returns the codes [N, K] (int32), chosen column by column with error feedback."""
    w = w.float().clone()
    N, K = w.shape
    h = h.float().clone()
    dead = torch.diag(h) == 0  # inputs that are always zero: their weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(K)
    # the upper Cholesky factor of H^-1 holds, row by row, the update directions GPTQ needs
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(N, K, dtype=torch.int32)
    for a in range(0, K, block):
        b = min(a + block, K)
        w1, err, hi = w[:, a:b].clone(), torch.zeros(N, b - a), hinv[a:b, a:b]
        for j in range(b - a):
            deq, code = quant_col(w1[:, j], int(perm[a + j]))
            codes[:, perm[a + j]] = code.to(torch.int32)
            e = (w1[:, j] - deq) / hi[j, j]
            w1[:, j:] -= e[:, None] * hi[j, j:][None, :]
            err[:, j] = e
        w[:, b:] -= err @ hinv[a:b, b:]  # the whole block's feedback onto later columns in one product
    return codes


def gptq_int8(w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 codes [N, K] (int8) and scales [N] (the round-to-nearest scales)."""
    scale = (w.float().abs().amax(1) / 127).clamp(min=1e-12)

    def col(x, _k):
        q = torch.round(x / scale).clamp(-127, 127)
        return q * scale, q

    return gptq_round(w, h, col).to(torch.int8), scale


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group_size: int):
    """Group-wise asymmetric int4 codes (0..15) with scale and min [N, K / group] in inferd's int4
    form (w ~= q * scale + min), the groups' min/max fixed from the unrounded weights."""
    from inferd.quant.linear import int4_grid

    _, scale, lo = int4_grid(w, group_size)

    def col(x, k):
        s, l0 = scale[:, k // group_size], lo[:, k // group_size]
        q = torch.round((x - l0) / s).clamp(0, 15)
        return q * s + l0, q

    return gptq_round(w, h, col).to(torch.uint8), scale, lo


def collect_hessians(model, calib: list[list[int]], progress=None) -> dict:
    """H = E[x^T x] of every fused linear's inputs, layer by layer on the unquantized model (each
    layer sees full-precision inputs, as in AWQ's calibration)."""
    from inferd.quant.calibrate import LINEARS, causal_attention, collect_stats

    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise InferdError("GPTQ calibration runs on an fp32 CPU model")
    seqlen = max(len(c) for c in calib)
    cos, sin = model.rope.cos_sin(torch.arange(seqlen))
    attn = causal_attention(model.cfg.head_dim ** -0.5)
    hs = {}
    with torch.inference_mode():
        hidden = [model.embed_tokens(torch.tensor(c)) for c in calib]
        for i, layer in enumerate(model.layers):
            stats, hidden = collect_stats(layer, hidden, cos, sin, attn)
            hs.update({(i, n): stats[n].hessian for n in LINEARS})
            if progress:
                progress(i + 1, len(model.layers))
    return hs


def gptq_codes(calib_model, calib: list[list[int]], method: str, group_size: int = 32, progress=None):
    """GPTQ codes of every fused linear of the fp32 `calib_model`: ({(layer, name): codes}, report)."""
    from inferd.quant.calibrate import output_error
    from inferd.quant.linear import dequantize_int4, quantize_int4, quantize_int8

    if method not in ("int8", "int4"):
        raise InferdError(f"GPTQ rounds to int8 or int4, not {method}")
    t0 = time.perf_counter()
    hs = collect_hessians(calib_model, calib, progress)
    codes, err_rtn, err_gptq = {}, 0.0, 0.0
    for (i, n), h in hs.items():
        w = getattr(calib_model.layers[i], n).weight.detach().float()
        if method == "int8":
            q, s = gptq_int8(w, h)
            codes[(i, n)] = (q, s)
            deq = q.float() * s[:, None]
            q0, s0 = quantize_int8(w, block=None)  # round-to-nearest in GPTQ's own format: per row
            rtn = q0.float() * s0[:, None]
        else:
            codes[(i, n)] = gptq_int4(w, h, group_size)
            deq = dequantize_int4(*codes[(i, n)], group_size)
            rtn = dequantize_int4(*quantize_int4(w, group_size), group_size)
        ref = output_error(w, h)
        err_rtn += output_error(rtn - w, h) / ref
        err_gptq += output_error(deq - w, h) / ref
    k = len(hs)
    return codes, {"linears": k, "tokens": sum(len(c) for c in calib), "seconds": time.perf_counter() - t0,
                   "rel_output_error_rtn": err_rtn / k, "rel_output_error_gptq": err_gptq / k}


def attach_codes(target, codes: dict, method: str, group_size: int = 32, dense: bool = False) -> None:
    """Swap `target`'s fused linears for int8/int4 modules holding the codes (in its dtype)."""
    from inferd.quant.linear import Int4Linear, Int8Linear

    if target.device.type != "cpu":
        raise InferdError("int8/int4 kernels are CPU-only in this build")
    for (i, n), c in codes.items():
        lin = getattr(target.layers[i], n)
        new = (Int8Linear(*c, lin.bias, target.dtype, dense) if method == "int8"
               else Int4Linear(*c, group_size, lin.bias, target.dtype, dense))
        setattr(target.layers[i], n, new)


def gptq_quantize(target, calib_model, calib: list[list[int]], method: str, group_size: int = 32,
                  dense: bool = False, progress=None) -> dict:
    """Rewrite `target`'s fused linears to `method` ("int8" or "int4") with GPTQ codes computed from
    the fp32 `calib_model` (the same weights; may be `target` itself). Returns a small report."""
    if target.device.type != "cpu":
        raise InferdError("int8/int4 kernels are CPU-only in this build")
    codes, rep = gptq_codes(calib_model, calib, method, group_size, progress)
    attach_codes(target, codes, method, group_size, dense)
    return rep


_CODES: dict = {}  # (weights, method, group) -> (codes, report): a process calibrates once per model


def apply(model, ctx) -> str:
    """The registry's entry for `int8-gptq` / `int4-gptq`: codes from a calibration pass on an fp32
    copy (the serving model may be bf16), kept for the rest of the process."""
    import sys

    from inferd.quant.rtn import quantize_lm_head_int8

    method = ctx.method[:4]
    if model.device.type != "cpu":
        raise InferdError(f"{method} kernels are CPU-only in this build")
    key = (*ctx.cache_key, method, ctx.group_size)
    if key not in _CODES:
        if ctx.calibration is None:
            raise InferdError(f"{method}-gptq calibrates on WikiText-2 and needs the model's tokenizer")
        calib = ctx.calibration(DEFAULT_SAMPLES, min(DEFAULT_SEQLEN, ctx.config.max_position_embeddings))

        def progress(i, n):
            sys.stderr.write(f"\rGPTQ calibration: layer {i}/{n}" + ("\n" if i == n else ""))
            sys.stderr.flush()

        _CODES[key] = gptq_codes(ctx.fp32_model(), calib, method, ctx.group_size, progress)
    codes, rep = _CODES[key]
    attach_codes(model, codes, method, ctx.group_size, ctx.dense)
    if ctx.lm_head:
        quantize_lm_head_int8(model, ctx.dense)
    return (f"{method}-gptq (group {ctx.group_size}{', lm_head int8 RTN' if ctx.lm_head else ''}): {rep['linears']} "
            f"linears on {rep['tokens']} calibration tokens in {rep['seconds']:.0f} s; relative output error "
            f"{rep['rel_output_error_gptq']:.2e} (round-to-nearest {rep['rel_output_error_rtn']:.2e})")

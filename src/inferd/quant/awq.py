"""AWQ (activation-aware weight quantization) to int4, on CPU.

Round-to-nearest spends the same 4 bits on every input channel, yet a few channels carry much
larger activations than the rest and dominate each layer's output error. AWQ multiplies those
columns of W by s > 1 before rounding (their relative rounding error shrinks) and divides the
activations by s, folding 1/s into whatever produced them so no extra work happens at run time:

    qkv_proj      <- input_layernorm.weight     (one vector for q, k and v: they share the norm)
    gate_up_proj  <- post_attention_layernorm   (likewise for gate and up)
    down_proj     <- the up_proj rows           (silu(gate) * up is linear in up)
    o_proj        <- the v_proj rows            (attention output is linear in v; with GQA one
                                                 v row feeds several query heads, so the scale is
                                                 tied across the query heads of a kv head)

s = mean|x|^alpha, alpha picked on a grid, then per group a clipping range (shrink of min/max) and
an integer grid for it; all minimise the layer's output error on calibration text.

All errors are computed from second moments: for a weight error D [out, in] and inputs X [T, in],
||X D^T||^2 / T = sum_n D_n H D_n^T with H = X^T X / T. H is accumulated once over every
calibration token, so the search costs a few [out, in] x [in, in] products per grid point
instead of a pass over the tokens.

Each layer is calibrated on full-precision inputs: the hidden states fed to layer i come from the
unquantized layers before it (as the original AWQ does), which keeps the layers' searches
independent of one another.

The codes use integer zero points and fp16 scales, the Hugging Face AWQ layout, so what is
searched is exactly what `awq_checkpoint.save_awq` writes and the loader reads back.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from inferd.errors import InferdError
from inferd.quant.awq_checkpoint import dequantize, to_affine_int4
from inferd.quant.calibrate import LINEARS, causal_attention, collect_stats, output_error
from inferd.quant.linear import dequantize_int4, quantize_int4

KERNEL_GROUPS = (32, 64, 128, 256)


# -- the int4 grid with integer zero points ----------------------------------------------------------

def int_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the smallest step s (fp16-representable) and integer zero z in 0..15 whose grid
    {(q - z) s : q = 0..15} covers [lo, hi] (lo <= 0 <= hi). Rounding the zero of a min/max grid
    instead would clip up to half a step at one end.

    The step needed for a zero z is max(-lo / z, hi / (15 - z)): one term falls with z, the other
    rises, so the best integer z is next to where they cross, z* = 15 (-lo) / (hi - lo)."""
    span = (hi - lo).clamp(min=1e-30)
    zc = (15 * -lo / span).clamp(0, 15)
    best_s, best_z = None, None
    for z in (zc.floor(), zc.ceil()):
        below = torch.where(z > 0, -lo / z.clamp(min=1), torch.where(lo < 0, math.inf, 0.0))
        above = torch.where(z < 15, hi / (15 - z).clamp(min=1), torch.where(hi > 0, math.inf, 0.0))
        step = torch.maximum(below, above)
        if best_s is None:
            best_s, best_z = step, z
        else:
            take = step < best_s
            best_s, best_z = torch.where(take, step, best_s), torch.where(take, z, best_z)
    s = best_s.clamp(min=2.0**-14, max=60000.0).half().float()
    return s, best_z.to(torch.int32)


def quantize_groups(w: torch.Tensor, group_size: int, lo=None, hi=None):
    """[N, K] -> codes q int32 [N, K], zeros z int32 [N, K/G], scales fp16 [N, K/G], with
    w ~= (q - z) * s; [lo, hi] per group defaults to the group's min and max."""
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)
    if lo is None:
        lo, hi = g.amin(-1), g.amax(-1)
    s, z = int_grid(lo.clamp(max=0), hi.clamp(min=0))
    q = (torch.round(g / s[..., None]) + z[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), z, s.half()


def fake_quant(w: torch.Tensor, group_size: int, lo=None, hi=None) -> torch.Tensor:
    """quantize_groups then dequantize, in one pass: clamp(round(w / s), -z, 15 - z) * s."""
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)
    if lo is None:
        lo, hi = g.amin(-1), g.amax(-1)
    s, z = int_grid(lo.clamp(max=0), hi.clamp(min=0))
    s, zf = s[..., None], z[..., None].float()
    return torch.clamp(torch.round(g / s), -zf, 15 - zf).mul_(s).reshape(N, K)


# -- the searches ---------------------------------------------------------------------------

def candidate_grids(lo: torch.Tensor, hi: torch.Tensor):
    """Integer grids (s, z) worth trying for a group spanning [lo, hi]: the covering one, and the
    min/max step (hi - lo) / 15 with the zero rounded down or up -- a finer step that clips up to
    one step at one end. Which wins depends on where the group's weights and activations sit."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    yield int_grid(lo, hi)
    s = ((hi - lo) / 15).clamp(min=2.0**-14, max=60000.0).half().float()
    zc = (-lo / s).clamp(0, 15)
    yield s, zc.floor().to(torch.int32)
    yield s, zc.ceil().to(torch.int32)


def block_diagonal(h: torch.Tensor, group_size: int) -> torch.Tensor:
    ng = h.shape[0] // group_size
    return torch.stack([h[j * group_size:(j + 1) * group_size, j * group_size:(j + 1) * group_size]
                        for j in range(ng)])


def search_codes(w: torch.Tensor, h: torch.Tensor, group_size: int, shrinks=(1.0,)):
    """Codes for W [N, K]: per (row, group), of every candidate grid of the range [f lo, f hi]
    (f in `shrinks`: clipping), the one with the least output error. Groups are independent given
    the block diagonal of H, so each takes its own grid. Returns (q, z, s fp16) as quantize_groups."""
    N, K = w.shape
    ng = K // group_size
    g = w.float().reshape(N, ng, group_size)
    hb = block_diagonal(h, group_size)
    lo0, hi0 = g.amin(-1), g.amax(-1)
    best = torch.full((N, ng), math.inf)
    best_s, best_z = torch.ones(N, ng), torch.zeros(N, ng, dtype=torch.int32)
    for f in shrinks:
        for s, z in candidate_grids(lo0 * f, hi0 * f):
            zf = z[..., None].float()
            d = (torch.clamp(torch.round(g / s[..., None]), -zf, 15 - zf) * s[..., None] - g).transpose(0, 1)
            err = (torch.bmm(d, hb) * d).sum(-1).t()
            take = err < best
            best = torch.where(take, err, best)
            best_s, best_z = torch.where(take, s, best_s), torch.where(take, z, best_z)
    q = (torch.round(g / best_s[..., None]) + best_z[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), best_z, best_s.half()


def search_scale(w: torch.Tensor, h: torch.Tensor, x_mean: torch.Tensor, group_size: int,
                 grid: int = 20) -> tuple[torch.Tensor, float]:
    """Per-input-channel scale s (folded out of the activations) minimising the output error of
    Q(W diag(s)) diag(1/s) against W. alpha = 0 (s = 1, plain rounding) is on the grid, so the
    result is never worse than that."""
    best_err, best_s = math.inf, torch.ones_like(x_mean)
    xm = x_mean.float().clamp(min=1e-6)
    for i in range(grid + 1):
        a = i / grid
        s = xm.pow(a).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 so neither end leaves fp16
        # the plain covering grid here: trying every grid per alpha would triple the search for a
        # choice the final search_codes makes anyway
        err = output_error(fake_quant(w * s, group_size) / s - w, h)
        if err < best_err:
            best_err, best_s = err, s
    return best_s, best_err


def clip_shrinks(grid: int = 20, max_shrink: float = 0.5) -> list[float]:
    """1, 1 - 1/grid, ... while the shrink stays under max_shrink (AWQ's clipping grid)."""
    return [1 - i / grid for i in range(max(1, int(max_shrink * grid)))]


# -- one layer --------------------------------------------------------------------------------

@dataclass
class LayerReport:
    rtn: dict = field(default_factory=dict)  # relative output error of round-to-nearest int4
    awq: dict = field(default_factory=dict)  # ... of the AWQ codes
    alpha_scale: dict = field(default_factory=dict)  # max/min of each scale vector


def _fold_into_norm(norm, s: torch.Tensor) -> torch.Tensor:
    """norm.weight /= s, stored in fp16 as the checkpoint will hold it; returns the scale actually
    realised (norm_old / norm_new) so the weights are multiplied by exactly that."""
    old = norm.weight.detach().float()
    new = (old / s).half().float()
    eff = torch.where(new != 0, old / new, s)
    norm.weight.data.copy_(new.to(norm.weight.dtype))
    return eff


def quantize_layer(layer, stats: dict, cfg, group_size: int, grid: int = 20, clip: bool = True,
                   clip_grid: int = 20) -> tuple[dict, LayerReport]:
    """AWQ one decoder layer in place (norm weights, v/up rows and bias); returns its codes
    {name: (q, z, s)} for the fused linears and the error report."""
    hd, nq, nk, ff = layer.head_dim, layer.n_heads, layer.n_kv, layer.ff
    w0 = {n: getattr(layer, n).weight.detach().float().clone() for n in LINEARS}
    h0 = {n: stats[n].hessian for n in LINEARS}
    xm = {n: stats[n].mean_abs for n in LINEARS}
    rep = LayerReport()

    xm_o = xm["o_proj"].view(nk, nq // nk, hd).mean(1)  # tie the query heads of each kv head
    xm["o_proj"] = xm_o.repeat_interleave(nq // nk, 0).reshape(-1)
    s = {n: search_scale(w0[n], h0[n], xm[n], group_size, grid)[0] for n in LINEARS}

    s["qkv_proj"] = _fold_into_norm(layer.input_layernorm, s["qkv_proj"])
    s["gate_up_proj"] = _fold_into_norm(layer.post_attention_layernorm, s["gate_up_proj"])
    # row scales: how the folded output rows are divided (v by o's scale, up by down's)
    rows = {n: torch.ones(w0[n].shape[0]) for n in LINEARS}
    s_kv = s["o_proj"].view(nq, hd)[:: nq // nk].reshape(-1)
    rows["qkv_proj"][(nq + nk) * hd:] = s_kv
    rows["gate_up_proj"][ff:] = s["down_proj"]
    bias = layer.qkv_proj.bias
    if bias is not None:
        bias.data[(nq + nk) * hd:] /= s_kv.to(bias.dtype)

    codes = {}
    for n in LINEARS:
        w = w0[n] * s[n][None, :] / rows[n][:, None]
        h = h0[n] / (s[n][:, None] * s[n][None, :])
        q, z, sc = search_codes(w, h, group_size, clip_shrinks(clip_grid) if clip else (1.0,))
        codes[n] = (q, z, sc)
        ref = output_error(w0[n], h0[n])
        d_awq = (dequantize(q, z, sc, group_size) - w) * rows[n][:, None]
        rep.awq[n] = output_error(d_awq, h) / ref
        rep.rtn[n] = output_error(dequantize_int4(*quantize_int4(w0[n], group_size), group_size) - w0[n], h0[n]) / ref
        rep.alpha_scale[n] = float(s[n].max() / s[n].min())
    return codes, rep


# -- the model --------------------------------------------------------------------------------

@dataclass
class AWQResult:
    codes: dict  # (layer index, fused linear name) -> (q, z, s)
    reports: list
    group_size: int
    tokens: int
    seconds: float

    def summary(self) -> str:
        lines = [f"{'layer':>5}  " + "  ".join(f"{n:>22}" for n in LINEARS),
                 f"{'':>5}  " + "  ".join(f"{'rtn -> awq err':>22}" for _ in LINEARS)]
        for i, r in enumerate(self.reports):
            lines.append(f"{i:>5}  " + "  ".join(f"{r.rtn[n]:>10.3e} -> {r.awq[n]:>9.3e}" for n in LINEARS))
        return "\n".join(lines)


def check_group_size(cfg, group_size: int):
    if group_size not in KERNEL_GROUPS:
        raise InferdError(f"group size {group_size}: the int4 kernel takes {', '.join(map(str, KERNEL_GROUPS))}")
    for k in (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim):
        if k % group_size:
            raise InferdError(f"group size {group_size} does not divide the layer input size {k}")


@torch.no_grad()
def awq_quantize(model, calib: list[list[int]], group_size: int, grid: int = 20, clip: bool = True,
                 progress=None) -> AWQResult:
    """AWQ every decoder layer of an fp32 model in place: norm weights (and v/up rows) take the
    folded scales, every float tensor outside the quantized linears is rounded to fp16 (as the
    checkpoint stores it). The linears still hold float weights: `attach` swaps in the codes."""
    cfg = model.cfg
    check_group_size(cfg, group_size)
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise InferdError("AWQ calibration runs on an fp32 CPU model")
    t0 = time.perf_counter()
    seqlen = max(len(c) for c in calib)
    pos = torch.arange(seqlen)
    cos, sin = model.rope.cos_sin(pos)
    attn = causal_attention(cfg.head_dim ** -0.5)
    hidden = [model.embed_tokens(torch.tensor(c)) for c in calib]
    codes, reports = {}, []
    for i, layer in enumerate(model.layers):
        stats, hidden = collect_stats(layer, hidden, cos, sin, attn)
        layer_codes, rep = quantize_layer(layer, stats, cfg, group_size, grid, clip)
        codes.update({(i, n): c for n, c in layer_codes.items()})
        reports.append(rep)
        if progress:
            progress(i + 1, len(model.layers))
    _round_floats_fp16(model)
    return AWQResult(codes, reports, group_size, sum(len(c) for c in calib), time.perf_counter() - t0)


def _round_floats_fp16(model):
    for name, p in model.named_parameters():
        if not any(f".{n}." in name for n in LINEARS) or name.endswith(".bias"):
            p.data.copy_(p.data.half().to(p.dtype))


def attach(model, codes: dict, group_size: int) -> None:
    """Replace the fused linears by int4 kernels built from the codes (in the model's dtype)."""
    from inferd.quant.linear import Int4Linear

    for (i, n), (q, z, s) in codes.items():
        layer = model.layers[i]
        lin = getattr(layer, n)
        setattr(layer, n, Int4Linear(*to_affine_int4(q, z, s), group_size, lin.bias, model.dtype))


DEFAULT_SAMPLES, DEFAULT_SEQLEN = 32, 512  # calibration windows x tokens (`inferd quantize` defaults)

"""The layers every model family is built from: norms, rotary embeddings, the CPU-oriented Linear,
the fused add+norm, and the reference attention (`ContiguousKV`).

A family module (`llama`, `qwen3`, ...) composes these; what differs between families lives in the
family's module, behind `inferd.model.registry`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig, attention_scale, attention_windows


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 / linear scaling applied where the config asks for it."""
    dim = cfg.head_dim
    # on the CPU whatever device context builds the model (a meta arange runs torch's Python reference
    # implementation, which imports torch._dynamo: 1.4 s); callers move the result
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "freq_factors":
        # a GGUF's rope_freqs tensor: llama.cpp divides each frequency by its factor (the converter
        # writes Llama 3's smoothed scaling this way), so it equals the llama3 rule above
        factors = torch.tensor(rs["factors"], dtype=torch.float64, device="cpu")
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors, the head needs {inv.numel()}")
        inv = inv / factors
    elif kind == "longrope":
        # Phi-3: one divisor per frequency, the long set where the model serves past its original
        # context (llama.cpp's rule, by the context it serves; transformers picks per forward by the
        # sequence's length, so the two agree past the original context and differ before it)
        long = cfg.max_position_embeddings > int(rs["original_max_position_embeddings"])
        inv = inv / torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float64, device="cpu")
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, rs, dim, cfg.rope_theta)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv.float()


def _yarn_inv_freq(inv: torch.Tensor, rs: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the original
    context are interpolated (divided by the factor), those that turn more than beta_fast times are
    kept, and a linear ramp over the rotary dimensions between the two blends them. The ramp's ends
    are where a frequency turns beta times, floored and ceiled to whole dimensions unless the config
    says truncate: false."""
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns `turns` times in orig
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_turning(float(rs.get("beta_fast") or 32)), dim_turning(float(rs.get("beta_slow") or 1))
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - lo) / max(hi - lo, 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 1 + 0.1 * mscale * ln(factor), 1 for no extension."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What LongRoPE and YaRN multiply cos and sin by (1 elsewhere). LongRoPE: its `attention_factor`,
    or by default sqrt(1 + ln(s) / ln(original context)) for the extension s = context / original
    context. YaRN: its `attention_factor`, or yarn_mscale(factor) (over yarn_mscale(factor,
    mscale_all_dim) where both mscales are given, DeepSeek's form)."""
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type") == "yarn":
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        f = float(rs["factor"])
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            return yarn_mscale(f, float(rs["mscale"])) / yarn_mscale(f, float(rs["mscale_all_dim"]))
        return yarn_mscale(f)
    if rs.get("rope_type") != "longrope":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    orig = int(rs["original_max_position_embeddings"])
    s = float(rs.get("factor") or cfg.max_position_embeddings / orig)
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))


class Rope(nn.Module):
    """cos/sin tables grown on demand; rotates the two halves of each head (HF layout).

    The sign of rotate_half is folded into the sin table, so a rotation is x*cos + swap(x)*sin."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.cos = self.sin = None

    def reset(self, device):
        """Frequencies back to fp32 after a model's `.to(dtype)` cast its buffers."""
        self.inv_freq = rope_inv_freq(self.cfg).to(device)
        self.cos = self.sin = None

    def tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < n or self.cos.device != device:
            n = max(n, 4096)
            t = torch.arange(n, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            m = rope_attention_factor(self.cfg)
            self.cos = torch.cat([freqs, freqs], dim=-1).cos() * m
            self.sin = torch.cat([-freqs, freqs], dim=-1).sin() * m
        return self.cos, self.sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token fp32 tables [T, head_dim], computed once per forward and shared by every layer."""
        cos_t, sin_t = self.tables(int(positions.max()) + 1, positions.device)
        return cos_t[positions], sin_t[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] fp32, used in x's dtype as HF does."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1).to(x.dtype) + swapped * sin.unsqueeze(1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused call; for bf16 it accumulates in fp32 internally (HF upcasts explicitly: the
        # results differ only in the last bf16 bit, and the three extra dispatches cost ~15 %)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def fused_ops(x: torch.Tensor):
    """The compiled CPU kernels when they apply (CPU, no autograd, fp32/bf16), else None."""
    if x.device.type != "cpu" or x.requires_grad or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    from inferd.kernels import native

    return native.ops()


def add_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)); the fused kernel updates x in place (x is always our own
    activation tensor, never a caller's)."""
    if ops is None:
        x = x + delta
        return x, norm(x)
    return x, ops.add_rms_norm(x, delta.contiguous(), norm.weight, norm.eps)


class Linear(nn.Linear):
    """nn.Linear with the CPU GEMM oriented the fast way round.

    Measured on the 2-core AVX512-BF16 machine over all of SmolLM2's weight shapes (bf16):
    one row through torch.mv ran ~25 % faster than F.linear, and for more rows computing
    (W @ x^T)^T ran 15-40 % faster than F.linear's x @ W^T. Same maths, other kernel.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] == 1:
            y = torch.mv(self.weight, x[0]).unsqueeze(0)
        else:
            y = torch.mm(self.weight, x.t()).t().contiguous()
        return y if self.bias is None else y + self.bias


def norm_qk_heads(qkv: torch.Tensor, nq: int, nk: int, q_norm: nn.Module, k_norm: nn.Module):
    """Normalise each query and key head of qkv [T, heads, head_dim] in place (Qwen3, Gemma 3): qkv is
    a step's own projection output, and the v heads stay untouched."""
    qkv[:, :nq] = q_norm(qkv[:, :nq])
    qkv[:, nq:nq + nk] = k_norm(qkv[:, nq:nq + nk])


def attend(q, k, v, *, scale: float, mask=None, causal: bool = False, softcap: float | None = None):
    """Attention of q [B, H, Q, D] over k, v [B, Hkv, K, D] (grouped-query), `mask` [.., Q, K] True
    where a query may attend. `softcap`: Gemma 2's attention-logit soft-capping, cap * tanh(s / cap)
    on the scaled scores before the mask; SDPA has no hook for it, so those models take the explicit
    maths here (in fp32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=True)
    rep = q.shape[-3] // k.shape[-3]
    kf = k.float().repeat_interleave(rep, dim=-3) if rep > 1 else k.float()
    vf = v.float().repeat_interleave(rep, dim=-3) if rep > 1 else v.float()
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None and causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vf).to(q.dtype)


class ContiguousKV:
    """One sequence's KV cache as plain [max_len, n_kv, head_dim] tensors per layer.

    The obviously-correct attention used by the reference loop: write this step's keys and values
    at their positions, then attend causally over everything written so far.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype, device):
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = attention_scale(cfg)
        self.softcap = cfg.attn_logit_softcapping
        w = attention_windows(cfg)
        self.windows = w if isinstance(w, list) else [w] * cfg.num_hidden_layers
        self.positions: torch.Tensor | None = None

    def set_positions(self, positions: torch.Tensor):
        self.positions = positions

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        pos = self.positions
        self.k[layer, pos] = k
        self.v[layer, pos] = v
        n = int(pos.max()) + 1
        keys, vals = self.k[layer, :n], self.v[layer, :n]
        j = torch.arange(n, device=q.device)
        mask = j[None, :] <= pos[:, None]
        if self.windows[layer] is not None:
            mask &= j[None, :] > pos[:, None] - self.windows[layer]
        o = attend(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                   vals.transpose(0, 1).unsqueeze(0), mask=mask, scale=self.scale, softcap=self.softcap)
        return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)

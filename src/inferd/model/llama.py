"""The Llama-family transformer (Llama 2/3, SmolLM2, Mistral, Qwen2) as one flat token batch.

The model sees a flat list of tokens with their positions and never a padded [batch, seq] grid:
who attends to what is the business of an attention backend passed in with each call
(`ContiguousKV` for the reference loop, the paged cache in `inferd.worker.attention` for the engine).
That keeps one model definition under every scheduling policy.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig


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
        factors = torch.tensor(rs["factors"], dtype=torch.float64)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors, the head needs {inv.numel()}")
        inv = inv / factors
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv.float()


class Rope(nn.Module):
    """cos/sin tables grown on demand; rotates the two halves of each head (HF layout).

    The sign of rotate_half is folded into the sin table, so a rotation is x*cos + swap(x)*sin."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.cos = self.sin = None

    def tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < n or self.cos.device != device:
            n = max(n, 4096)
            t = torch.arange(n, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            self.cos = torch.cat([freqs, freqs], dim=-1).cos()
            self.sin = torch.cat([-freqs, freqs], dim=-1).sin()
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


def _fused_ops(x: torch.Tensor):
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


class DecoderLayer(nn.Module):
    """q/k/v and gate/up are stored fused (one matmul each): identical maths, fewer dispatches."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.idx = idx
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.ff = cfg.intermediate_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = Linear(h, (self.n_heads + 2 * self.n_kv) * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * hd, h, bias=False)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, h, cos, sin, attn, next_norm: RMSNorm, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h: input_layernorm(x), already computed by the caller's fused
        add+norm. Returns (new residual, next_norm(new residual))."""
        t = x.shape[0]
        nq, nk = self.n_heads, self.n_kv
        qkv = self.qkv_proj(h).view(t, nq + 2 * nk, self.head_dim)
        if ops is not None:
            ops.rope_(qkv, nq + nk, cos, sin)
            qk = qkv
        else:
            qk = apply_rope(qkv[:, : nq + nk], cos, sin)
        o = attn(self.idx, qk[:, :nq], qk[:, nq:nq + nk], qkv[:, nq + nk:])  # [T, n_heads * head_dim]
        x, h = add_norm(x, self.o_proj(o), self.post_attention_layernorm, ops)
        gu = self.gate_up_proj(h)
        if ops is not None and gu.dim() == 2 and gu.is_contiguous():
            act = ops.silu_mul(gu)
        else:
            gate, up = gu.split(self.ff, dim=-1)
            act = F.silu(gate) * up
        return add_norm(x, self.down_proj(act), next_norm, ops)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg)

    # from the final norm: a quantization may replace the embedding table (inferd.quant.w4a8)
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions)
        ops = _fused_ops(x)
        first = self.layers[0].input_layernorm if len(self.layers) else self.norm
        h = ops.rms_norm(x, first.weight, first.eps) if ops is not None else first(x)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer(x, h, cos, sin, attn, nxt, ops)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class ContiguousKV:
    """One sequence's KV cache as plain [max_len, n_kv, head_dim] tensors per layer.

    The obviously-correct attention used by the reference loop: write this step's keys and values
    at their positions, then attend causally over everything written so far.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, dtype, device):
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window
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
        if self.window is not None:
            mask &= j[None, :] > pos[:, None] - self.window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            vals.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)

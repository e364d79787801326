"""The Llama transformer (Llama 2/3, SmolLM2, Mistral, Qwen2) as one flat token batch; the base
other families' modules specialise (`qwen3`: per-head q/k norms).

The model sees a flat list of tokens with their positions and never a padded [batch, seq] grid:
who attends to what is the business of an attention backend passed in with each call
(`ContiguousKV` for the reference loop, the paged cache in `inferd.worker.attention` for the engine).
That keeps one model definition under every scheduling policy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig
from inferd.model.layers import Linear, RMSNorm, Rope, add_norm, apply_rope, fused_ops


class DecoderLayer(nn.Module):
    """q/k/v and gate/up are stored fused (one matmul each): identical maths, fewer dispatches."""

    dense_mlp = True  # False: a family's own `mlp` (model/moe.py: routed experts)

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
        if self.dense_mlp:
            self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = Linear(cfg.intermediate_size, h, bias=False)

    def rotate(self, qkv: torch.Tensor, cos, sin, ops) -> torch.Tensor:
        """RoPE on the q and k heads of qkv [T, heads, head_dim]; returns them (a family with q/k norms
        normalises first: `qwen3`)."""
        nqk = self.n_heads + self.n_kv
        if ops is not None:
            ops.rope_(qkv, nqk, cos, sin)
            return qkv
        return apply_rope(qkv[:, :nqk], cos, sin)

    def forward(self, x, h, cos, sin, attn, next_norm: RMSNorm, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; h: input_layernorm(x), already computed by the caller's fused
        add+norm. Returns (new residual, next_norm(new residual))."""
        t = x.shape[0]
        nq, nk = self.n_heads, self.n_kv
        qkv = self.qkv_proj(h).view(t, nq + 2 * nk, self.head_dim)
        qk = self.rotate(qkv, cos, sin, ops)
        o = attn(self.idx, qk[:, :nq], qk[:, nq:nq + nk], qkv[:, nq + nk:])  # [T, n_heads * head_dim]
        x, h = add_norm(x, self.o_proj(o), self.post_attention_layernorm, ops)
        return add_norm(x, self.mlp(h, ops), next_norm, ops)

    def mlp(self, h: torch.Tensor, ops) -> torch.Tensor:
        gu = self.gate_up_proj(h)
        if ops is not None and gu.dim() == 2 and gu.is_contiguous():
            act = ops.silu_mul(gu)
        else:
            gate, up = gu.split(self.ff, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class LlamaModel(nn.Module):
    layer_class = DecoderLayer
    # the W4A8 decode step in C++ (model/fused_decode.py) computes exactly this layer; a family whose
    # layer differs says False until the C++ loop learns its difference
    fused_decode = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
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
        ops = fused_ops(x)
        first = self.layers[0].input_layernorm if len(self.layers) else self.norm
        h = ops.rms_norm(x, first.weight, first.eps) if ops is not None else first(x)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer(x, h, cos, sin, attn, nxt, ops)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()



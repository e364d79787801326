"""Gemma 2: the Llama layer with Gemma's differences (Gemma 3 adds its own on top: model/gemma3.py).

- RMSNorm scales by (1 + w), in fp32 (Hugging Face stores w; llama.cpp's GGUF stores 1 + w and the
  loader subtracts the 1), and there are four per layer: around attention and around the MLP;
- the softmax scale query_pre_attn_scalar ** -0.5, and the attention logits soft-capped
  (cap * tanh(s / cap), cap 50: `ModelConfig.attn_logit_softcapping`, applied by the attention
  backends), the final logits too (cap 30);
- the embedding scaled by sqrt(hidden) in the activations' dtype;
- GeGLU: gelu (tanh approximation) on the gate;
- interleaved sliding-window (local) and global layers (`ModelConfig.layer_types`, every other one
  for Gemma 2); the attention backends apply each layer's window and keep the two kinds' KV apart
  (inferd.worker.kv_pool.KVLayout). A local layer may have its own RoPE base (Gemma 3's).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig
from inferd.model.layers import RMSNorm, Rope, fused_ops
from inferd.model.llama import DecoderLayer, LlamaModel


class GemmaRMSNorm(RMSNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)  # the scale is 1 + w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 throughout, cast once: 1 + w held in bf16 would lose w's low bits (8-bit mantissa)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())
        return y.to(x.dtype)


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.local = cfg.layer_types is not None and cfg.layer_types[idx] == "sliding_attention"

    def forward(self, x, tables, attn, ops=None) -> torch.Tensor:
        """x: the residual stream; tables: (global, local) RoPE (cos, sin). Returns the new residual."""
        t = x.shape[0]
        nq, nk = self.n_heads, self.n_kv
        cos, sin = tables[self.local]
        qkv = self.qkv_proj(self.input_layernorm(x)).view(t, nq + 2 * nk, self.head_dim)
        qk = self.rotate(qkv, cos, sin, ops)
        o = attn(self.idx, qk[:, :nq], qk[:, nq:nq + nk], qkv[:, nq + nk:])
        x = x + self.post_attention_layernorm(self.o_proj(o))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).split(self.ff, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma2Model(LlamaModel):
    layer_class = Gemma2DecoderLayer
    fused_decode = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta,
                                    rope_scaling=None if cfg.rope_local_theta else cfg.rope_scaling)
        self.rope_local = Rope(local)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # the scale rounded to the activations' dtype first, as Hugging Face does
        x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        tables = (self.rope.cos_sin(positions), self.rope_local.cos_sin(positions))
        ops = fused_ops(x)
        for layer in self.layers:
            x = layer(x, tables, attn, ops)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

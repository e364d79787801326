"""Gemma 3 (text): Gemma 2's layer (model/gemma2.py) plus an RMSNorm (Gemma's 1 + w) over each query
and key head before RoPE, as Qwen3 has; its local layers have their own RoPE base (10,000, no
scaling), five of every six layers are local, and there is no attention soft-capping."""
from __future__ import annotations

import torch

from inferd.model.config import ModelConfig
from inferd.model.gemma2 import Gemma2DecoderLayer, Gemma2Model, GemmaRMSNorm
from inferd.model.layers import norm_qk_heads

__all__ = ["Gemma3DecoderLayer", "Gemma3Model", "GemmaRMSNorm"]


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(self, qkv: torch.Tensor, cos, sin, ops) -> torch.Tensor:
        norm_qk_heads(qkv, self.n_heads, self.n_kv, self.q_norm, self.k_norm)
        return super().rotate(qkv, cos, sin, ops)


class Gemma3Model(Gemma2Model):
    layer_class = Gemma3DecoderLayer

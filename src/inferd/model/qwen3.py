"""Qwen3: the Llama layer with an RMSNorm over each query and key head before RoPE (and no q/k/v
bias). Its GGUF is NeoX-ordered: llama.cpp keeps the q/k rows as Hugging Face has them."""
from __future__ import annotations

import torch

from inferd.model.config import ModelConfig
from inferd.model.layers import RMSNorm, norm_qk_heads
from inferd.model.llama import DecoderLayer, LlamaModel


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(self, qkv: torch.Tensor, cos, sin, ops) -> torch.Tensor:
        norm_qk_heads(qkv, self.n_heads, self.n_kv, self.q_norm, self.k_norm)
        return super().rotate(qkv, cos, sin, ops)


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer
    fused_decode = False

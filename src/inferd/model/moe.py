"""Mixture-of-experts families: Mixtral, Qwen3-MoE and OLMoE.

Each replaces the Llama layer's MLP with a router and SwiGLU experts. A step's tokens are grouped by
the expert they were routed to and every active expert runs as one matmul over its tokens (gate/up
fused, then down), its outputs scaled by the routing weight and added back in expert order, as
`transformers` does; there is no per-token loop.

Routers (each family's rule, from its config):
- Mixtral: softmax over the experts, top-k, the k weights renormalised to sum to 1;
- Qwen3-MoE: softmax, top-k, renormalised when `norm_topk_prob` (every released model);
- OLMoE: softmax, top-k, not renormalised (`norm_topk_prob` false); its q/k norms span the whole
  projection (every head at once), not one head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig
from inferd.model.layers import Linear, RMSNorm
from inferd.model.llama import DecoderLayer, LlamaModel
from inferd.model.qwen3 import Qwen3DecoderLayer


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router logits [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    """One SwiGLU expert as the dense layers hold their MLP (gate/up fused): quantization rewrites its
    two Linears with the same kernels as the dense layers'."""

    def __init__(self, hidden: int, ff: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * ff, bias=False)
        self.down_proj = Linear(ff, hidden, bias=False)


class Experts(nn.ModuleList):
    def __init__(self, n: int, hidden: int, ff: int):
        super().__init__(Expert(hidden, ff) for _ in range(n))
        self.ff = ff
        self.matmuls = 0  # expert calls (gate/up and down together), for the tests' one-per-expert check
        # tensor parallelism (distributed/tensor_parallel.split_experts): this rank's experts, and the
        # collective that sums the ranks' outputs
        self.owned: frozenset[int] | None = None
        self.comm = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self)).tolist()
        rows = order // k  # the token of each routed slot, grouped by expert
        w = weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or (self.owned is not None and e not in self.owned):
                start += n
                continue
            sel = rows[start:start + n]
            gate, up = self[e].gate_up_proj(x[sel]).split(self.ff, dim=-1)
            y = self[e].down_proj(F.silu(gate) * up)
            out.index_add_(0, sel, y * w[start:start + n, None])
            self.matmuls += 1
            start += n
        if self.comm is not None:
            self.comm.all_reduce_(out)
        return out


class MoEDecoderLayer(DecoderLayer):
    dense_mlp = False

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def mlp(self, h: torch.Tensor, ops) -> torch.Tensor:
        weights, ids = route(self.gate(h), self.top_k, self.renormalise)
        return self.experts(h, weights, ids)


class MixtralModel(LlamaModel):
    layer_class = MoEDecoderLayer
    fused_decode = False


class Qwen3MoeDecoderLayer(MoEDecoderLayer, Qwen3DecoderLayer):
    pass


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer
    fused_decode = False


class OlmoeDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__(cfg, idx)
        self.q_norm = RMSNorm(cfg.num_attention_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_key_value_heads * cfg.head_dim, cfg.rms_norm_eps)

    def rotate(self, qkv: torch.Tensor, cos, sin, ops) -> torch.Tensor:
        t = qkv.shape[0]
        nq, nk = self.n_heads, self.n_kv
        qkv[:, :nq] = self.q_norm(qkv[:, :nq].reshape(t, -1)).view(t, nq, -1)
        qkv[:, nq:nq + nk] = self.k_norm(qkv[:, nq:nq + nk].reshape(t, -1)).view(t, nk, -1)
        return super().rotate(qkv, cos, sin, ops)


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer
    fused_decode = False

"""Calibration statistics shared by AWQ and GPTQ: run a model's decoder layers one at a time over
calibration sequences and keep each linear's input second moments H = E[x^T x] and mean |x|."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def output_error(d: torch.Tensor, h: torch.Tensor) -> float:
    """Mean over tokens of ||x D^T||^2, from H = E[x^T x]."""
    return float(((d @ h) * d).sum())


@dataclass
class InputStats:
    """Running E[x^T x] and E|x| of one linear's inputs."""
    h: torch.Tensor | None = None
    abs_sum: torch.Tensor | None = None
    n: int = 0

    def add(self, x: torch.Tensor):
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if self.h is None:
            self.h = torch.zeros(x.shape[1], x.shape[1])
            self.abs_sum = torch.zeros(x.shape[1])
        self.h.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(0)
        self.n += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        return self.h / self.n

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.n


def causal_attention(scale: float):
    def attn(idx, q, k, v):  # one sequence, positions 0..T-1: plain causal attention
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)
    return attn


def collect_stats(layer, hidden: list[torch.Tensor], cos, sin, attn) -> tuple[dict, list[torch.Tensor]]:
    """Run one decoder layer over every calibration sequence: its linears' input statistics, and
    its outputs (the next layer's inputs)."""
    stats = {n: InputStats() for n in LINEARS}
    hooks = [getattr(layer, n).register_forward_pre_hook(lambda m, args, n=n: stats[n].add(args[0]))
             for n in LINEARS]
    try:
        with torch.inference_mode():
            # the layer's torch path (ops=None); it returns (residual, next norm): keep the residual
            out = [layer(x, layer.input_layernorm(x), cos[:x.shape[0]], sin[:x.shape[0]], attn,
                         layer.input_layernorm)[0] for x in hidden]
    finally:
        for hk in hooks:
            hk.remove()
    return stats, out

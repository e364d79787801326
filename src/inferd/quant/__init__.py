"""Weight-only quantization: each method is one function that rewrites a model's linear layers.

    quantize(model, "int8")                  symmetric, per output channel
    quantize(model, "int4", group_size=64)   asymmetric, group-wise, round to nearest

GPTQ rounding (`int8-gptq`, `int4-gptq`: the same layouts, codes chosen with a calibration pass at
load) lives in `gptq.py`. AWQ (calibrated, saved as a Hugging Face AWQ folder, loaded onto the same int4 kernel) lives in
`awq.py` and `awq_checkpoint.py`.

Both run through PyTorch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
with activations in the model's dtype; the rest of the engine does not know.

`dense=True` keeps the exact dequantized weights instead of packing them, for quality evaluation
with fp32 activations: the packed kernels take a slow path for fp32 inputs (benchmarks/quant_decode.py
measures it), and the maths is the same (tests/test_quant.py checks kernel against dequantized).

int4 layout (PyTorch's): q in 0..15 per weight, and per (group, output row) a scale and a "zero"
such that w = (q - 8) * scale + zero. A GGUF Q4_1 block (w = q * d + m) is the same thing with
scale = d, zero = m + 8 d; Q4_0 (w = (q - 8) * d) has zero = 0.
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.errors import InferdError

METHODS = ("none", "int8", "int4", "int8-gptq", "int4-gptq", "gguf", "awq")


# -- pure functions ---------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 [N, K] and per-row scales [N] (fp32), w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> q int32 [N, K] in 0..15, scale and zero [N, K / group] (fp32), with
    w ~= (q - 8) * scale + zero: min/max round-to-nearest per group."""
    N, K = w.shape
    if K % group_size:
        raise InferdError(f"group size {group_size} does not divide the layer's input size {K}")
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(N, K), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = q.shape
    g = q.reshape(N, K // group_size, group_size).float()
    return ((g - 8) * scale[..., None] + zero[..., None]).reshape(N, K)


# -- modules ----------------------------------------------------------------------------------

class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.dense = dense
        if dense:
            self.register_buffer("weight", (q.float() * scale.float()[:, None]).to(dtype))
        else:
            self.register_buffer("weight_int8", q.contiguous())
            self.register_buffer("scales", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense:
            y = x.reshape(-1, shape[-1]).to(self.dtype) @ self.weight.t()
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.dtype), self.weight_int8, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, dense: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.dense = dense
        if dense:
            self.register_buffer("weight", dequantize_int4(q, scale.float(), zero.float(), group_size).to(dtype))
        else:
            self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            # [K / group, N, 2]: the kernel's layout
            self.register_buffer("scales_and_zeros",
                                 torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense:
            y = x.reshape(-1, shape[-1]).to(self.dtype) @ self.weight.t()
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(self.dtype), self.weight_int4,
                                                  self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def _targets(model: nn.Module, include_lm_head: bool):
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            yield layer, name
    if include_lm_head:
        yield model, "lm_head"


def quantize(model: nn.Module, method: str, group_size: int = 32, include_lm_head: bool = False,
             dense: bool = False) -> nn.Module:
    """Rewrite the model's linear layers in place (gpt-fast style) and return it."""
    if method in (None, "none"):
        return model
    if method == "gguf":
        raise InferdError("gguf quantization is applied at load time from the file's own blocks")
    if method.endswith("-gptq"):
        raise InferdError(f"{method} needs calibration text: load the model with quantization={method!r}, "
                          "or call inferd.quant.gptq.gptq_quantize")
    if method == "awq":
        raise InferdError("awq needs calibration: `inferd quantize --method awq`, then load the folder it writes")
    if method not in METHODS:
        raise InferdError(f"unknown quantization {method!r} (choose {', '.join(METHODS)})")
    if model.device.type != "cpu":
        raise InferdError(f"{method} kernels are CPU-only in this build")
    dtype = model.dtype
    for parent, name in _targets(model, include_lm_head):
        lin = getattr(parent, name)
        w = lin.weight.detach()
        if method == "int8":
            q, s = quantize_int8(w)
            new = Int8Linear(q, s, lin.bias, dtype, dense)
        else:
            q, s, z = quantize_int4(w, group_size)
            new = Int4Linear(q, s, z, group_size, lin.bias, dtype, dense)
        setattr(parent, name, new)
    return model


def quantize_lm_head_int8(model: nn.Module, dense: bool = False) -> nn.Module:
    """The output layer to per-row int8 (for `gguf`, whose tied Q8_0 embedding has no int4 form:
    one re-rounding of its 32-wide block scales into one scale per row). The embedding keeps its
    float copy: a lookup reads one row per token, so packing it would save memory but no time."""
    lin = model.lm_head
    q, s = quantize_int8(lin.weight.detach())
    model.lm_head = Int8Linear(q, s, lin.bias, model.dtype, dense)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total

"""GGUF F16 and BF16 tensors served in their 16 bits (csrc/cpu/half_gemm_impl.h).

A GGUF converted without quantization stores its projections as F16 or BF16. Dequantized to float32
they take twice the file's bytes and a batch-1 step reads 4 bytes a weight; `HalfLinear` keeps the
file's 16-bit values and widens each to fp32 in registers, so the layer holds the file's bytes and
computes the dequantized model's products in fp32 (only the order of the sums differs).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inferd.errors import InferdError
from inferd.quant.gguf_blocks import part_rows

TYPES = ("F16", "BF16")
K_MULTIPLE = 16  # the kernel's lanes


def weights(t) -> torch.Tensor:
    """A GGUF F16/BF16 tensor or plan part -> float16 / bfloat16 [N, K], the file's bits (in the
    part's row order)."""
    raw, name = part_rows(t)
    raw = np.ascontiguousarray(raw)
    if name == "F16":
        return torch.from_numpy(raw.view(np.float16).reshape(raw.shape[0], -1).copy())
    if name == "BF16":
        return torch.from_numpy(raw.view(np.int16).reshape(raw.shape[0], -1).copy()).view(torch.bfloat16)
    raise InferdError(f"{name} is not a 16-bit float type")


class HalfLinear(nn.Module):
    """A linear layer whose weight stays float16 or bfloat16 [N, K]; x in float32 (or bf16), y in x's
    dtype, computed in fp32 by the native kernel."""

    float16_weights = True  # read by name where quant is not imported (the fused decode step)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if weight.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
            raise InferdError("HalfLinear needs a float16 or bfloat16 [N, K] weight")
        self.out_features, self.in_features = weight.shape
        if self.in_features % K_MULTIPLE:
            raise InferdError(f"16-bit float layers need an input size that is a multiple of {K_MULTIPLE}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from inferd.kernels.native import ops

        shape = x.shape
        k = ops()
        if k is None:
            raise InferdError("16-bit float layers need inferd's C++ kernels, which did not build (no compiler?)")
        y = k.half_linear(x.reshape(-1, shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{str(self.weight.dtype)[6:]}, in={self.in_features}, out={self.out_features}"

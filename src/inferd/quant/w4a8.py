"""W4A8: int4 weights times activations rounded to int8 per 32-block, for CPUs without fast bf16.

Why: at batch 1 a decode step reads every weight once, so the int4 matmul should run at memory
speed. PyTorch's packed kernel spends its time turning nibbles into bf16/fp32 instead: on an AVX2
CPU it moves ~6 GB/s of int4 (12 G weights/s on 2 cores) against 28 GB/s of DRAM. With the
activations small integers too, one AVX2 instruction (`vpmaddubsw`) multiplies 32 nibbles by 32
int8 activations, and the kernel below runs 2-3x faster (a 3072 x 576 layer in ~45-70 us with the
weights in cache, ~100 us from DRAM, against ~150 us). llama.cpp does the same on CPU (Q4_x
weights times Q8_1 activations).

It is lossy in the activations as well as the weights: each 32-block of x is rounded to 255 levels
of its largest magnitude. `quantize_activations(model)` rewrites a model's int4 layers (any
method: int4, int4-gptq, gguf's Q4 blocks, AWQ), and `inferd eval` judges the result like any other
quantization (`--quantization int4+a8`). The maths, per weight block b of output row n,
with w = q s + m (q in 0..15) and x ~= dx * xq:

    y[n] = sum_b  s[n,b] dx[b] * sum_k q_k xq_k  +  m[n,b] * dx[b] * sum_k xq_k

Every forward rounds x the same way. Up to MAX_KERNEL_ROWS rows (decode batches, short chunks) the
kernel reads each weight once per panel of output rows for all the step's rows, and a row's result
is bit-identical whatever batch it is in (tests/test_native.py); longer prefill chunks dequantize the
layer for one fp32 GEMM (faster there today): the same function up to summation order.

The kernel reads the codes in inferd's own nibble layout (`inferd.quant.pack_nibbles`), taken from
the method's codes (`Int4Linear.codes()`), never from PyTorch's packed int4 bytes, whose layout
depends on the CPU (its AVX2 and AVX-512 builds differ).
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.errors import InferdError

from inferd.kernels.native import BLOCK, MAX_KERNEL_ROWS
from inferd.kernels.native import ops as load  # torch.ops.inferd, or None without native code

# -- pure functions ---------------------------------------------------------------------------

def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel does to x, in torch (the tests' oracle): per 32-block, round to 255 levels
    of the block's largest magnitude."""
    shape = x.shape
    b = x.float().reshape(-1, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(b))
    return (q * d).reshape(shape)


def pack(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int):
    """int4 codes (q in 0..15 [N, K], w = q scale + min per group) -> the kernel's nibbles [N, K/2]
    uint8 (inferd's layout, `pack_nibbles`) and fp32 s, m [N, K/32] with w = q s + m per 32-block."""
    from inferd.quant.linear import pack_nibbles

    N, K = q.shape
    if group_size % BLOCK or K % group_size:
        raise InferdError(f"W4A8 needs int4 groups that are multiples of {BLOCK} (got {group_size})")
    rep = group_size // BLOCK
    s = scale.float().repeat_interleave(rep, dim=1)
    m = mn.float().repeat_interleave(rep, dim=1)
    return pack_nibbles(q), s.contiguous(), m.contiguous()


# -- the module and the rewrite ---------------------------------------------------------------

class W4A8Linear(nn.Module):
    """int4 weights (32-blocks, fp32 s and m); x rounded to int8 per 32-block inside the kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W4A8 needs its C++ kernel, which did not build (no compiler?)")
        for name, t in zip(("qweight", "qscale", "qmin"), pack(q, scale, mn, group_size)):
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None:  # the model's own calls: skip the reshapes (~120 calls a token)
            return self.kernel.w4a8_linear(x, self.qweight, self.qscale, self.qmin, MAX_KERNEL_ROWS)
        shape = x.shape
        y = self.kernel.w4a8_linear(x.reshape(-1, shape[-1]), self.qweight, self.qscale, self.qmin, MAX_KERNEL_ROWS)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def kernel_weights(self):
        """The tensors the fused decode step (inferd.model.fused_decode) passes to the kernel."""
        return self.qweight, self.qscale, self.qmin

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K], scale, min fp32 [N, K / 32]): what the kernel multiplies by."""
        from inferd.quant.linear import unpack_nibbles

        return unpack_nibbles(self.qweight), self.qscale, self.qmin

    def dequantized(self) -> torch.Tensor:
        return self.kernel.w4a8_dequantize(self.qweight, self.qscale, self.qmin)


class W8A8Linear(nn.Module):
    """int8 weights with one scale per output row (an Int8Linear's); x rounded like W4A8Linear's."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W8A8 needs the W4A8 C++ kernel, which did not build (no compiler?)")
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("qscale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def kernel_weights(self):
        """The tensors the fused decode step passes to the kernel (no minimum: symmetric int8)."""
        return self.qweight, self.qscale, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel.w8a8_linear(x.reshape(-1, shape[-1]), self.qweight, self.qscale, MAX_KERNEL_ROWS)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_activations(model: nn.Module) -> int:
    """Rewrite every packed linear of the model to take int8 activations: int4 ones into W4A8, and
    int8 ones (the gguf path's lm_head, the int8 methods) into W8A8, same weights (the engine then
    runs decode-only steps as one C++ call where it can: inferd.model.fused_decode). Returns how many linears were rewritten; a model without packed layers is a clear error."""
    from inferd.quant.linear import Int4Linear, Int8Linear

    if load() is None:
        raise InferdError("--quantize-activations needs the W4A8 C++ kernel, which did not build (no compiler?)")
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                if child.dense:
                    raise InferdError("--quantize-activations needs packed int4 layers, not dense ones")
                setattr(parent, name, W4A8Linear(*child.codes(), child.group_size, child.bias, model.dtype))
                n += 1
            elif isinstance(child, Int8Linear):
                if child.dense:
                    raise InferdError("--quantize-activations needs packed int8 layers, not dense ones")
                setattr(parent, name, W8A8Linear(*child.codes(), child.bias, model.dtype))
                n += 1
    if n == 0:
        raise InferdError("--quantize-activations applies to packed int4/int8 weights: this model has none")
    return n

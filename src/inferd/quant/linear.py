"""The quantized linear layers and the integer maths under them (inferd's int4/int8 codes).

int4 codes are inferd's own: q in 0..15 per weight and, per (output row, group), a scale and a min
with w = q * scale + min -- GGUF Q4_1's form (Q4_0 is min = -8 d; AWQ's zero point z is min = -z s).
They are held nibble-packed in one layout of ours (`pack_nibbles`), the one the W4A8 kernel reads.
PyTorch's packed int4 kernel gets them only at a layer's first forward (`Int4Linear.hand_over`):
`_convert_weight_to_int4pack_for_cpu` lays them out by the CPU's ISA (AVX2 and AVX-512 builds
differ), so nothing of ours ever reads its bytes back.
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.errors import InferdError

# -- pure functions ---------------------------------------------------------------------------

INT8_BLOCK = 32  # GGUF Q8_0's block: one scale per 32 consecutive weights of a row


def quantize_int8(w: torch.Tensor, block: int | None = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> int8 [N, K] and scales, w ~= q * scale, symmetric round-to-nearest: one scale
    per 32-block [N, K / 32] (Q8_0's form, the scale searched per block: _best_block_scale; of a
    Q8_0 tensor's dequantized weights it gives back the file's own codes and scales exactly), or with
    block=None one per row [N], amax / 127 (PyTorch's int8 kernel)."""
    w = w.float()
    N, K = w.shape
    if block is None:
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
    if K % block:
        raise InferdError(f"int8 blocks of {block} do not divide the layer's input size {K}")
    g = w.reshape(N, K // block, block)
    # fp16-representable scales, as Q8_0 stores them: a layer holds them in 2 bytes with no loss
    scale = _block_scales(g)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale


SEARCH_ROWS = 2048  # rows a pass of the torch scale search: [rows, blocks, 17 candidates, 32] floats at once


def _block_scales(g: torch.Tensor) -> torch.Tensor:
    """_best_block_scale of every block of g [N, blocks, block]: the native op where it built (the
    same search for 32-blocks, ~7x faster), else torch ops."""
    from inferd.kernels import native

    if g.shape[-1] == 32 and native.load() is not None:
        return torch.ops.inferd.int8_block_scales(g.reshape(g.shape[0], -1).contiguous())
    return torch.cat([_best_block_scale(part) for part in g.split(SEARCH_ROWS)])


def _best_block_scale(g: torch.Tensor) -> torch.Tensor:
    """Per 32-block of g [rows, blocks, 32], the fp16 scale whose round-to-nearest codes leave the
    least squared error: round-to-nearest's own amax / 127, or a fraction d / n (n = 1..16) of the
    spacing d = (max - min) / 15 that a block on a 16-level grid has. Weights dequantized from a
    4-bit file (Q4_0/Q4_1: the default model) are on such a grid, and a step d / n puts every level
    on the int8 grid up to one shared offset (on the default model's layers: 0.16x the squared error
    of amax / 127; on Gaussian weights ~0.93x). Only scales whose codes fit int8 unclipped count, so
    every weight stays within half a step. A tie keeps round-to-nearest's, so Q8_0 weights get their
    own codes and scales back exactly."""
    amax = g.abs().amax(dim=-1)
    d = (g.amax(dim=-1) - g.amin(dim=-1)) / 15
    n = torch.arange(1, 17, dtype=g.dtype)
    cand = torch.cat([(amax / 127)[..., None], d[..., None] / n], dim=-1).clamp(min=2**-24).half().float()
    q = torch.round(g[..., None, :] / cand[..., None])
    err = (q * cand[..., None] - g[..., None, :]).pow(2).sum(dim=-1)
    # no clipping: a scale whose codes leave int8 is no candidate (every weight stays within half a step)
    err = err.masked_fill(q.abs().amax(dim=-1) > 127, float("inf"))
    return cand.gather(-1, err.argmin(dim=-1, keepdim=True)).squeeze(-1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 times a per-row [N] or per-block [N, K / b] scale."""
    if scale.dim() == 1:
        return q.float() * scale.float()[:, None]
    N, K = q.shape
    return (q.float().reshape(N, scale.shape[1], -1) * scale.float()[..., None]).reshape(N, K)


def int4_grid(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's min/max grid of 16 levels: (w as [N, K / group, group] fp32, scale, min)."""
    N, K = w.shape
    if K % group_size:
        raise InferdError(f"group size {group_size} does not divide the layer's input size {K}")
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    return g, ((hi - lo) / 15).clamp(min=1e-8), lo


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> q int32 [N, K] in 0..15, scale and min [N, K / group] (fp32), with
    w ~= q * scale + min: min/max round-to-nearest per group."""
    g, scale, lo = int4_grid(w, group_size)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(w.shape), scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = q.shape
    g = q.reshape(N, K // group_size, group_size).float()
    return (g * scale[..., None] + mn[..., None]).reshape(N, K)


NIBBLE_BLOCK = 32


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) -> uint8 [N, K / 2], inferd's layout: per 32-block of a row, byte j
    holds q[j] in its low nibble and q[j + 16] in its high one (one 128-bit load and a shift give
    the kernel 32 codes in order)."""
    N, K = q.shape
    if K % NIBBLE_BLOCK:
        raise InferdError(f"int4 layers need an input size that is a multiple of {NIBBLE_BLOCK} (got {K})")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise InferdError("4-bit codes must lie in 0..15")
    b = q.to(torch.uint8).reshape(N, K // NIBBLE_BLOCK, 2, 16)
    return (b[:, :, 0, :] | (b[:, :, 1, :] << 4)).reshape(N, K // 2).contiguous()


def unpack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [N, K / 2] -> int32 [N, K]."""
    N, half = nib.shape
    b = nib.reshape(N, half // 16, 16)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(N, half * 2).to(torch.int32)


# -- modules ----------------------------------------------------------------------------------

class Int8Linear(nn.Module):
    """int8 weights w = q * scale, the scale per 32-block [N, K / 32] (`int8`: Q8_0's form, run by
    inferd's own kernel, `torch.ops.inferd.w8_linear`) or per row [N] (`int8-gptq`: PyTorch's
    `_weight_int8pack_mm`)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 dense: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.dense = dense
        self.blocked = scale.dim() == 2
        if dense:
            self.register_buffer("weight", dequantize_int8(q, scale).to(dtype))
        else:
            self.register_buffer("weight_int8", q.contiguous())
            if self.blocked:
                # fp16 like Q8_0's (2 bytes per 32 weights: 1.06 bytes a weight in all); exact for
                # the scales quantize_int8 makes
                half = scale.half()
                if not torch.equal(half.float(), scale.float()):
                    raise InferdError("int8 block scales must be float16 values (Q8_0's form)")
                self.register_buffer("scales", half.contiguous())
                self.scale_fp32 = None
            else:
                # PyTorch's per-row kernel wants the scales in x's dtype; W8A8 and eval the codes'
                # own fp32 ones, not the bf16 rounding
                self.register_buffer("scales", scale.to(dtype))
                self.register_buffer("scale_fp32", scale.float().contiguous())
            if self.blocked:
                from inferd.kernels.native import ops

                self.kernel = ops()
                if self.kernel is None:
                    raise InferdError("int8 (per-32-block scales) needs inferd's C++ kernel, which did not build "
                                      "(no compiler, or INFERD_NO_NATIVE)")
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N] or [N, K / 32]) with w = q * scale."""
        if self.dense:
            raise InferdError("a dense int8 layer keeps only its dequantized weights, not its codes")
        return self.weight_int8, self.scales.float() if self.blocked else self.scale_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense:
            y = x.reshape(-1, shape[-1]).to(self.dtype) @ self.weight.t()
        elif self.blocked:
            y = self.kernel.w8_linear(x.reshape(-1, shape[-1]), self.weight_int8, self.scales)
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.dtype), self.weight_int8, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """int4 weights w = q * scale + min per group, run by PyTorch's packed kernel.

    Until its first packed forward the layer holds inferd's codes (`qweight` nibbles, fp32 `scale`
    and `min`); that forward, or `hand_over()`, gives them to PyTorch and drops them, so the layer
    never holds the weights twice. A rewrite that needs the codes (W4A8) must come before it."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype, dense: bool = False):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.dense = dense
        self.handed_over = False
        if dense:
            self.register_buffer("weight", dequantize_int4(q, scale.float(), mn.float(), group_size).to(dtype))
        else:
            self.register_buffer("qweight", pack_nibbles(q))
            self.register_buffer("scale", scale.float().contiguous())
            self.register_buffer("min", mn.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K] in 0..15, scale, min fp32 [N, K / group])."""
        if self.dense:
            raise InferdError("a dense int4 layer keeps only its dequantized weights, not its codes")
        if self.handed_over:
            raise InferdError("this int4 layer already ran on PyTorch's packed kernel, which took its codes: "
                              "rewrite it (e.g. --quantize-activations) before its first forward")
        return unpack_nibbles(self.qweight), self.scale, self.min

    def hand_over(self) -> None:
        """Give the codes to PyTorch's packed kernel, in whatever layout this CPU's build uses."""
        if self.dense or self.handed_over:
            return
        with torch.inference_mode(False):  # a first forward under inference_mode must not make inference buffers
            q = unpack_nibbles(self.qweight)
            zero = self.min + 8 * self.scale  # the kernel's form: w = (q - 8) * scale + zero
            self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 1))
            # [K / group, N, 2]: the kernel's layout
            self.register_buffer("scales_and_zeros",
                                 torch.stack([self.scale, zero], -1).transpose(0, 1).contiguous().to(self.dtype))
        self.qweight = self.scale = self.min = None
        self.handed_over = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.dense:
            y = x.reshape(-1, shape[-1]).to(self.dtype) @ self.weight.t()
        else:
            if not self.handed_over:
                self.hand_over()
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(self.dtype), self.weight_int4,
                                                  self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def hand_over(model: nn.Module) -> int:
    """Give every packed int4 layer's codes to PyTorch's kernel now (the loader does, so a served
    model holds its final weights from the start and the first request pays no packing)."""
    n = 0
    for m in model.modules():
        if isinstance(m, Int4Linear) and not m.dense and not m.handed_over:
            m.hand_over()
            n += 1
    return n


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (shared tensors once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total

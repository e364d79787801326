"""A GGUF layer's blocks, from the file's mapping to its kernel's records: what quant.gguf_native's
method builds its layers with.

No re-rounding: a block of 32 weights (scale d, plus min m for Q4_1, and 4-bit codes q) becomes one
group of inferd's int4 form w = q * scale + min with scale = d and min = m (Q4_1) or -8 d (Q4_0):
the same products and sum gguf's own dequantization computes. A Q4_K super-block (256 weights: fp16
d and dmin, eight 6-bit scales and mins, 4-bit codes) is eight such groups of 32, with
scale = d * sc and min = -(dmin * m): exact in fp32 (an 11-bit mantissa times a 6-bit integer), and
again the very products gguf computes (`int4_blocks`). Q8_0 is int8 codes with Int8Linear's fp16
block scales (`q8_blocks`).

A layer keeps its parts as views of the file's mapping (`GGUFLinear`) until the model is final
(tensor parallelism cuts them by rows and columns first), then `finalize` repacks each once into its
kernel's records through `repack`, the one entry from a layer's parts to any kind of records. A layer
whose parts differ in type runs each run of one type through its own kernel (`FusedParts`).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.model.planned import children_of, rows_by_part
from inferd.quant import gguf_blocks

GROUP = 32
W4A8_TYPES = ("Q4_0", "Q4_1", "Q4_K")


# -- codes --------------------------------------------------------------------------------------

def int4_blocks(part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K part -> (q int32 [N, K] in 0..15, scale [N, K/32], min [N, K/32]) fp32."""
    raw, name = gguf_blocks.part_rows(part)
    N = raw.shape[0]
    if name == "Q4_K":
        c = gguf_blocks.decode(name, raw)
        scale = c.d.float().repeat_interleave(8, 1) * c.sc.float()
        minus = -(c.dm.float().repeat_interleave(8, 1) * c.mn.float())
        return c.q.to(torch.int32), scale, minus
    size = {"Q4_0": 18, "Q4_1": 20}[name]
    blk = raw.reshape(N, -1, size)
    d = gguf_blocks.f16(blk[..., 0:2]).astype(np.float32)
    if name == "Q4_1":
        m = gguf_blocks.f16(blk[..., 2:4]).astype(np.float32)
        qs = blk[..., 4:]
    else:
        qs = blk[..., 2:]
        m = -8 * d  # exact: a power-of-two multiple
    q = gguf_blocks.nibbles32(qs).reshape(N, -1).astype(np.int32)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def q8_blocks(part) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 part (blocks of fp16 d and 32 int8 codes) -> (q int8 [N, K], scale fp32 [N, K/32])."""
    raw, _ = gguf_blocks.part_rows(part)
    blk = raw.reshape(raw.shape[0], -1, 34)
    d = gguf_blocks.f16(blk[..., 0:2]).astype(np.float32)
    q = blk[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d)


# -- records ------------------------------------------------------------------------------------

def repack_w4a8(type_name: str, parts, rows=None) -> torch.Tensor:
    """Q4_0, Q4_1 or Q4_K tensors stacked along the output rows -> W4A8Linear's records: exactly
    `w4a8.pack4(*int4_blocks(stacked rows))` (half=None: fp16 scales and mins when every one is an
    fp16 value, as GGUF's Q4_0/Q4_1 ones are unless a Q4_0 |d| > 8188 puts -8 d past fp16; Q4_K's
    d * sc seldom are, so its records are mostly fp32's), in C++ from the file's bytes where the
    native kernels are built. `parts` and `rows` as gguf_blocks.repack takes them."""
    from gguf import GGMLQuantizationType as Q

    from inferd.kernels.native import ops
    from inferd.quant.w4a8 import pack4

    if type_name not in W4A8_TYPES:
        raise InferdError(f"W4A8 records come from Q4_0, Q4_1 or Q4_K tensors, not {type_name}")
    raws, orders = gguf_blocks.stacked(type_name, parts, rows)
    kernels = ops()
    if kernels is not None:
        return kernels.repack_w4a8(raws, orders, int(Q[type_name]))
    t = SimpleNamespace(data=gguf_blocks.stacked_rows(raws, orders), tensor_type=Q[type_name])
    return pack4(*int4_blocks(t))


def repack_w8a8(parts, rows=None) -> torch.Tensor:
    """Q8_0 tensors stacked along the output rows -> W8A8Linear's records: exactly
    `w4a8.pack8(*q8_blocks(stacked rows))` (fp16 scales: GGUF's own), in C++ where built."""
    from gguf import GGMLQuantizationType as Q

    from inferd.kernels.native import ops
    from inferd.quant.w4a8 import pack8

    raws, orders = gguf_blocks.stacked("Q8_0", parts, rows)
    kernels = ops()
    if kernels is not None:
        return kernels.repack_w8a8(raws, orders)
    return pack8(*q8_blocks(SimpleNamespace(data=gguf_blocks.stacked_rows(raws, orders), tensor_type=Q.Q8_0)))


def repack(kind: str, parts: list, rows: list | None = None) -> torch.Tensor:
    """A layer's plan parts (inferd.loading.plan.GGUFPart, one GGUF type, stacked along the output
    rows) -> the records of `kind`: "blocks" (gguf_blocks.BlocksLinear's), "w4a8" or "w8a8"
    (w4a8.W4A8Linear's, W8A8Linear's), read straight from the mapped bytes. `rows`: per part the
    source row of each output row; None: each part's own (llama.cpp's q/k order undone, a
    tensor-parallel share)."""
    type_name = parts[0].type
    raws = [p.raw() for p in parts]
    rows = [p.rows for p in parts] if rows is None else rows
    if kind == "blocks":
        return gguf_blocks.repack(type_name, raws, rows)
    if kind == "w4a8":
        return repack_w4a8(type_name, raws, rows)
    if kind == "w8a8":
        return repack_w8a8(raws, rows)
    raise InferdError(f"unknown GGUF layer target {kind!r}")


# -- the layers ---------------------------------------------------------------------------------

class GGUFLinear(torch.nn.Module):
    """One run of parts of one GGUF type, still the file's raw blocks (views of its mapping): what a
    layer is between the method and `finalize`. Tensor parallelism cuts it by rows (a row order of
    its parts) and columns (whole blocks of each row); `build()` repacks the blocks once into the
    final layer's records, straight from the mapped bytes."""

    def __init__(self, parts: list, target: str, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.parts, self.target, self.dtype = list(parts), target, dtype
        self.type = parts[0].type
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.register_buffer("bias", bias)

    def forward(self, x):
        raise InferdError("a GGUF layer runs once the model is final (inferd.quant.gguf_layer.finalize)")

    def take_rows(self, rows: torch.Tensor, take=None) -> "GGUFLinear":
        out = [self.parts[i].take_rows(mine) for i, mine in rows_by_part(rows, [p.shape[0] for p in self.parts])]
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        return GGUFLinear(out, self.target, bias, self.dtype)

    def take_cols(self, a: int, b: int, take=None) -> "GGUFLinear":
        return GGUFLinear([p.take_cols(a, b) for p in self.parts], self.target, self.bias, self.dtype)

    def build(self) -> torch.nn.Module:
        from inferd.quant import w4a8

        packed = repack(self.target, self.parts)
        if self.target == "blocks":
            return gguf_blocks.BlocksLinear.from_packed(self.type, packed, self.out_features, self.in_features,
                                                        self.bias, self.dtype)
        layer = w4a8.W4A8Linear if self.target == "w4a8" else w4a8.W8A8Linear
        return layer.from_packed(packed, self.out_features, self.in_features, self.bias, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.type} -> {self.target}, in={self.in_features}, out={self.out_features}"


class FusedParts(torch.nn.Module):
    """A fused layer whose GGUF parts are of different types (Q4_K_M's attn_v is often Q6_K beside
    Q4_K attn_q and attn_k): each part through its own kernel, outputs side by side, then the fused
    layer's bias (Qwen2's q/k/v biases) once."""

    def __init__(self, parts: list[torch.nn.Module], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def take_rows(self, rows: torch.Tensor, take) -> "FusedParts":
        """Tensor parallelism's column cut: each part keeps its own rows among `rows`."""
        out = [take(self.parts[i], mine) for i, mine in rows_by_part(rows, [p.out_features for p in self.parts])]
        return FusedParts(out, None if self.bias is None else self.bias.index_select(0, rows))

    def take_cols(self, a: int, b: int, take) -> "FusedParts":
        return FusedParts([take(p, a, b) for p in self.parts], self.bias)


def finalize(model, release=None) -> int:
    """Every GGUFLinear -> its final layer, repacked once from the mapped blocks (after tensor
    parallelism's cut); `release(parts)` is told after each, so the loader can drop the mapped pages
    it read. Returns how many."""
    n = 0
    for parent, name, child in children_of(model, GGUFLinear):
        setattr(parent, name, child.build())
        if release is not None:
            release(child.parts)
        n += 1
    return n

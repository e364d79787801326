"""`--quantization gguf`: serve a GGUF file's own blocks. Q4_0 / Q4_1 go through the int4 kernel and
Q8_0 through the int8 one (their codes and fp16 block scales are Int8Linear's form); the K-quants,
Q5_0/Q5_1 and IQ4 through quant.gguf_blocks' kernel, in their own bits; F16/BF16 through quant.half.

No re-rounding: a block of 32 weights (scale d, plus min m for Q4_1, and 4-bit codes q) becomes one
group of inferd's int4 form w = q * scale + min with scale = d and min = m (Q4_1) or -8 d (Q4_0):
the same products and sum gguf's own dequantization computes. A Q4_K super-block (256 weights: fp16
d and dmin, eight 6-bit scales and mins, 4-bit codes) is eight such groups of 32, with
scale = d * sc and min = -(dmin * m): exact in fp32 (an 11-bit mantissa times a 6-bit integer), and
again the very products gguf computes.

Each layer is built from its parts in the loader's plan (inferd.loading.plan): the raw blocks of the
file's tensors, which the layer keeps as views of the file's mapping (`GGUFLinear`) until the model
is final (tensor parallelism cuts them by rows and columns first), then repacks once into its
kernel's records (`finalize`). A layer whose parts differ in type (Q4_K_M's Q6_K attn_v beside Q4_K
q and k) runs each run of one type through its own kernel (`FusedParts`). A part of a type without a
kernel leaves its layer to the dense fallback, which the loader logs and counts.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.model.planned import rows_by_part
from inferd.quant import gguf_blocks

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1")
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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


def repack_w4a8(type_name: str, parts, rows=None) -> torch.Tensor:
    """Q4_0, Q4_1 or Q4_K tensors stacked along the output rows -> W4A8Linear's records: exactly
    `w4a8.pack4(*int4_blocks(stacked rows))` (half=None: fp16 scales and mins when every one is an
    fp16 value, as GGUF's Q4_0/Q4_1 ones are unless a Q4_0 |d| > 8188 puts -8 d past fp16; Q4_K's
    d * sc seldom are, so its records are mostly fp32's), in C++ from the file's bytes where the
    native kernels are built. `parts` and `rows` as gguf_blocks.repack takes them."""
    from gguf import GGMLQuantizationType as Q

    from inferd.kernels.native import ops
    from inferd.quant.w4a8 import pack4

    if type_name not in ("Q4_0", "Q4_1", "Q4_K"):
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


def kind_of(type_name: str, shape) -> str | None:
    """How a tensor of this type and shape ([N, K]) runs from its blocks: "int4" (Q4_0/Q4_1), "int8"
    (Q8_0), "blocks" (the other types quant.gguf_blocks serves), "half" (F16/BF16 in their 16 bits:
    quant.half), or None (dense: F32, or a type or shape without a kernel)."""
    from inferd.quant import half
    from inferd.quant.gguf_blocks import FORMATS

    if len(shape) != 2:
        return None
    K = int(shape[1])
    if type_name in half.TYPES:
        return "half" if K % half.K_MULTIPLE == 0 else None
    if type_name in INT4_TYPES:
        return "int4" if K % GROUP == 0 else None
    if type_name == "Q8_0":
        return "int8" if K % GROUP == 0 else None
    f = FORMATS.get(type_name)
    if f is None or K % (32 * f.super_blocks):
        return None
    return "blocks"


def _kind(part) -> str | None:
    return kind_of(part.type, part.shape)


def plan_has_kernels(plan) -> bool:
    """Whether any projection of a loader's plan has a kernel for its type."""
    return any(_kind(p) is not None for path, (parts, _) in plan.linears.items()
               if path.rsplit(".", 1)[-1] in PROJECTIONS for p in parts)


def head_has_kernel(plan) -> bool:
    """Whether the output layer runs from its own blocks (Q8_0, a K-quant, F16/BF16); a Q4_0/Q4_1
    head is re-rounded to int8 instead (--quantize-lm-head)."""
    (part,), _ = plan.linears["lm_head"]
    return _kind(part) in ("int8", "blocks", "half")


# -- the layers ------------------------------------------------------------------------------------


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
        raise InferdError("a GGUF layer runs once the model is final (inferd.quant.gguf_native.finalize)")

    def take_rows(self, rows: torch.Tensor, take=None) -> "GGUFLinear":
        out = [self.parts[i].take_rows(mine) for i, mine in rows_by_part(rows, [p.shape[0] for p in self.parts])]
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        return GGUFLinear(out, self.target, bias, self.dtype)

    def take_cols(self, a: int, b: int, take=None) -> "GGUFLinear":
        return GGUFLinear([p.take_cols(a, b) for p in self.parts], self.target, self.bias, self.dtype)

    def build(self) -> torch.nn.Module:
        from inferd.quant import gguf_blocks, w4a8

        raws, rows = [p.raw() for p in self.parts], [p.rows for p in self.parts]
        if self.target == "blocks":
            packed = gguf_blocks.repack(self.type, raws, rows)
            return gguf_blocks.BlocksLinear.from_packed(self.type, packed, self.out_features, self.in_features,
                                                        self.bias, self.dtype)
        if self.target == "w4a8":
            return w4a8.W4A8Linear.from_packed(repack_w4a8(self.type, raws, rows), self.out_features,
                                               self.in_features, self.bias, self.dtype)
        if self.target == "w8a8":
            return w4a8.W8A8Linear.from_packed(repack_w8a8(raws, rows), self.out_features, self.in_features,
                                               self.bias, self.dtype)
        raise InferdError(f"unknown GGUF layer target {self.target!r}")

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


def _runs(parts: list) -> list[tuple[str, list]]:
    """Consecutive parts of one type: (type, parts)."""
    runs: list[tuple[str, list]] = []
    for p in parts:
        if runs and runs[-1][0] == p.type:
            runs[-1][1].append(p)
        else:
            runs.append((p.type, [p]))
    return runs


def _run_layer(kind: str, parts: list, ctx, dtype: torch.dtype) -> torch.nn.Module:
    """The layer of one run of parts of one type (no bias: the caller adds it)."""
    from inferd.quant.half import HalfLinear
    from inferd.quant.half import weights as half_weights
    from inferd.quant.linear import Int4Linear, Int8Linear

    packed = ctx.activations and not ctx.dense
    if kind == "blocks":
        return GGUFLinear(parts, "blocks", None, dtype)
    if kind == "half":
        return HalfLinear(torch.cat([half_weights(p) for p in parts]), None, dtype)
    if kind == "int4":
        if packed:
            return GGUFLinear(parts, "w4a8", None, dtype)
        q, s, m = (torch.cat(c) for c in zip(*(int4_blocks(p) for p in parts)))
        return Int4Linear(q, s, m, GROUP, None, dtype, ctx.dense)
    if packed:
        return GGUFLinear(parts, "w8a8", None, dtype)
    q, s = (torch.cat(c) for c in zip(*(q8_blocks(p) for p in parts)))
    return Int8Linear(q, s, None, dtype, ctx.dense)


def build_layer(lin, ctx, dtype: torch.dtype) -> tuple[torch.nn.Module | None, str]:
    """A placeholder (inferd.model.planned.PlannedLinear) -> its layer from the file's blocks and the
    kind it took ("int4", "blocks", ..., "mixed"), or (None, why) where it stays for the dense
    fallback."""
    kinds = [_kind(p) for p in lin.parts]
    if None in kinds:
        bad = lin.parts[kinds.index(None)]
        return None, f"{bad.type} {tuple(bad.shape)} has no kernel"
    if ctx.dense and ("blocks" in kinds or "half" in kinds):
        return None, "fp32-activation evaluation keeps block types dense"
    bias = lin.dense_bias(dtype)
    runs = _runs(lin.parts)
    mods = [_run_layer(_kind(ps[0]), ps, ctx, dtype) for _, ps in runs]
    if len(mods) == 1:
        mods[0].bias = bias
        return mods[0], kinds[0]
    return FusedParts(mods, bias), "mixed"


def apply(model, ctx) -> str:
    """The registry's entry for `gguf`: every projection (and, with `--quantize-lm-head`, the output
    layer) whose parts have kernels, from the file's own blocks; the rest stays for the loader's
    dense fallback. A Q4_0/Q4_1 output layer, which has no int8 form in the file, is re-rounded to
    int8 per 32-block (of the dequantized Q4 weights that is exact)."""
    from inferd.model.planned import PlannedLinear, planned_paths, role
    from inferd.quant.linear import Int8Linear, quantize_int8

    if ctx.plan is None or ctx.plan.kind != "gguf":
        raise InferdError("--quantization gguf needs a .gguf model file")
    n: dict[str, int] = {}
    for path, parent, name, lin in list(planned_paths(model)):
        if role(path) not in PROJECTIONS and not (role(path) == "lm_head" and ctx.lm_head):
            continue  # the router stays float, as in vLLM
        if role(path) == "lm_head" and any(_kind(p) == "int4" for p in lin.parts):
            layer, kind = None, "a 4-bit head is re-rounded to int8"  # the logits are worth 8 bits (head_has_kernel)
        else:
            layer, kind = build_layer(lin, ctx, model.dtype)
        if layer is None:
            if role(path) == "lm_head":
                q, s = quantize_int8(lin.dense_weight(torch.float32))
                setattr(parent, name, Int8Linear(q, s, lin.dense_bias(model.dtype), model.dtype, ctx.dense))
                n["lm_head int8"] = 1
            continue
        setattr(parent, name, layer)
        if role(path) != "lm_head":
            n[kind] = n.get(kind, 0) + 1
        else:
            n[f"lm_head {kind}"] = 1
    if not any(k for k in n if not k.startswith("lm_head")) and any(
            isinstance(m, PlannedLinear) for m in model.modules()):
        raise InferdError("--quantization gguf needs weights of a type with a kernel in the GGUF file (Q4_0, Q4_1, "
                          "Q8_0, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS, F16 or BF16)")
    kinds = " + ".join(f"{v} {k}" if not k.startswith("lm_head") else k for k, v in n.items())
    return f"gguf-native: {kinds} from the file's own blocks"


def finalize(model, release=None) -> int:
    """Every GGUFLinear -> its final layer, repacked once from the mapped blocks (after tensor
    parallelism's cut); `release(parts)` is told after each, so the loader can drop the mapped pages
    it read. Returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGUFLinear):
                setattr(parent, name, child.build())
                if release is not None:
                    release(child.parts)
                n += 1
    return n

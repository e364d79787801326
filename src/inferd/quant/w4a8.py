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

Every forward rounds x the same way, and every number of rows goes through the same integer GEMM
(csrc/cpu/w4a8_impl.h): a decode step's one row, a batch of 64, a 512-token prefill chunk. The
weights are repacked once, here, into groups of 16 output columns that fill a vector's lanes
(`pack4`, `pack8`); no step ever makes a dequantized copy of a layer, and a row's result is
bit-identical whatever batch it is in and on every ISA variant (tests/test_native.py).

The kernel reads codes in that layout of ours, taken from the method's codes (`Int4Linear.codes()`),
never from PyTorch's packed int4 bytes, whose layout depends on the CPU (its AVX2 and AVX-512 builds
differ).
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.errors import InferdError
from inferd.kernels.native import BLOCK
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


# Dequantized copies of a layer's weights made since import: only `dequantized()` (eval, tests) makes
# one; a forward never does (tests/test_w4a8.py asserts 0 over a 512-token prefill).
dequantized_copies = 0

GROUP = 16  # output columns per packed group: one vector's lanes (csrc/cpu/w4a8_impl.h)
PAIR = 2 * GROUP  # two groups share a record per 32-block (codes, then scales, then mins)


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [P, 2, 16, ...]: output rows padded with zeros to whole pairs of groups."""
    pad = -t.shape[0] % PAIR
    if pad:
        t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])
    return t.reshape(-1, 2, GROUP, *t.shape[1:])


def exactly_half(*ts: torch.Tensor) -> bool:
    """Whether every value is an fp16 value (GGUF's block scales are): the records then hold them
    in 2 bytes, with no loss."""
    return all(torch.equal(t.float().half().float(), t.float()) for t in ts)


def _floats(s: torch.Tensor, half: bool) -> torch.Tensor:
    """Per (row, 32-block) scales [N, nb] -> the records' bytes [P, nb, 2 * 16 * (2 or 4)]."""
    g = _pairs(s.float().half() if half else s.float()).permute(0, 3, 1, 2).contiguous()  # P, nb, 2, 16
    return g.view(torch.uint8).reshape(g.shape[0], g.shape[1], -1)


def _unfloats(b: torch.Tensor, N: int) -> torch.Tensor:
    P, nb = b.shape[:2]
    dt = torch.float16 if b.shape[2] == 2 * GROUP * 2 else torch.float32
    return b.contiguous().view(dt).float().reshape(P, nb, 2, GROUP).permute(0, 2, 3, 1).reshape(-1, nb)[:N]


def _check_k(K: int) -> None:
    if K % BLOCK:
        raise InferdError(f"W4A8/W8A8 layers need an input size that is a multiple of {BLOCK} (got {K})")


def pack4(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, half: bool | None = None) -> torch.Tensor:
    """int4 codes [N, K] (0..15) with w = q s + m per 32-block (s, m [N, K / 32]) -> uint8
    [ceil(N / 32), K / 32 * (640 or 768)]: per pair of 16-column groups and 32-block, each group's 256
    bytes of codes (chunk c's byte 4l + p holds q[l, 4c + p] in its low nibble and q[l, 16 + 4c + p]
    in its high one), then both groups' scales, then their mins: fp16 where all of them are fp16
    values (GGUF's), else fp32."""
    N, K = q.shape
    _check_k(K)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise InferdError("4-bit codes must lie in 0..15")
    g = _pairs(q.to(torch.uint8)).reshape(-1, 2, GROUP, K // BLOCK, 2, 4, 4)  # P, j, l, b, half, c, p
    g = g.permute(0, 3, 1, 5, 2, 6, 4)  # P, b, j, c, l, p, half
    codes = (g[..., 0] | (g[..., 1] << 4)).reshape(g.shape[0], K // BLOCK, -1)
    half = exactly_half(s, m) if half is None else half
    return torch.cat([codes, _floats(s, half), _floats(m, half)], dim=2).reshape(codes.shape[0], -1).contiguous()


def unpack4(p: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack4: (q int32 [N, K], s, m fp32 [N, K / 32])."""
    nb = K // BLOCK
    r = p.reshape(p.shape[0], nb, -1)
    g = r[..., :512].reshape(-1, nb, 2, 4, GROUP, 4)  # P, b, j, c, l, p
    g = torch.stack([g & 15, g >> 4], dim=-1)  # ..., half
    q = g.permute(0, 2, 4, 1, 6, 3, 5).reshape(-1, K)[:N].to(torch.int32)
    f = (r.shape[2] - 512) // 2
    return q, _unfloats(r[..., 512:512 + f], N), _unfloats(r[..., 512 + f:], N)


def pack8(q: torch.Tensor, s: torch.Tensor, half: bool | None = None) -> torch.Tensor:
    """int8 codes [N, K] with one fp32 scale per (row, 32-block) [N, K / 32] -> uint8
    [ceil(N / 32), K / 32 * 1152]: per pair of groups and 32-block each group's 512 code bytes
    (chunk c's byte 4l + p is q[l, 4c + p]), then both groups' scales (fp16 where exact)."""
    N, K = q.shape
    _check_k(K)
    g = _pairs(q.to(torch.int8).view(torch.uint8)).reshape(-1, 2, GROUP, K // BLOCK, 8, 4)  # P, j, l, b, c, p
    codes = g.permute(0, 3, 1, 4, 2, 5).reshape(g.shape[0], K // BLOCK, -1)
    half = exactly_half(s) if half is None else half
    return torch.cat([codes, _floats(s, half)], dim=2).reshape(codes.shape[0], -1).contiguous()


def unpack8(p: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = K // BLOCK
    r = p.reshape(p.shape[0], nb, -1)
    g = r[..., :1024].reshape(-1, nb, 2, 8, GROUP, 4)  # P, b, j, c, l, p
    q = g.permute(0, 2, 4, 1, 3, 5).reshape(-1, K)[:N].contiguous().view(torch.int8)
    return q, _unfloats(r[..., 1024:], N)


def block_scales(scale: torch.Tensor, K: int) -> torch.Tensor:
    """A per-row [N] or per-group [N, K / g] scale as one per 32-block [N, K / 32] (fp32)."""
    s = scale.float()
    if s.dim() == 1:
        s = s[:, None]
    if (K // BLOCK) % s.shape[1]:
        raise InferdError(f"W4A8/W8A8 need groups that are multiples of {BLOCK} (got {K // s.shape[1]})")
    return s.repeat_interleave((K // BLOCK) // s.shape[1], dim=1)


# -- the module and the rewrite ---------------------------------------------------------------

class W4A8Linear(nn.Module):
    """int4 weights (32-blocks, fp32 s and m, packed by `pack4`); x rounded to int8 per 32-block
    inside the kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W4A8 needs its C++ kernel, which did not build (no compiler?)")
        if group_size % BLOCK or self.in_features % group_size:
            raise InferdError(f"W4A8 needs int4 groups that are multiples of {BLOCK} (got {group_size})")
        K = self.in_features
        self.register_buffer("packed", pack4(q, block_scales(scale, K), block_scales(mn, K)))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None:  # the model's own calls: skip the reshapes (~120 calls a token)
            return self.kernel.w4a8_linear(x, self.packed, self.out_features)
        shape = x.shape
        y = self.kernel.w4a8_linear(x.reshape(-1, shape[-1]), self.packed, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    w8 = False  # the fused decode step's kind (inferd.model.fused_decode)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                    dtype: torch.dtype) -> "W4A8Linear":
        """A layer from `pack4`'s records (gguf_layer.repack makes them from a file's bytes)."""
        return _from_packed(cls, packed, out_features, in_features, bias, dtype, (640, 768))

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K], scale, min fp32 [N, K / 32]): what the kernel multiplies by."""
        return unpack4(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        global dequantized_copies
        dequantized_copies += 1
        from inferd.quant.linear import dequantize_int4

        return dequantize_int4(*self.codes(), BLOCK)


class W8A8Linear(nn.Module):
    """int8 weights with one scale per output row [N] or per (row, 32-block) [N, K / 32] (Q8_0's
    form), packed by `pack8`; x rounded like W4A8Linear's."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W8A8 needs the W4A8 C++ kernel, which did not build (no compiler?)")
        self.register_buffer("packed", pack8(q, block_scales(scale, self.in_features)))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    w8 = True

    @classmethod
    def from_packed(cls, packed: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None,
                    dtype: torch.dtype) -> "W8A8Linear":
        """A layer from `pack8`'s records (gguf_layer.repack makes them from a file's bytes)."""
        return _from_packed(cls, packed, out_features, in_features, bias, dtype, (1088, 1152))

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [N, K], scale fp32 [N, K / 32])."""
        return unpack8(self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        global dequantized_copies
        dequantized_copies += 1
        from inferd.quant.linear import dequantize_int8

        return dequantize_int8(*self.codes())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel.w8a8_linear(x.reshape(-1, shape[-1]), self.packed, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def _from_packed(cls, packed, N: int, K: int, bias, dtype, cell_bytes: tuple[int, int]):
    _check_k(K)
    cells = (N + PAIR - 1) // PAIR * (K // BLOCK)
    if packed.dtype != torch.uint8 or packed.numel() not in (cells * cell_bytes[0], cells * cell_bytes[1]):
        raise InferdError(f"{cls.__name__} records do not match a {N} x {K} layer")
    kernel = load()
    if kernel is None:
        raise InferdError(f"{cls.__name__} needs its C++ kernel, which did not build (no compiler?)")
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.out_features, m.in_features, m.kernel, m.dtype = N, K, kernel, dtype
    m.register_buffer("packed", packed.reshape((N + PAIR - 1) // PAIR, -1).contiguous())
    m.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
    return m


class PackedEmbedding(nn.Module):
    """The token embedding of a tied model read from its W8A8 lm_head's codes: the one matrix held
    once, in Q8_0's 1.06 bytes a weight, instead of a float table beside the packed head (for the
    default model: 113 MB of fp32 embedding gone). Used only where the codes give back the table's
    own values exactly (GGUF's Q8_0 embedding does)."""

    def __init__(self, head: "W8A8Linear", dtype: torch.dtype):
        super().__init__()
        self._head = [head]  # not a submodule: the head is the model's own lm_head
        self.dtype = dtype
        K, R = head.in_features, head.packed.shape[1] // (head.in_features // BLOCK)
        fs = (R - 1024) // (2 * GROUP)  # 2 (fp16) or 4 (fp32) bytes a scale
        n = torch.arange(PAIR)
        j, lane = (n // GROUP)[:, None], (n % GROUP)[:, None]
        k = torch.arange(K)[None]
        # byte offsets in a pair's records of row n's codes [32, K] and of its block scales [32, nb, fs]
        self.register_buffer("code_at", (k // BLOCK) * R + j * 512 + 64 * ((k % BLOCK) // 4) + 4 * lane + k % 4,
                             persistent=False)
        b = torch.arange(K // BLOCK)[None, :, None]
        self.register_buffer("scale_at", b * R + 1024 + (j[..., None] * GROUP + lane[..., None]) * fs
                             + torch.arange(fs), persistent=False)
        self.scale_dtype = torch.float16 if fs == 2 else torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from inferd.quant.linear import dequantize_int8

        packed = self._head[0].packed
        flat = ids.reshape(-1)
        rec, r = packed[flat // PAIR], flat % PAIR
        q = torch.gather(rec, 1, self.code_at[r]).view(torch.int8)
        s = torch.gather(rec, 1, self.scale_at[r].flatten(1)).view(self.scale_dtype)
        return dequantize_int8(q, s.float()).to(self.dtype).view(*ids.shape, -1)


def tie_embedding(model: nn.Module) -> bool:
    """Swap the float embedding for one read from the W8A8 lm_head's codes, where those give back
    the table exactly; returns whether it did."""
    head, emb = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not isinstance(head, W8A8Linear) or not isinstance(emb, nn.Embedding) or head.bias is not None:
        return False
    if emb.weight.shape != (head.out_features, head.in_features) or emb.weight.dtype != torch.float32:
        return False
    from inferd.quant.linear import dequantize_int8

    packed = PackedEmbedding(head, emb.weight.dtype)
    q, s = head.codes()
    for i in range(0, head.out_features, 8192):  # the whole table, in slices: exact or nothing
        if not torch.equal(dequantize_int8(q[i:i + 8192], s[i:i + 8192]), emb.weight[i:i + 8192]):
            return False
    # and the lookup's own byte offsets read those codes: every row of the first and last records
    # (each lane and group position) and a spread of rows between
    n = head.out_features
    ids = torch.unique(torch.cat([torch.arange(min(n, 2 * PAIR)), torch.arange(max(0, n - 2 * PAIR), n),
                                  torch.linspace(0, n - 1, min(n, 4096)).long()]))
    if not torch.equal(packed(ids), emb.weight[ids]):
        return False
    model.embed_tokens = packed
    return True


def quantize_activations(model: nn.Module, already: int = 0, float_layers: int = 0) -> int:
    """Rewrite every packed linear of the model to take int8 activations: int4 ones into W4A8, and
    int8 ones (the int8 methods, an output layer re-rounded to int8) into W8A8, same weights (the
    engine then runs decode-only steps as one C++ call where it can: inferd.model.fused_decode).
    Returns how many linears take int8 activations (`already`: those built so from a GGUF's blocks);
    a model without any (nor `float_layers`: a GGUF's F16/BF16 ones, kept in 16 bits with float
    activations) is a clear error."""
    from inferd.model.planned import children_of
    from inferd.quant.linear import Int4Linear, Int8Linear

    if load() is None:
        raise InferdError("--quantize-activations needs the W4A8 C++ kernel, which did not build (no compiler?)")
    n = already
    for parent, name, child in children_of(model, (Int4Linear, Int8Linear)):
        if isinstance(child, Int4Linear):
            if child.dense:
                raise InferdError("--quantize-activations needs packed int4 layers, not dense ones")
            setattr(parent, name, W4A8Linear(*child.codes(), child.group_size, child.bias, model.dtype))
        else:
            if child.dense:
                raise InferdError("--quantize-activations needs packed int8 layers, not dense ones")
            setattr(parent, name, W8A8Linear(*child.codes(), child.bias, model.dtype))
        n += 1
    if n == 0 and not float_layers:
        raise InferdError("--quantize-activations applies to packed int4/int8 weights: this model has none")
    tie_embedding(model)
    return n


def int8_activation_layers(model: nn.Module) -> int:
    """How many of the model's linears already take int8 activations."""
    from inferd.quant.gguf_blocks import BlocksLinear

    return sum(isinstance(m, (W4A8Linear, W8A8Linear, BlocksLinear)) for m in model.modules())

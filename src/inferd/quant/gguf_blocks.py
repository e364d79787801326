"""GGUF's K-quants (Q2_K..Q6_K), Q5_0/Q5_1 and IQ4_NL/IQ4_XS served from their own bits.

Each type decodes, exactly, into one form (`Codes`): w = s * (q - off) [- m], with q the code (or
an index into IQ4's table), s = d * sc (fp16 d per 256-weight super-block, int8 sub-scale sc per 16
or 32 weights) or d (fp16 per 32-block), and the mins dmin * mn (K-quants) or m (Q5_1). gguf's own
dequantization computes those very products, so `dequantize(codes)` equals it bit for bit
(tests/test_gguf_blocks.py). `pack` lays the codes out for the kernel (csrc/cpu/gguf_blocks_impl.h):
the file's bit widths and scales kept, about the file's bytes a layer.

The kernel multiplies them against activations rounded to int8 per 32-block, like W4A8: the
choice llama.cpp makes for these types on the CPU. `BlocksLinear` holds the decoded form until the
model is final (tensor parallelism cuts it by rows, or by columns on super-block boundaries), then
only the packed records.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from inferd.errors import InferdError


@dataclass(frozen=True)
class Format:
    id: int  # csrc/cpu/kernels.h BlockType
    bits: int  # code bits stored: base + high planes
    sub: int  # weights a scale
    ks: bool  # int8 sub-scales under an fp16 d per 256 weights (else an fp16 d per 32)
    mink: int  # 0 none, 1 dmin * mn per sub, 2 an fp16 m per 32
    off: int
    lut: bool = False
    block_bytes: int = 0  # the file's bytes per block
    block_weights: int = 256
    base: int = 4  # low bits a code keeps together (nibbles, or 2-bit fields); the rest are bit planes
    smpack: bool = False  # 4-bit sub-scale and min in one byte (Q2_K)

    @property
    def high(self) -> int:
        return self.bits - self.base

    @property
    def super_blocks(self) -> int:
        return 8 if self.ks else 1

    @property
    def record(self) -> int:
        """Bytes a pair of 16-column groups and super-block (kernels.h block_record)."""
        subs = self.super_blocks * (32 // self.sub) * 32
        header = (64 + (64 if self.mink else 0) + (subs if self.ks else 0)
                  + (subs if self.mink == 1 and not self.smpack else 0))
        return header + self.super_blocks * (128 * self.base + 128 * self.high)


FORMATS: dict[str, Format] = {
    "Q4_K": Format(0, 4, 32, True, 1, 0, block_bytes=144),
    "Q5_K": Format(1, 5, 32, True, 1, 0, block_bytes=176),
    "Q6_K": Format(2, 6, 16, True, 0, 32, block_bytes=210),
    "Q3_K": Format(3, 3, 16, True, 0, 4, block_bytes=110, base=2),
    "Q2_K": Format(4, 2, 16, True, 1, 0, block_bytes=84, base=2, smpack=True),
    "Q5_0": Format(5, 5, 32, False, 0, 16, block_bytes=22, block_weights=32),
    "Q5_1": Format(6, 5, 32, False, 2, 0, block_bytes=24, block_weights=32),
    "IQ4_NL": Format(7, 4, 32, False, 0, 0, True, block_bytes=18, block_weights=32),
    "IQ4_XS": Format(8, 4, 32, True, 0, 0, True, block_bytes=136),
}
TYPES = tuple(FORMATS)
IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                          dtype=torch.float32)
PAIR = 32  # output columns a record covers (two groups of 16)


@dataclass
class Codes:
    """One layer's weights as its GGUF type stores them, decoded: every tensor's first axis is the
    output row, its second proportional to the input (so tensor parallelism cuts them as it cuts
    any layer's codes)."""
    type: str
    q: torch.Tensor  # uint8 [N, K]
    d: torch.Tensor  # fp16 [N, K / 256] (ks) or [N, K / 32]
    sc: torch.Tensor | None = None  # int8 [N, K / sub]
    dm: torch.Tensor | None = None  # fp16: dmin [N, K / 256] (mink 1) or m [N, K / 32] (mink 2)
    mn: torch.Tensor | None = None  # int8 [N, K / sub] (mink 1)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


# -- decoding the file's blocks (numpy, exact) ------------------------------------------------

def f16(b: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] -> the fp16 values they store [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """Little-endian bits of bytes [..., m] -> [..., m * 8 // ...] in bit order: element i = bit i % 8 of byte i // 8."""
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :n]


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-block -> 32 codes: low nibbles the first 16, high the last."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def decode(type_name: str, raw: np.ndarray) -> Codes:
    """A tensor's bytes [N, K / w * bytes] of GGUF type `type_name` -> its Codes."""
    f = FORMATS[type_name]
    N = raw.shape[0]
    blk = raw.reshape(N, -1, f.block_bytes)
    S = blk.shape[1]
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a.reshape(N, -1)).astype(dt))  # noqa: E731
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = f16(blk[..., 0:2]), f16(blk[..., 2:4])
        sc, mn = _k_scales(blk[..., 4:16])
        if type_name == "Q4_K":
            qs = blk[..., 16:].reshape(N, S, 4, 32)
            q = np.stack([qs & 0xF, qs >> 4], axis=-2)  # [N, S, 4, 2, 32]: k = 64 g + 32 half + i
        else:
            qh, qs = blk[..., 16:48], blk[..., 48:].reshape(N, S, 4, 32)
            hb = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, 8, 32]: bit s of byte i
            q = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(N, S, 8, 32) | (hb << 4)
        return Codes(type_name, t(q, np.uint8), t(d, np.float16), t(sc, np.int8), t(dmin, np.float16), t(mn, np.int8))
    if type_name == "Q6_K":
        ql, qh = blk[..., 0:128].reshape(N, S, 2, 64), blk[..., 128:192].reshape(N, S, 2, 32)
        sc, d = blk[..., 192:208].view(np.int8), f16(blk[..., 208:210])
        low = np.stack([ql & 0xF, ql >> 4], axis=-2).reshape(N, S, 2, 4, 32)  # k = 128 h + 32 j + i
        high = (qh[..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, S, 2, 4, 32]
        return Codes(type_name, t(low | (high << 4), np.uint8), t(d, np.float16), t(sc, np.int8))
    if type_name in ("Q2_K", "Q3_K"):
        if type_name == "Q2_K":
            scales, qs = blk[..., 0:16], blk[..., 16:80]
            d, dmin = f16(blk[..., 80:82]), f16(blk[..., 82:84])
        else:
            hmask, qs, s12, d = blk[..., 0:32], blk[..., 32:96], blk[..., 96:108], f16(blk[..., 108:110])
        low = (qs.reshape(N, S, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # k = 128 h + 32 s + i
        if type_name == "Q2_K":
            return Codes(type_name, t(low, np.uint8), t(d, np.float16), t(scales & 0xF, np.int8),
                         t(dmin, np.float16), t(scales >> 4, np.int8))
        hb = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, 8, 32]: k = 32 s + i
        q = low.reshape(N, S, 8, 32) | (hb << 2)
        ls = np.concatenate([s12[..., 0:8] & 0xF, s12[..., 0:8] >> 4], axis=-1)  # [N, S, 16]
        hs = (s12[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [N, S, 4 bytes, 4 shifts]
        hs = hs.transpose(0, 1, 3, 2).reshape(N, S, 16)
        sc = (ls | (hs << 4)).astype(np.int16) - 32
        return Codes(type_name, t(q, np.uint8), t(d, np.float16), t(sc, np.int8))
    if type_name in ("Q5_0", "Q5_1"):
        d = f16(blk[..., 0:2])
        head = 2 if type_name == "Q5_0" else 4
        qh, qs = blk[..., head:head + 4], blk[..., head + 4:]
        q = nibbles32(qs) | (_bits(qh, 32) << 4)
        m = t(f16(blk[..., 2:4]), np.float16) if type_name == "Q5_1" else None
        return Codes(type_name, t(q, np.uint8), t(d, np.float16), dm=m)
    if type_name == "IQ4_NL":
        return Codes(type_name, t(nibbles32(blk[..., 2:]), np.uint8), t(f16(blk[..., 0:2]), np.float16))
    if type_name == "IQ4_XS":
        d = f16(blk[..., 0:2])
        sh = blk[..., 2:4].copy().view(np.uint16)[..., 0]  # [N, S]
        sl = blk[..., 4:8]
        lo = np.stack([sl & 0xF, sl >> 4], axis=-1).reshape(N, S, 8)
        hi = (sh[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
        sc = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
        q = nibbles32(blk[..., 8:].reshape(N, S, 8, 16))
        return Codes(type_name, t(q, np.uint8), t(d, np.float16), t(sc, np.int8))
    raise InferdError(f"no block kernel for GGUF type {type_name}")


def dequantize(c: Codes) -> torch.Tensor:
    """The float weights [N, K] the codes stand for: gguf's own products, in its order."""
    f = FORMATS[c.type]
    q = IQ4_VALUES[c.q.long()] if f.lut else c.q.float() - f.off
    if f.ks:
        s = (c.d.float().repeat_interleave(256 // f.sub, 1) * c.sc.float()).repeat_interleave(f.sub, 1)
    else:
        s = c.d.float().repeat_interleave(32, 1)
    w = s * q
    if f.mink == 1:
        w = w - (c.dm.float().repeat_interleave(256 // f.sub, 1) * c.mn.float()).repeat_interleave(f.sub, 1)
    elif f.mink == 2:
        w = w + c.dm.float().repeat_interleave(32, 1)
    return w


# -- the kernel's records ---------------------------------------------------------------------

def _pairs(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % PAIR
    if pad:
        t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])
    return t


def pack(c: Codes) -> torch.Tensor:
    """Codes -> uint8 [ceil(N / 32), K / (32 * super) * record]: per pair of 16-column groups and
    super-block the header (d, dmin or m, sub-scales, sub-mins; column-minor; Q2_K's scale | min << 4
    in one byte), then per block both groups' low bits (nibbles: chunk c byte 4l + p holds
    q[l, 4c + p] | q[l, 16 + 4c + p] << 4; Q2_K/Q3_K's 2-bit fields: vector c // 2 byte 4l + p holds
    q[l, 4c + p] at bit 4 (c % 2) and q[l, 16 + 4c + p] two above) and bit planes (plane j byte
    4l + p: bit base + j of q[l, 4c + p] at bit c, of q[l, 16 + 4c + p] at bit 4 + c). Q6_K's two
    high bits are 2-bit fields instead: group j's vector e (at 128 j + 64 e) byte 4l + p holds those of
    q[l, 4c + p] at bits 4-5 and of q[l, 16 + 4c + p] at bits 6-7 for c = 2e, at bits 0-1 and 2-3 for
    c = 2e + 1."""
    f = FORMATS[c.type]
    N, K = c.q.shape
    SB = f.super_blocks
    if K % (32 * SB):
        raise InferdError(f"{c.type} layers need an input size that is a multiple of {32 * SB} (got {K})")
    P, S = (N + PAIR - 1) // PAIR, K // (32 * SB)
    q = _pairs(c.q).reshape(P, 2, 16, S, SB, 2, 4, 4).to(torch.int32)  # P, j, l, s, bi, upper, c, p
    q = q.permute(0, 3, 4, 1, 6, 2, 7, 5)  # P, s, bi, j, c, l, p, upper
    if f.base == 4:
        low = (q[..., 0] & 15) | ((q[..., 1] & 15) << 4)  # P, s, bi, j, c, l, p
    else:  # chunks 2v and 2v + 1 share vector v: chunk c's codes at bits 4 (c % 2) (+ 2 for the upper 16)
        b2 = (q & 3).reshape(P, S, SB, 2, 2, 2, 16, 4, 2)  # P, s, bi, j, v, c % 2, l, p, upper
        low = sum(b2[:, :, :, :, :, cc, :, :, u] << (4 * cc + 2 * u) for cc in range(2) for u in range(2))
    parts = [low.to(torch.uint8).reshape(P, S, SB, 128 * f.base)]
    if f.high == 2:  # Q6_K: the 2 high bits as 2-bit fields (csrc/cpu/gguf_blocks_impl.h: fewer shifts than planes)
        qh = (q >> 4) & 3  # P, s, bi, j, c, l, p, upper
        byte = torch.stack([(qh[..., 2 * e, :, :, 0] << 4) | (qh[..., 2 * e, :, :, 1] << 6)
                            | qh[..., 2 * e + 1, :, :, 0] | (qh[..., 2 * e + 1, :, :, 1] << 2) for e in range(2)],
                           dim=4)  # P, s, bi, j, e, l, p
        parts.append(byte.to(torch.uint8).reshape(P, S, SB, 256))
    for h in range(f.high if f.high != 2 else 0):
        bit = (q >> (f.base + h)) & 1  # P, s, bi, j, c, l, p, upper
        byte = sum(bit[..., c_, :, :, u] << (c_ + 4 * u) for c_ in range(4) for u in range(2))  # P, s, bi, j, l, p
        parts.append(byte.to(torch.uint8).reshape(P, S, SB, 128))
    blocks = torch.cat(parts, dim=-1).reshape(P, S, -1)

    def cols(a: torch.Tensor, per_super: int) -> torch.Tensor:  # [N, S * per_super] -> [P, S, per_super * 32 bytes]
        a = _pairs(a).reshape(P, PAIR, S, per_super).permute(0, 2, 3, 1).contiguous()
        return a.view(torch.uint8).reshape(P, S, -1)

    header = [cols(c.d, 1)]
    if f.mink:
        header.append(cols(c.dm, 1))
    subs = SB * (32 // f.sub)
    if f.smpack:  # both 4-bit: one byte, the scale low
        header.append(cols((c.sc.to(torch.int32) | (c.mn.to(torch.int32) << 4)).to(torch.uint8), subs))
    else:
        if f.ks:
            header.append(cols(c.sc, subs))
        if f.mink == 1:
            header.append(cols(c.mn, subs))
    out = torch.cat(header + [blocks], dim=-1).reshape(P, -1).contiguous()
    assert out.shape[1] == S * f.record
    return out


def record_bytes(type_name: str, N: int, K: int) -> int:
    f = FORMATS[type_name]
    return (N + PAIR - 1) // PAIR * (K // (32 * f.super_blocks)) * f.record


# -- a layer's parts as bytes ------------------------------------------------------------------
# here, the lowest of the GGUF modules, so that every route from a part reads it one way: this
# module's `repack`, quant.gguf_layer's W4A8/W8A8 records and int4/int8 codes, quant.half's weights

def part_rows(part) -> tuple[np.ndarray, str]:
    """(raw rows [N, bytes] in the part's row order, type name) of a plan part or a GGUF tensor."""
    if hasattr(part, "raw"):
        raw = np.asarray(part.raw())
        rows = getattr(part, "rows", None)
        return (raw if rows is None else raw[rows.numpy()]), part.type
    return np.asarray(part.data), part.tensor_type.name


def stacked(type_name: str, parts, rows) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Parts of GGUF type `type_name` (tensor objects or their raw bytes, as `repack` takes them) ->
    their raw bytes [N_i, row bytes] (no copies) and each one's row order (None: as stored)."""
    from inferd.kernels.repack import raw_bytes, row_order

    for p in parts:
        t = getattr(p, "tensor_type", None)
        if t is not None and t.name != type_name:
            raise InferdError(f"a {t.name} part among {type_name} ones: one call repacks one type")
    raws = [raw_bytes(p) for p in parts]
    if not raws:
        raise InferdError("nothing to repack: no parts")
    rows = [None] * len(raws) if rows is None else list(rows)
    if len(rows) != len(raws):
        raise InferdError(f"{len(raws)} parts but {len(rows)} row orders")
    if len({r.shape[1] for r in raws}) != 1:
        raise InferdError(f"the parts disagree on their row bytes: {sorted({r.shape[1] for r in raws})}")
    return raws, [row_order(r, raw.shape[0]) for r, raw in zip(rows, raws)]


def stacked_rows(raws: list[torch.Tensor], orders: list) -> np.ndarray:
    """`stacked`'s parts as one array of rows in their orders: what the Python routes decode."""
    return np.concatenate([r.numpy() if o is None else r.numpy()[o.numpy()] for r, o in zip(raws, orders)])


def repack(type_name: str, parts, rows=None) -> torch.Tensor:
    """GGUF tensors of one block type stacked along the output rows -> the kernel's records: exactly
    `pack(decode(type_name, stacked rows))`, without the [N, K] codes (csrc/cpu/repack.cpp: a pair of
    output rows at a time, straight from the file's bytes; decode + pack where there is no native
    code). `parts`: GGUF tensor objects or their raw bytes [N_i, row bytes] (numpy, a read-only
    mapping included, or torch; never written). `rows`: None, or per part None (its rows as stored)
    or the source row of each output row: a permutation (`unpermute_qk(torch.arange(n), heads)`
    undoes llama.cpp's q/k interleave) or a subset (a tensor-parallel share)."""
    from inferd.kernels.native import ops

    if type_name not in FORMATS:
        raise InferdError(f"no block kernel for GGUF type {type_name}")
    raws, orders = stacked(type_name, parts, rows)
    kernels = ops()
    if kernels is not None:
        return kernels.repack_blocks(raws, orders, FORMATS[type_name].id)
    f = FORMATS[type_name]
    if raws[0].shape[1] % f.block_bytes:
        raise InferdError(f"{raws[0].shape[1]} bytes a row is not whole {type_name} blocks")
    return pack(decode(type_name, stacked_rows(raws, orders)))


# -- the layer --------------------------------------------------------------------------------

dequantized_copies = 0


class BlocksLinear(nn.Module):
    """A linear layer of one GGUF block type: its Codes until `pack_()` (the loader calls it once the
    model is final), then only the kernel's records; x rounded to int8 per 32-block."""

    def __init__(self, codes: Codes, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.type = codes.type
        self.block_type = FORMATS[self.type].id  # the kernel's BlockType (the fused decode step reads it)
        self.out_features, self.in_features = codes.q.shape
        f = FORMATS[self.type]
        if self.in_features % (32 * f.super_blocks):
            raise InferdError(f"{self.type} layers need an input size that is a multiple of {32 * f.super_blocks}")
        for k, v in codes.tensors().items():
            self.register_buffer(k, v)
        self.register_buffer("packed", None)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    @classmethod
    def from_packed(cls, type_name: str, packed: torch.Tensor, out_features: int, in_features: int,
                    bias: torch.Tensor | None, dtype: torch.dtype) -> "BlocksLinear":
        """A packed layer from its records (`repack`'s), never holding codes: for a model that is
        already final (a tensor-parallel share is cut by repack's row lists, not afterwards)."""
        f = FORMATS[type_name]
        if in_features % (32 * f.super_blocks):
            raise InferdError(f"{type_name} layers need an input size that is a multiple of {32 * f.super_blocks}")
        if packed.dtype != torch.uint8 or packed.numel() != record_bytes(type_name, out_features, in_features):
            raise InferdError(f"{type_name} records do not match a {out_features} x {in_features} layer")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.type, m.block_type = type_name, f.id
        m.out_features, m.in_features = out_features, in_features
        m.register_buffer("packed", packed.contiguous())
        m.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        m.dtype = dtype
        return m

    def codes(self) -> Codes:
        if self.packed is not None:
            raise InferdError("the layer is packed: its codes are gone")
        return Codes(self.type, **{k: getattr(self, k) for k in ("q", "d", "sc", "dm", "mn") if getattr(self, k, None) is not None})

    def pack_(self) -> None:
        from inferd.kernels.native import ops

        if ops() is None:
            raise InferdError(f"{self.type} layers need inferd's C++ kernels, which did not build (no compiler?)")
        c = self.codes()
        self.packed = pack(c)
        for k in c.tensors():
            delattr(self, k)

    def dequantized(self) -> torch.Tensor:
        global dequantized_copies
        dequantized_copies += 1
        if self.packed is None:
            return dequantize(self.codes())
        raise InferdError("a packed GGUF block layer keeps no codes to dequantize")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from inferd.kernels.native import ops

        shape = x.shape
        y = ops().blocks_linear(x.reshape(-1, shape[-1]), self.packed, self.out_features, FORMATS[self.type].id)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.type}, in={self.in_features}, out={self.out_features}"


def pack_all(model: nn.Module) -> int:
    """Pack every BlocksLinear of the model (once it is final: after tensor parallelism's cut);
    returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, BlocksLinear) and m.packed is None:
            m.pack_()
            n += 1
    return n

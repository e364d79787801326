"""Q4_K and Q5_K blocks written from float weights: the lower-bit copy of a model's output layer that
`--lm-head-quantization` serves decode from.

Why: a 1B-3B Llama's tied output layer is its token table, which a Q4_K_M file keeps in Q6_K
(6.56 bits a weight): 215 MB of the 1B's 821 MB read per token, the largest single matrix. In Q4_K
(4.5 bits) it reads 147 MB, in Q5_K (5.5 bits) 180 MB. The file's table stays as it is for the
embedding lookups; only the head's copy is rounded again, once, at load. Lossy: `inferd eval
--lm-head-quantization none,q4_k` prints what it costs (KL and top-1 against the file's own head).

The blocks are GGUF's (ggml's `block_q4_K` / `block_q5_K`, 256 weights: an fp16 scale and min of
the super-block, eight 6-bit sub-block scales and mins, then the codes), so the block kernels and
repack serve them unchanged and `gguf.quants.dequantize` reads them. The rounding is plain
min/max per 32-weight sub-block, the 6-bit sub-block scales and mins rounded up (llama.cpp searches
for better ones; `inferd eval` judges the result): w ~ d * sc[s] * q - dmin * m[s], q in 0 .. 2^bits - 1.
"""
from __future__ import annotations

import numpy as np

from inferd.errors import InferdError

QK = 256  # weights a super-block
BITS = {"Q4_K": 4, "Q5_K": 5}
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176}
# --lm-head-quantization's names -> GGUF types
HEAD_TYPES = {"q4_k": "Q4_K", "q5_k": "Q5_K"}
# bits a weight of the source types a head may be rounded down from (a lower-bit head stays as it is)
SOURCE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_0": 5.5,
               "Q5_1": 6.0, "Q4_K": 4.5}


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] (0..63) -> ggml's 12 bytes [n, 12]: bytes 0-3 and 4-7 hold
    sub-blocks 0-3's scale and min in their low 6 bits and the top 2 bits of sub-blocks 4-7's; bytes
    8-11 the low 4 bits of sub-blocks 4-7's scale (low nibble) and min (high nibble)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def quantize_blocks(w: np.ndarray, type_name: str) -> np.ndarray:
    """Float rows [N, K] (K a multiple of 256) -> their GGUF blocks [N, K / 256 * block bytes] uint8."""
    if type_name not in BITS:
        raise InferdError(f"no Q-K writer for {type_name} (choose {', '.join(BITS)})")
    N, K = w.shape
    if K % QK:
        raise InferdError(f"{type_name} needs rows of a multiple of {QK} weights, not {K}")
    top = (1 << BITS[type_name]) - 1
    x = np.asarray(w, np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-blocks, 32]
    lo = np.minimum(x.min(-1), 0.0)  # a sub-block's min at most 0 (as ggml's): m >= 0
    scale = (x.max(-1) - lo) / top
    m = -lo
    d = _fp16(scale.max(-1) / 63)
    dmin = _fp16(m.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        # rounded up, never down: a sub-block's codes then reach its max and its min is never raised
        # past its lowest weight (rounding to nearest clipped a sub-block's top weights by up to
        # half its range where an outlier elsewhere in the super-block set d)
        sc = np.where(df > 0, np.clip(np.ceil(scale / df - 1e-6), 0, 63), 0)
        mn = np.where(dminf > 0, np.clip(np.ceil(m / dminf - 1e-6), 0, 63), 0)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.clip(np.rint((x + (dminf * mn)[..., None]) / step), 0, top), 0).astype(np.uint8)
    n = x.shape[0]
    head = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8),
                           pack_scales(sc, mn)], axis=1)  # [n, 16]
    q = q.reshape(n, 4, 2, 32)  # 64-weight chunk j: its low half in the low nibbles, its high half in the high
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    if type_name == "Q4_K":
        blocks = np.concatenate([head, qs], axis=1)
    else:  # byte i of qh: bit s is the fifth bit of sub-block s's weight i
        hb = (q.reshape(n, 8, 32) >> 4) & 1
        qh = (hb << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1).astype(np.uint8)  # [n, 32]
        blocks = np.concatenate([head, qh, qs], axis=1)
    return blocks.reshape(N, K // QK * BLOCK_BYTES[type_name])


def requantize_rows(raw: np.ndarray, src_type: str, type_name: str, chunk: int = 4096) -> np.ndarray:
    """A GGUF tensor's raw rows [N, row bytes] of `src_type` -> the same weights in `type_name`'s
    blocks, a chunk of rows at a time (never the whole matrix in float)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[src_type]
    out = None
    for r0 in range(0, raw.shape[0], chunk):
        rows = np.ascontiguousarray(raw[r0:r0 + chunk])
        w = rows.astype(np.float32) if rows.dtype != np.uint8 else dequantize(rows, qtype)  # F32/F16: values
        blk = quantize_blocks(w.reshape(w.shape[0], -1), type_name)
        if out is None:
            out = np.empty((raw.shape[0], blk.shape[1]), np.uint8)
        out[r0:r0 + chunk] = blk
    return out

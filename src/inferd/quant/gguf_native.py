"""`--quantization gguf`: serve a GGUF file's own Q4_0 / Q4_1 / Q4_K blocks through the int4 kernel,
and its Q8_0 blocks through the int8 one (their codes and fp16 block scales are Int8Linear's form).

No re-rounding: a block of 32 weights (scale d, plus min m for Q4_1, and 4-bit codes q) becomes one
group of inferd's int4 form w = q * scale + min with scale = d and min = m (Q4_1) or -8 d (Q4_0):
the same products and sum gguf's own dequantization computes. A Q4_K super-block (256 weights: fp16
d and dmin, eight 6-bit scales and mins, 4-bit codes) is eight such groups of 32, with
scale = d * sc and min = -(dmin * m): exact in fp32 (an 11-bit mantissa times a 6-bit integer), and
again the very products gguf computes. Layers stored in other types keep their dequantized float
weights.
"""
from __future__ import annotations

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.gguf_file import unpermute_qk

GROUP = 32


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def q4k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K bytes [N, K / 256 * 144] -> (q int32 [N, K], scale, min fp32 [N, K / 32])."""
    N = raw.shape[0]
    blk = raw.reshape(N, -1, 144)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]  # [N, S, 1]
    dmin = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    sm = blk[..., 4:16].astype(np.uint8)  # eight 6-bit scales and eight 6-bit mins in 12 bytes
    sc = np.concatenate([sm[..., 0:4] & 63, (sm[..., 8:12] & 0xF) | ((sm[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([sm[..., 4:8] & 63, (sm[..., 8:12] >> 4) | ((sm[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blk[..., 16:].reshape(N, -1, 4, 32)  # four runs of 32 bytes: low nibbles one group, high the next
    q = np.stack([qs & 0xF, qs >> 4], axis=-2).reshape(N, -1).astype(np.int32)
    scale = (d * sc.astype(np.float32)).reshape(N, -1)
    minus = -(dmin * mn.astype(np.float32)).reshape(N, -1)
    return q, scale, minus


def int4_blocks(t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K ReaderTensor -> (q int32 [N, K] in 0..15, scale [N, K/32], min [N, K/32]) fp32."""
    from gguf import GGMLQuantizationType as Q

    raw = np.asarray(t.data)
    N = raw.shape[0]
    if t.tensor_type == Q.Q4_K:
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in q4k_blocks(raw))
    size = {Q.Q4_0: 18, Q.Q4_1: 20}[t.tensor_type]
    blk = raw.reshape(N, -1, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.tensor_type == Q.Q4_1:
        m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blk[..., 4:]
    else:
        qs = blk[..., 2:]
        m = -8 * d  # exact: a power-of-two multiple
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(N, -1).astype(np.int32)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def q8_blocks(t) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 ReaderTensor (blocks of fp16 d and 32 int8 codes) -> (q int8 [N, K], scale fp32 [N, K/32])."""
    raw = np.asarray(t.data)
    blk = raw.reshape(raw.shape[0], -1, 34)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blk[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d)


def _kind(ts) -> str | None:
    """How a fused layer's GGUF parts run from their blocks: "int4", "int8" (Q8_0), or None (dense)."""
    if any(t is None for t in ts):
        return None
    names = {t.tensor_type.name for t in ts}
    return "int4" if names <= set(INT4_TYPES) else "int8" if names == {"Q8_0"} else None


def apply_gguf_blocks(model, reader, cfg, dense: bool = False) -> dict[str, int]:
    """Replace every linear whose GGUF parts are all Q4_0/Q4_1/Q4_K by an Int4Linear, and every one
    whose parts are all Q8_0 by an Int8Linear of the file's codes and block scales (the same blocks,
    inferd's int8 kernels; W8A8 with --quantize-activations); returns how many of each kind."""
    from inferd.quant.linear import Int4Linear, Int8Linear

    tensors = {t.name: t for t in reader.tensors}
    from inferd.model import registry

    permute = registry.by_name(cfg.architecture).gguf_interleaved_qk
    plan = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"],
            "gate_up_proj": ["ffn_gate", "ffn_up"], "down_proj": ["ffn_down"]}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    n = {"int4": 0, "int8": 0}
    for i, layer in enumerate(model.layers):
        for ours, parts in plan.items():
            ts = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            kind = _kind(ts)
            if kind is None:
                continue
            cols = []
            for p, t in zip(parts, ts):
                codes = int4_blocks(t) if kind == "int4" else q8_blocks(t)
                if permute and p in heads:  # same row order as the float weights
                    codes = tuple(unpermute_qk(x, heads[p]) for x in codes)
                cols.append(codes)
            lin = getattr(layer, ours)
            cat = [torch.cat(c) for c in zip(*cols)]
            setattr(layer, ours, Int4Linear(*cat, GROUP, lin.bias, model.dtype, dense) if kind == "int4"
                    else Int8Linear(*cat, lin.bias, model.dtype, dense))
            n[kind] += 1
    if not any(n.values()):
        raise InferdError("--quantization gguf needs Q4_0, Q4_1, Q4_K or Q8_0 weights in the GGUF file")
    return n


def apply(model, ctx) -> str:
    """The registry's entry for `gguf` (`--quantize-lm-head`: the Q8_0 output layer to int8 with its own block scales)."""
    from inferd.quant.linear import weight_bytes
    from inferd.quant.rtn import quantize_lm_head_int8

    if ctx.reader is None:
        raise InferdError("--quantization gguf needs a .gguf model file")
    before = weight_bytes(model)
    n = apply_gguf_blocks(model, ctx.reader, ctx.config, ctx.dense)
    if ctx.lm_head:
        quantize_lm_head_int8(model, ctx.dense)
    kinds = " + ".join(f"{k} {v}" for k, v in n.items() if v)
    return (f"gguf-native: {kinds} linears from the file's own blocks{', lm_head int8' if ctx.lm_head else ''}; "
            f"weights {before / 2**20:.1f} MiB -> {weight_bytes(model) / 2**20:.1f} MiB")

"""`--quantization gguf`: serve a GGUF file's own blocks. Q4_0 / Q4_1 go through the int4 kernel and
Q8_0 through the int8 one (their codes and fp16 block scales are Int8Linear's form); the K-quants,
Q5_0/Q5_1 and IQ4 through quant.gguf_blocks' kernel, in their own bits.

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


INT4_TYPES = ("Q4_0", "Q4_1")


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


def _kind(t) -> str | None:
    """How one GGUF tensor runs from its blocks: "int4" (Q4_0/Q4_1), "int8" (Q8_0), "blocks" (the
    other types quant.gguf_blocks serves), "half" (F16/BF16 in their 16 bits: quant.half), or None
    (dense: F32, or a type or shape without a kernel)."""
    from inferd.quant import half
    from inferd.quant.gguf_blocks import FORMATS

    name = t.tensor_type.name
    if half.servable(t):
        return "half"
    return "int4" if name in INT4_TYPES else "int8" if name == "Q8_0" else "blocks" if name in FORMATS else None


def layers_with_kernels(reader) -> int:
    """How many of the file's projection tensors have a kernel for their type."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return sum(1 for t in reader.tensors if t.name.startswith("blk.") and t.name.split(".")[2] in names
               and _kind(t) is not None)


def _head(reader):
    """The output layer's tensor (the tied embedding where the file has no output.weight)."""
    ts = {t.name: t for t in reader.tensors if t.name in ("output.weight", "token_embd.weight")}
    return ts.get("output.weight", ts.get("token_embd.weight"))


def head_has_kernel(reader) -> bool:
    t = _head(reader)
    return t is not None and _kind(t) in ("int8", "blocks", "half")


def _layer(kind: str, codes: list, bias, dtype, dense: bool, type_name: str):
    """One linear of `kind` from its parts' codes, stacked along the output rows."""
    from inferd.quant.gguf_blocks import BlocksLinear, Codes
    from inferd.quant.half import HalfLinear
    from inferd.quant.linear import Int4Linear, Int8Linear

    if kind == "half":
        return HalfLinear(torch.cat(codes), bias, dtype)
    if kind == "blocks":
        return BlocksLinear(Codes(type_name, **{k: torch.cat([c.tensors()[k] for c in codes])
                                              for k in codes[0].tensors()}), bias, dtype)
    cat = [torch.cat(c) for c in zip(*codes)]
    return Int4Linear(*cat, GROUP, bias, dtype, dense) if kind == "int4" else Int8Linear(*cat, bias, dtype, dense)


class FusedParts(torch.nn.Module):
    """A fused layer whose GGUF parts are of different types (Q4_K_M's attn_v is often Q8_0 beside a
    Q5_0 attn_q): each part through its own kernel, outputs side by side."""

    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def take_rows(self, rows: torch.Tensor, take) -> "FusedParts":
        """Tensor parallelism's column cut: each part keeps its own rows among `rows`."""
        out, a = [], 0
        for p in self.parts:
            mine = rows[(rows >= a) & (rows < a + p.out_features)] - a
            if mine.numel():
                out.append(take(p, mine))
            a += p.out_features
        return FusedParts(out)

    def take_cols(self, a: int, b: int, take) -> "FusedParts":
        return FusedParts([take(p, a, b) for p in self.parts])


def apply_gguf_blocks(model, reader, cfg, dense: bool = False) -> dict[str, int]:
    """Replace every linear whose GGUF parts have kernels by layers that keep the file's blocks: Q4_0 /
    Q4_1 as Int4Linear, Q8_0 as Int8Linear (W4A8/W8A8 with --quantize-activations), the K-quants,
    Q5_0/Q5_1 and IQ4 as BlocksLinear (always int8 activations); a layer whose parts differ in type
    runs each part through its own. Returns how many layers of each kind. `dense` (fp32-activation
    evaluation) keeps the block types' exact dequantized weights."""
    tensors = {t.name: t for t in reader.tensors}
    from inferd.model import registry
    from inferd.quant.gguf_blocks import decode
    from inferd.quant.half import weights as half_weights

    permute = registry.by_name(cfg.architecture).gguf_interleaved_qk
    plan = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"],
            "gate_up_proj": ["ffn_gate", "ffn_up"], "down_proj": ["ffn_down"]}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    n = {"int4": 0, "int8": 0, "blocks": 0, "half": 0, "mixed": 0}
    for i, layer in enumerate(model.layers):
        for ours, parts in plan.items():
            ts = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None for t in ts):
                continue
            kinds = [_kind(t) for t in ts]
            if None in kinds or (dense and ("blocks" in kinds or "half" in kinds)):
                continue
            groups = []  # runs of parts of one type: (kind, type name, [codes])
            for p, t, kind in zip(parts, ts, kinds):
                raw = np.asarray(t.data)
                if kind == "half":
                    codes = half_weights(t)
                    if permute and p in heads:
                        codes = unpermute_qk(codes, heads[p])
                elif kind == "blocks":
                    codes = decode(t.tensor_type.name, raw)
                    if permute and p in heads:
                        codes = type(codes)(codes.type, **{k: unpermute_qk(v, heads[p]) for k, v in codes.tensors().items()})
                else:
                    codes = int4_blocks(t) if kind == "int4" else q8_blocks(t)
                    if permute and p in heads:  # same row order as the float weights
                        codes = tuple(unpermute_qk(x, heads[p]) for x in codes)
                if kind == "int4":  # Q4_0 and Q4_1 share the int4 form
                    key = "int4"
                else:  # (F16 and BF16 stay apart: one dtype a layer)
                    key = t.tensor_type.name
                if groups and groups[-1][1] == key:
                    groups[-1][2].append(codes)
                else:
                    groups.append((kind, key, [codes]))
            lin = getattr(layer, ours)
            mods = [_layer(kind, codes, None, model.dtype, dense, key) for kind, key, codes in groups]
            if len(mods) == 1:
                mods[0].bias = None if lin.bias is None else lin.bias.detach().to(model.dtype)
                setattr(layer, ours, mods[0])
                n[groups[0][0]] += 1
            else:
                if lin.bias is not None:
                    raise InferdError(f"layer {i} {ours}: a biased layer whose GGUF parts differ in type is not supported")
                setattr(layer, ours, FusedParts(mods))
                n["mixed"] += 1
    if not any(n.values()):
        raise InferdError("--quantization gguf needs weights of a type with a kernel in the GGUF file (Q4_0, Q4_1, "
                          "Q8_0, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, IQ4_NL or IQ4_XS)")
    return n


def apply(model, ctx) -> str:
    """The registry's entry for `gguf` (`--quantize-lm-head`: the Q8_0 output layer to int8 with its own block scales)."""
    from inferd.quant.gguf_blocks import BlocksLinear, decode
    from inferd.quant.half import HalfLinear, tie_embedding
    from inferd.quant.half import weights as half_weights
    from inferd.quant.linear import Int8Linear
    from inferd.quant.rtn import quantize_lm_head_int8

    if ctx.reader is None:
        raise InferdError("--quantization gguf needs a .gguf model file")
    n = apply_gguf_blocks(model, ctx.reader, ctx.config, ctx.dense)
    if ctx.lm_head:
        t, lin = _head(ctx.reader), model.lm_head
        own = t is not None and tuple(lin.weight.shape) == tuple(reversed([int(x) for x in t.shape]))
        if own and _kind(t) == "int8":
            # the file's own Q8_0 codes and block scales (what re-rounding the dequantized head gives
            # back, without the search over 262k rows)
            model.lm_head = Int8Linear(*q8_blocks(t), lin.bias, model.dtype, ctx.dense)
        elif own and _kind(t) == "blocks" and not ctx.dense:
            model.lm_head = BlocksLinear(decode(t.tensor_type.name, np.asarray(t.data)), lin.bias, model.dtype)
        elif own and _kind(t) == "half" and not ctx.dense:
            model.lm_head = HalfLinear(half_weights(t), lin.bias, model.dtype)
        else:
            quantize_lm_head_int8(model, ctx.dense)
    emb = next((t for t in ctx.reader.tensors if t.name == "token_embd.weight"), None)
    if emb is not None and _kind(emb) == "half" and not ctx.dense:
        tied = isinstance(model.lm_head, HalfLinear) and _head(ctx.reader) is emb  # the head's own matrix
        tie_embedding(model, model.lm_head.weight if tied else half_weights(emb))
    kinds = " + ".join(f"{k} {v}" for k, v in n.items() if v)
    return f"gguf-native: {kinds} linears from the file's own blocks{', lm_head int8' if ctx.lm_head else ''}"

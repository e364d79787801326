"""`--quantization gguf`: serve a GGUF file's own blocks. Q4_0 / Q4_1 go through the int4 kernel and
Q8_0 through the int8 one (their codes and fp16 block scales are Int8Linear's form); the K-quants,
Q5_0/Q5_1 and IQ4 through quant.gguf_blocks' kernel, in their own bits; F16/BF16 through quant.half.

This module is the method: which layers are served, by which kernel (`kind_of`), and what stays for
the dense fallback. Each layer is built from its parts in the loader's plan (inferd.loading.plan);
the blocks themselves, held as views of the file's mapping until the model is final and then
repacked once into their kernel's records, are quant.gguf_layer's. A layer whose parts differ in
type (Q4_K_M's Q6_K attn_v beside Q4_K q and k) runs each run of one type through its own kernel
(`FusedParts`). A part of a type without a kernel leaves its layer to the dense fallback, which the
loader logs and counts.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.quant.gguf_layer import GROUP, FusedParts, GGUFLinear, int4_blocks, q8_blocks

log = logging.getLogger("inferd")
INT4_TYPES = ("Q4_0", "Q4_1")
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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


def lower_bit_head(lin, type_name: str):
    """--lm-head-quantization: the output layer's parts rounded again to `type_name` (Q4_K or Q5_K)
    from the file's blocks, a chunk of rows at a time (inferd.quant.kquants); the file's table stays
    for the embedding lookups. A head already at or under the target's bits, or of a type without a
    writer here, stays as it is: one log line says which."""
    import dataclasses
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType

    from inferd.model.planned import PlannedLinear
    from inferd.quant import kquants

    want = kquants.SOURCE_BITS[type_name]
    out = []
    for p in lin.parts:
        bits = kquants.SOURCE_BITS.get(p.type)
        if bits is None or bits <= want or getattr(p, "offset", 0.0) or not hasattr(p, "tensor"):
            log.info("--lm-head-quantization %s: the output layer stays %s (%s)", type_name.lower(), p.type,
                     "already at or under its bits" if bits is not None and bits <= want else "no writer from it")
            return lin
        raw = np.asarray(p.raw())
        N, K = raw.shape[0], p.shape[1]
        if K % kquants.QK:
            log.info("--lm-head-quantization %s: the output layer stays %s (rows of %d weights)", type_name.lower(),
                     p.type, K)
            return lin
        blocks = kquants.requantize_rows(raw, p.type, type_name)
        tensor = SimpleNamespace(name=p.name + f".{type_name.lower()}", tensor_type=GGMLQuantizationType[type_name],
                                 shape=(K, N), data=blocks, n_bytes=blocks.nbytes)
        out.append(dataclasses.replace(p, tensor=tensor, expert=None, cols=None))
        log.info("--lm-head-quantization %s: the output layer %s -> %s, %.0f -> %.0f MB (the file's table kept for "
                 "the embedding)", type_name.lower(), p.type, type_name, p.nbytes / 1e6, blocks.nbytes / 1e6)
    return PlannedLinear(out, lin.bias_parts, lin.in_features, lin.out_features)


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
        if role(path) == "lm_head" and ctx.lm_head_type:
            lin = lower_bit_head(lin, ctx.lm_head_type)
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

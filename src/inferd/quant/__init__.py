"""Weight-only quantization: each method is one function that rewrites a model's linear layers.

    quantize(model, "int8")                  symmetric, one scale per 32-block (Q8_0's form)
    quantize(model, "int4", group_size=64)   asymmetric, group-wise, round to nearest

GPTQ rounding (`int8-gptq`: one scale per output row; `int4-gptq`: the int4 layout; codes chosen with a calibration pass at
load) lives in `gptq.py`. AWQ (calibrated, saved as a Hugging Face AWQ folder, loaded onto the same int4 kernel) lives in
`awq.py` and `awq_checkpoint.py`.

Both run through PyTorch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
with activations in the model's dtype; the rest of the engine does not know.

`dense=True` keeps the exact dequantized weights instead of packing them, for quality evaluation
with fp32 activations: the packed kernels take a slow path for fp32 inputs (benchmarks/quant_decode.py
measures it), and the maths is the same (tests/test_quant.py checks kernel against dequantized).

The codes are inferd's own (`quant.linear`: w = q * scale + min per group, nibble-packed in one
layout of ours); PyTorch's packed kernels get them at a layer's first forward.

Methods by table: `METHODS` maps each `--quantization` name to the module that applies it and what
it needs. Adding one is a module with `apply(model, ctx) -> str` (a log line) and one line below.
`apply(model, ctx)` is the whole route the loader takes: the method, then `--quantize-activations`
(W4A8/W8A8 and the fused decode step) or the hand-over of the codes to PyTorch's kernels.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from inferd.errors import InferdError


@dataclass(frozen=True)
class Method:
    module: str  # the module whose apply(model, QuantContext) -> str (a log line) quantizes
    needs: tuple[str, ...] = ()  # "gguf": the file's own blocks; "checkpoint": a quantized folder; "calibration": text
    # each weight's codes depend on that weight alone (block-wise round-to-nearest): a tensor-parallel
    # rank may cut the model first and quantize only its share (same codes, 1/N of the work)
    local: bool = False

    def apply(self, model, ctx) -> str:
        return importlib.import_module(self.module).apply(model, ctx)


# by name, not by import: the CLI reads the names without loading torch
METHODS: dict[str, Method | None] = {
    "none": None,
    "auto": None,  # resolved by the loader from the model (inferd.loading.loader.auto_quantization)
    "int8": Method("inferd.quant.rtn", local=True),
    "int4": Method("inferd.quant.rtn", local=True),
    "int8-gptq": Method("inferd.quant.gptq", ("calibration",)),
    "int4-gptq": Method("inferd.quant.gptq", ("calibration",)),
    # each layer from its own parts of the file: a rank builds only its share
    "gguf": Method("inferd.quant.gguf_native", ("gguf",), local=True),
    "awq": Method("inferd.quant.awq_checkpoint", ("checkpoint",)),
}

_LINEAR = {"Int4Linear", "Int8Linear", "dequantize_int4", "hand_over", "pack_nibbles", "quantize_int4",
           "quantize_int8", "unpack_nibbles", "weight_bytes"}


def __getattr__(name):  # the public names of quant.linear and quant.rtn, loaded (with torch) when used
    if name in _LINEAR:
        from inferd.quant import linear

        return getattr(linear, name)
    if name in ("quantize", "quantize_lm_head_int8"):
        from inferd.quant import rtn

        return getattr(rtn, name)
    raise AttributeError(f"module 'inferd.quant' has no attribute {name!r}")


@dataclass
class QuantContext:
    """What a method may use besides the model: the options, and the model's sources."""
    method: str
    group_size: int = 32
    lm_head: bool = False
    dense: bool = False  # keep exact dequantized weights (fp32-activation evaluation), no packing
    activations: bool = False  # --quantize-activations: W4A8/W8A8
    config: object = None  # the model's ModelConfig
    plan: object = None  # the loader's tensor plan (inferd.loading.plan): where each layer's parts lie
    checkpoint: dict = field(default_factory=dict)  # {"parts": ..., "group_size": ...}, for "checkpoint"
    calibration: Callable | None = None  # (n_samples, seqlen) -> token id lists
    fp32_model: Callable | None = None  # () -> an fp32 copy of the model, for calibration
    cache_key: tuple = ()  # identifies the weights: calibrated codes are kept per process
    on_dense: Callable | None = None  # (name, placeholder) of each layer left dense: the loader logs and counts
    release: Callable | None = None  # (parts) once a layer is built from them: the loader drops their pages
    lm_head_type: str | None = None  # --lm-head-quantization: the output layer rounded to this GGUF type (Q4_K/Q5_K)


def method(name: str) -> Method | None:
    if name in (None, "none"):
        return None
    if name not in METHODS:
        raise InferdError(f"unknown quantization {name!r} (choose {', '.join(METHODS)})")
    return METHODS[name]


def apply(model, ctx: QuantContext, shard=None) -> list[str]:
    """Build the model's layers as `ctx` says, in place; returns what was done, one line each (for
    the log), the last one the weights' resident size. The model arrives as the loader's skeleton:
    every linear a placeholder holding its parts of the file (inferd.model.planned). The method builds
    the layers it serves; whatever it leaves is materialized dense, one layer at a time; then the
    layers are made final (the GGUF blocks repacked for their kernels). `shard(model)` cuts the model
    to a tensor-parallel rank's share: before the method where each layer's codes depend on its
    weights alone (a rank then reads and quantizes only its share), else between the method and the
    final packing."""
    from inferd.quant.linear import weight_bytes

    m = method(ctx.method)
    built = str(model.dtype)[6:], dense_bytes(model)  # what the dense model would hold
    lines = _apply(model, ctx, m, shard)
    lines.append(resident_line(weight_bytes(model), built, m is not None and ctx.method, ctx.activations,
                               shard is not None))
    return lines


def resident_line(now: int, built: tuple[str, int], method: str | None, activations: bool, shard: bool) -> str:
    """The weights' resident size, said once at the end of the load (a method's own line says what it
    did, not sizes midway through the packing); for a quantized model, beside the size of the dense
    model it replaced, the one that quantization none builds in that dtype."""
    dtype, dense = built
    kind = f"{method}{' with int8 activations' if activations else ''}" if method else f"dense {dtype}"
    line = f"weights: {now / 2**20:.1f} MiB resident ({kind})"
    if shard:
        return line + ", this rank's share"
    return line + (f"; the dense {dtype} model would hold {dense / 2**20:.1f} MiB" if method else "")


def dense_bytes(model) -> int:
    """Bytes of the model dense in its dtype: its tensors, its placeholders' weights, a table read in
    place from the file as if it were a float one."""
    from inferd.model.planned import PlannedLinear
    from inferd.quant.linear import weight_bytes

    total = weight_bytes(model)
    size = torch_dtype_size(model.dtype)
    for m in model.modules():
        if isinstance(m, PlannedLinear):
            total += m.dense_bytes(model.dtype)
        elif getattr(m, "in_place", False) and not model.cfg.tie_word_embeddings:  # tied: the head's matrix
            total += m.num_embeddings * m.embedding_dim * size
    return total


def torch_dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _apply(model, ctx: QuantContext, m: Method | None, shard) -> list[str]:
    from inferd.model.planned import materialize
    from inferd.quant import w4a8
    from inferd.quant.linear import hand_over

    if ctx.activations and (m is None or ctx.dense):
        raise InferdError("--quantize-activations applies to quantized weights: add --quantization "
                          "int4, int4-gptq, gguf, awq (W4A8) or int8, int8-gptq (W8A8)" if m is None else
                          "--quantize-activations is a CPU kernel for packed weights")
    if m is not None and m.module not in ("inferd.quant.rtn", "inferd.quant.gguf_native") and \
            not all(layer.dense_mlp for layer in model.layers):
        raise InferdError(f"--quantization {ctx.method}: a mixture of experts quantizes with int8 or int4 "
                          "(round to nearest) or serves a GGUF's own blocks, not calibrated codes yet")
    if m is not None and "calibration" in m.needs:
        materialize(model)  # calibration runs the dense model
    first = shard is not None and (m is None or m.local)
    if first:
        shard(model)
    lines = [] if m is None else [m.apply(model, ctx)]
    dense = materialize(model, on_layer=ctx.on_dense, release=ctx.release)
    if dense and m is not None:
        lines.append(f"{dense} linears dense ({str(model.dtype)[6:]})")
    if shard is not None and not first:
        shard(model)
    from inferd.quant.gguf_blocks import pack_all
    from inferd.quant.gguf_layer import finalize

    finalize(model, ctx.release)
    pack_all(model)  # GGUF block layers given as codes: final now, into the kernel's records
    if not ctx.activations:
        hand_over(model)  # int4 codes to PyTorch's kernel now: final weights from the start
        return lines
    from inferd.quant.half import HalfLinear

    halves = sum(isinstance(x, HalfLinear) for x in model.modules())
    n = w4a8.quantize_activations(model, w4a8.int8_activation_layers(model), halves)
    lines.append(f"W4A8/W8A8: {n} linears take int8 activations (per 32-block)"
                 f"{f', {halves} F16/BF16 ones float32' if halves else ''}; {str(model.dtype)[6:]} glue")
    return lines

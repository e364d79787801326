"""Round-to-nearest int8 (symmetric, one scale per 32-block: Q8_0's form) and int4 (asymmetric, per group): the weights
alone decide the codes, so the rewrite needs nothing but the model."""
from __future__ import annotations

from torch import nn

from inferd.errors import InferdError
from inferd.quant.linear import Int4Linear, Int8Linear, quantize_int4, quantize_int8


def _targets(model: nn.Module, include_lm_head: bool):
    for layer in model.layers:
        # a mixture of experts' experts, each like a dense MLP (the router stays float, as in vLLM)
        parts = [(layer, n) for n in ("qkv_proj", "o_proj")] + (
            [(layer, n) for n in ("gate_up_proj", "down_proj")] if layer.dense_mlp else
            [(e, n) for e in layer.experts if hasattr(e, "gate_up_proj")  # this rank's, under TP
             for n in ("gate_up_proj", "down_proj")])
        for parent, name in parts:
            lin = getattr(parent, name)
            if not hasattr(lin, "weight") and hasattr(lin, "inner"):  # a tensor-parallel wrapper: its linear
                yield lin, "inner"
            else:
                yield parent, name
    if include_lm_head:
        yield model, "lm_head"


def quantize(model: nn.Module, method: str, group_size: int = 32, include_lm_head: bool = False,
             dense: bool = False) -> nn.Module:
    """Rewrite the model's linear layers in place (gpt-fast style) and return it."""
    if method in (None, "none"):
        return model
    if method == "gguf":
        raise InferdError("gguf quantization is applied at load time from the file's own blocks")
    if method.endswith("-gptq"):
        raise InferdError(f"{method} needs calibration text: load the model with quantization={method!r}, "
                          "or call inferd.quant.gptq.gptq_quantize")
    if method == "awq":
        raise InferdError("awq needs calibration: `inferd quantize --method awq`, then load the folder it writes")
    if method not in ("int8", "int4"):
        raise InferdError(f"unknown quantization {method!r} (choose int8, int4; or load with gguf, awq, *-gptq)")
    if model.device.type != "cpu":
        raise InferdError(f"{method} kernels are CPU-only in this build")
    dtype = model.dtype
    for parent, name in _targets(model, include_lm_head):
        lin = getattr(parent, name)
        w = lin.weight.detach()
        if method == "int8":
            q, s = quantize_int8(w)
            new = Int8Linear(q, s, lin.bias, dtype, dense)
        else:
            q, s, z = quantize_int4(w, group_size)
            new = Int4Linear(q, s, z, group_size, lin.bias, dtype, dense)
        setattr(parent, name, new)
    return model


def quantize_lm_head_int8(model: nn.Module, dense: bool = False) -> nn.Module:
    """The output layer to int8 per 32-block (for `gguf`, whose tied Q8_0 embedding has no int4 form:
    of the dequantized Q8_0 weights this gives back the file's own codes and block scales exactly).
    The embedding keeps its float copy: a lookup reads one row per token, so packing it would save
    memory but no time."""
    lin = model.lm_head
    q, s = quantize_int8(lin.weight.detach())
    model.lm_head = Int8Linear(q, s, lin.bias, model.dtype, dense)
    return model




def apply(model, ctx) -> str:
    """The registry's entry: `int8` / `int4` at load."""
    quantize(model, ctx.method, ctx.group_size, ctx.lm_head, ctx.dense)
    return f"quantized {ctx.method} (group {ctx.group_size}{', lm_head too' if ctx.lm_head else ''})"

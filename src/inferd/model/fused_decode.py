"""The decode step of a W4A8/W8A8 model as one C++ call (csrc/cpu/fused_decode.cpp): the layer
loop without Python between kernels.

Why: with int4 weights and int8 activations a batch-1 token reads ~110 MB of weights, ~6 ms on the
2-core AVX2 machine, and the eager forward spent another ~2.5 ms on the ~13 Python-level calls per
layer around those matmuls. The C++ loop calls the same ops as the eager forward
(torch.ops.inferd.*) in the same order, so its hidden states equal the eager model's bit for bit.

`build(model)` says whether a model qualifies (CPU, float32, every layer linear W4A8, W8A8 or a GGUF
block layer (or parts of those side by side), the native kernels built) and returns the step; `FusedDecode.unusable_with(attn)` says why it could
never run with an attention (no paged decode kernel, a KV cache neither float32 nor bfloat16). The
engine's ModelRunner owns the decision to use it (never with `--enforce-eager`, never under tensor
parallelism) and calls it each step, where it runs only if every sequence decodes through the paged
kernel (speculative verify chunks qualify: their k+1 rows reach the kernel as single-query rows);
a step holding prompt rows returns None and runs eagerly. Quantization only rewrites layers; the
model itself is never changed.
"""
from __future__ import annotations

import torch

# what DecodeStack reads and writes (csrc/cpu/fused_decode.cpp); attention computes in fp32 either way
# (int8: rows quantized as written and read by the split decode kernel, as the eager forward does)
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


class FusedDecode:
    def __init__(self, model, stack):
        self.model = model
        self.stack = stack
        self.n_layers = model.cfg.num_hidden_layers
        self.steps = 0  # steps served (tests check the fused path ran)
        self.lora_products = 0  # LoRA products a step with adapter rows makes (one per adapted projection)
        self.max_rows = 0  # most rows in one fused step (speculative verify rows count one each)

    @staticmethod
    def unusable_with(attn) -> str | None:
        """Why no step through this attention could ever run fused, or None where decode-only steps
        will: what the runner decides with before it announces the path."""
        if getattr(attn, "decode_args", None) is None:
            return f"{type(attn).__name__} has no paged decode path"
        # the dtype first: it is also why an fp16 cache's attention has no kernel, and the truer reason
        dtype = attn.pool.k.dtype
        if dtype not in KV_DTYPES:
            name = str(dtype).replace("torch.", "")
            return f"the fused step needs a float32, bfloat16 or int8 KV cache; this one is {name}"
        if getattr(attn, "kernel", None) is None:
            return "the attention runs without the native paged-decode kernel"
        return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        """Final hidden states [T, hidden] as LlamaModel.forward returns them, or None where this
        step must run eagerly: not every row a single-query decode through the paged kernel (a step
        with prompt rows, or any step through an attention `unusable_with` refuses)."""
        decode_args = getattr(attn, "decode_args", None)
        args = decode_args() if decode_args is not None else None
        if args is None or args[0].dtype not in KV_DTYPES:
            return None
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rope.cos_sin(positions)
        lora = getattr(self.model, "lora", None)
        rows = lora.rows if lora is not None and lora.rows is not None else torch.empty(0, dtype=torch.int64)
        h = self.stack.forward(x, cos, sin, *args, rows)
        if rows.numel():
            lora.applies += self.lora_products
        attn.kernel_calls += self.n_layers
        if getattr(attn, "split_decode", False):  # an int8 cache: its layers decoded by the split kernel
            attn.split_decode_calls += self.n_layers
        self.steps += 1
        self.max_rows = max(self.max_rows, x.shape[0])
        return h


KIND_HALF, KIND_W4A8, KIND_W8A8 = -3, -2, -1  # csrc/cpu/fused_decode.cpp; a GGUF block type is its id (>= 0)


def _parts(lin) -> list[tuple[torch.Tensor, int, int]] | None:
    """(packed records, kind, outputs) for each part of a linear the C++ step can run, or None:
    W4A8Linear / W8A8Linear (inferd.quant.w4a8), BlocksLinear (inferd.quant.gguf_blocks), HalfLinear
    (inferd.quant.half), and a
    FusedParts of those (its parts' outputs side by side). A WithLoRA (inferd.model.lora) is its base
    layer here: the runner sends steps with adapter rows down the eager path."""
    lin = getattr(lin, "lora_base", lin)
    if hasattr(lin, "parts") and getattr(lin, "bias", None) is None:
        out = [_parts(p) for p in lin.parts]
        return None if any(p is None or len(p) != 1 for p in out) else [p[0] for p in out]
    if getattr(lin, "float16_weights", False):  # a HalfLinear: F16/BF16 weights in their 16 bits
        return [(lin.weight, KIND_HALF, lin.out_features)]
    kind = getattr(lin, "block_type", None)  # a BlocksLinear (read by name: the model layer imports no quant)
    if kind is not None:
        return None if lin.packed is None else [(lin.packed, kind, lin.out_features)]
    w8 = getattr(lin, "w8", None)
    if w8 is None:
        return None
    return [(lin.packed, KIND_W8A8 if w8 else KIND_W4A8, lin.out_features)]


def build(model) -> FusedDecode | None:
    """The fused decode step for this model, or None where it does not qualify."""
    from inferd.kernels import native
    from inferd.model.llama import LlamaModel

    if not isinstance(model, LlamaModel) or not model.fused_decode:
        return None
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return None
    if not len(model.layers):
        return None
    none = torch.empty(0)
    norms, weights, kinds, outs, parts, biases = [], [], [], [], [], []
    for layer in model.layers:
        norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            got = _parts(lin)
            if got is None:  # no C++ path for this layer
                return None
            for packed, kind, n in got:
                weights.append(packed)
                kinds.append(kind)
                outs.append(n)
            parts.append(len(got))
            biases.append(none if getattr(lin, "bias", None) is None else lin.bias)
    norms.append(model.norm.weight.detach())
    mod = native.load()
    if mod is None:
        return None
    cfg = model.cfg
    stack = mod.DecodeStack(norms, weights, kinds, outs, parts, biases, cfg.num_hidden_layers, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, float(cfg.rms_norm_eps))
    lora = getattr(model, "lora", None)
    if lora is not None:  # LoRA slots (model/lora.py): the step adds each row's delta after the same layers
        ops = [lin.fused_operands() for layer in model.layers
               for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        stack.set_lora([o[0] for o in ops], [o[1] for o in ops], [o[2] for o in ops], [o[3] for o in ops])
    fused = FusedDecode(model, stack)
    if lora is not None:
        fused.lora_products = sum(len(o[3]) for o in ops)
    return fused

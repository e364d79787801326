"""A Hugging Face model in memory -> a GGUF file with llama.cpp's tensor and metadata names.

Test-side only: it lets one set of random weights be held to `transformers` in both forms a user
brings (HF folder, GGUF). Tensors are written as F32 (or a given quant type), so the GGUF model
equals the HF one to float rounding. The naming follows llama.cpp's converter: which families
interleave the q/k rows for llama.cpp's RoPE kernel, and where Llama 3's RoPE scaling goes (a
`rope_freqs` tensor of per-frequency divisors, not metadata).
"""
from __future__ import annotations

import math

import numpy as np

# families whose q/k rows llama.cpp's converter interleaves (its "normal" RoPE); the others are
# NeoX-style, stored as Hugging Face has them
PERMUTED = {"llama"}

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}


# Gemma's four norms a layer: llama.cpp calls the pre-MLP one ffn_norm, as Llama's single one
_GEMMA_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# llama.cpp's converter writes Gemma's norm weights as 1 + w (its RMSNorm multiplies by the weight)
NORM_PLUS_ONE = {"gemma2", "gemma3"}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's interleaving of each head's two RoPE halves into pairs."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs` for `rope_type: llama3`."""
    factor = float(rope["factor"])
    lo, hi = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope["original_max_position_embeddings"])
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    idx, rest = parts[2], ".".join(parts[3:])
    stem, kind = rest.rsplit(".", 1)
    table = {**_BLOCK, **_GEMMA_BLOCK} if arch.startswith("gemma") else _BLOCK
    if stem not in table:
        return None
    return f"blk.{idx}.{table[stem]}.{kind}"


def write_gguf(model, path, arch: str, *, qtype=None, rope_freqs: bool = True,
               sliding_window: bool | None = None) -> str:
    """Write `model` (a transformers *ForCausalLM) as `path`. `arch`: the GGUF architecture name.
    `rope_freqs=False` leaves Llama 3's scaling out (what a converter that forgot it would write).
    `sliding_window`: write `<arch>.attention.sliding_window` from the config (default: where
    llama.cpp's converter does, Gemma 2/3 and Phi-3; it drops a Mistral's)."""
    from gguf import GGUFWriter

    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rp = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rp = rp.get("full_attention", rp)  # per layer type (Gemma 3): the global layers' RoPE
    theta = float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if sliding_window is None:  # as llama.cpp's converter: a Mistral (arch llama) loses its window
        sliding_window = arch in ("gemma2", "gemma3", "phi3")
    if getattr(c, "sliding_window", None) and sliding_window:
        w.add_sliding_window(c.sliding_window)
    if getattr(c, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    tensors: dict[str, np.ndarray] = {}
    sd = model.state_dict()
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for name, t in sd.items():
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2ff, h]: llama.cpp keeps gate and up apart
            blk = f"blk.{name.split('.')[2]}."
            gate, up = t.detach().float().numpy().reshape(t.shape[0], 2, -1, t.shape[2]).swapaxes(0, 1)
            tensors[blk + "ffn_gate_exps.weight"], tensors[blk + "ffn_up_exps.weight"] = gate, up
            continue
        if name.endswith("mlp.experts.down_proj"):
            tensors[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = t.detach().float().numpy()
            continue
        g = gguf_name(name, arch)
        if g is None:
            raise ValueError(f"no GGUF name for {name}")
        a = t.detach().float().numpy()
        if arch in NORM_PLUS_ONE and g.endswith("norm.weight"):
            a = a + 1
        if arch in PERMUTED and g.endswith(("attn_q.weight", "attn_q.bias")):
            a = permute_qk(a, heads)
        elif arch in PERMUTED and g.endswith(("attn_k.weight", "attn_k.bias")):
            a = permute_qk(a, kv)
        tensors[g] = a
    if rope_freqs and rp.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(rp, theta, head_dim)
    if rp.get("rope_type") == "longrope":  # Phi-3: both factor sets as tensors, as llama.cpp's converter
        tensors["rope_factors_long.weight"] = np.array(rp["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rp["short_factor"], dtype=np.float32)
        orig = rp.get("original_max_position_embeddings") or c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        s = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(rp.get("attention_factor") or math.sqrt(1 + math.log(s) / math.log(orig)))
    if rp.get("rope_type") == "yarn":  # as llama.cpp's converter writes a YaRN config (Qwen2.5's)
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp.get("original_max_position_embeddings") or c.max_position_embeddings))
    # norms and rope_freqs stay F32, as llama.cpp's quantizer leaves one-dimensional tensors
    finish(w, {g: (a, None if a.ndim == 1 else qtype) for g, a in tensors.items()})
    return str(path)


def finish(w, tensors: dict):
    """Add {name: (float array, GGML type or None for F32)} to writer `w`, then write and close it."""
    from gguf import GGMLQuantizationType as Q, quants

    for name, (a, qt) in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if qt in (None, Q.F32):
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_into(model, path, arch: str) -> None:
    """The reverse of write_gguf, by the `gguf` package alone: every tensor of the GGUF file at `path`
    dequantized by gguf's own block maths and loaded into the transformers model `model` under its
    own names (q/k rows un-interleaved, Gemma's 1 + w undone, experts stacked back). The oracle's
    weights for a file `llama-quantize` rounded: it never goes through inferd's loader."""
    import torch
    from gguf import GGUFReader, quants

    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    ts = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(reversed([int(x) for x in t.shape]))
        ts[t.name] = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    sd = {}
    for name, ref in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            blk = f"blk.{name.split('.')[2]}."
            gate, up = ts[blk + "ffn_gate_exps.weight"], ts[blk + "ffn_up_exps.weight"]
            a = np.concatenate([gate, up], axis=1)
        elif name.endswith("mlp.experts.down_proj"):
            a = ts[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"]
        elif name == "lm_head.weight" and "output.weight" not in ts:
            a = ts["token_embd.weight"]
        else:
            g = gguf_name(name, arch)
            if g is None or g not in ts:
                raise ValueError(f"no GGUF tensor for {name}")
            a = ts[g]
            if arch in NORM_PLUS_ONE and g.endswith("norm.weight"):
                a = a - 1
            if arch in PERMUTED and g.endswith(("attn_q.weight", "attn_q.bias")):
                a = unpermute(a, heads)
            elif arch in PERMUTED and g.endswith(("attn_k.weight", "attn_k.bias")):
                a = unpermute(a, kv)
        sd[name] = torch.from_numpy(np.ascontiguousarray(a)).to(ref.dtype).reshape(ref.shape)
    model.load_state_dict(sd)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of permute_qk."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)

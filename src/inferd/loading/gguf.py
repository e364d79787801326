"""GGUF files: metadata -> ModelConfig, tensors -> torch (dequantized), via the `gguf` package.

llama.cpp's converter permutes the rows of attn_q / attn_k so that its RoPE kernel can rotate
adjacent pairs; our model (like Hugging Face) rotates the two halves of each head, so those rows
are permuted back on load.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.gguf_file import unpermute_qk


def config_from_metadata(meta: dict[str, Any], rope_tensors: dict[str, np.ndarray] | None = None):
    """`rope_tensors`: the file's RoPE scaling tensors (`rope_tensors(reader)`). llama.cpp's converter
    stores Llama 3.x's RoPE scaling there (`rope_freqs`, one divisor per rotary frequency) and
    Phi-3's LongRoPE factors, not in the metadata."""
    from inferd.model import registry
    from inferd.model.config import ModelConfig

    arch = meta.get("general.architecture")
    fam = registry.for_gguf(arch)
    if fam.name == "llama" and meta.get("llama.expert_count"):
        fam = registry.by_name("mixtral")  # what llama.cpp's converter writes for Mixtral
    elif fam.name == "llama" and meta.get("llama.attention.sliding_window"):
        # llama.cpp's converter writes Mistral as `llama` and drops its window (llama.cpp's llama graph
        # has none: such a file attends to everything, there as here); a file that keeps the window
        # carries it under the key every architecture uses for one, and is Mistral
        fam = registry.by_name("mistral")

    def g(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    rope_scaling = None
    kind = g("rope.scaling.type")
    context = int(g("context_length", 2048))
    rope = rope_tensors or {}
    if kind not in (None, "none", "linear", "yarn", "longrope"):
        raise InferdError(f"RoPE scaling {kind!r} (this GGUF's {arch}.rope.scaling.type) is not supported "
                          "(supported: none, linear, yarn, longrope)")
    if kind == "longrope" and "rope_factors_long.weight" not in rope:
        raise InferdError("this GGUF asks for LongRoPE scaling but has no rope_factors_long tensor")
    if kind == "linear" and g("rope.scaling.factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if kind == "yarn":
        rope_scaling, context = _yarn_from_metadata(g, context)
    if "rope_freqs.weight" in rope:
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in rope["rope_freqs.weight"]]}
    if "rope_factors_long.weight" in rope:  # Phi-3's LongRoPE, as llama.cpp's converter writes it
        rope_scaling = {"rope_type": "longrope", "long_factor": [float(f) for f in rope["rope_factors_long.weight"]],
                        "short_factor": [float(f) for f in rope["rope_factors_short.weight"]],
                        "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                        "attention_factor": g("rope.scaling.attn_factor")}
    n_layers = int(g("block_count"))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    window = g("attention.sliding_window")
    extra = {}
    if g("expert_count"):
        extra = dict(num_experts=int(g("expert_count")), num_experts_per_tok=int(g("expert_used_count")),
                     moe_intermediate_size=int(g("expert_feed_forward_length", g("feed_forward_length"))),
                     # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, never for OLMoE
                     norm_topk_prob=fam.name != "olmoe")
    if fam.name in ("gemma2", "gemma3"):
        # what llama.cpp assumes for every Gemma 2/3 file: local layers every other layer (Gemma 2,
        # the first local) or 5 in every 6 (Gemma 3, with a local RoPE base of 10,000); the query scale
        # 1/sqrt(head_dim), but for the 27B models (46 and 62 layers) 1/sqrt(hidden / heads), their
        # query_pre_attn_scalar
        pattern = int(g("attention.sliding_window_pattern", 6 if fam.name == "gemma3" else 2))
        extra = dict(
            layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)],
            rope_local_theta=10000.0 if fam.name == "gemma3" else None,
            query_scale=(hidden / n_heads if n_layers in (46, 62) else head_dim) ** -0.5,
            final_logit_softcapping=g("final_logit_softcapping"),
            attn_logit_softcapping=g("attn_logit_softcapping"),
        )
    return ModelConfig(
        architecture=fam.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=context,
        tie_word_embeddings=True,  # corrected by the loader when output.weight exists
        attention_bias=fam.attention_bias,
        sliding_window=int(window) if window and fam.sliding_window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        **extra,
    )


def _yarn_from_metadata(g, context: int) -> tuple[dict, int]:
    """YaRN as llama.cpp reads a GGUF: `rope.scaling.factor`, `rope.scaling.original_context_length`
    (default: context_length), the ramp's `rope.scaling.yarn_beta_fast` / `yarn_beta_slow` (32 / 1),
    and cos and sin multiplied by 1 + 0.1 ln(factor) (over 1 + 0.1 yarn_log_multiplier ln(factor)
    where the file gives that multiplier: DeepSeek's form) times `rope.scaling.attn_factor` (1)."""
    from inferd.model.config import yarn_scaling
    from inferd.model.layers import yarn_mscale

    factor = g("rope.scaling.factor")
    if not factor:
        raise InferdError("this GGUF asks for YaRN RoPE scaling without rope.scaling.factor")
    factor = float(factor)
    orig = int(g("rope.scaling.original_context_length") or context)
    log_mul = float(g("rope.scaling.yarn_log_multiplier") or 0.0)
    mscale = yarn_mscale(factor) / yarn_mscale(factor, log_mul) if log_mul else yarn_mscale(factor)
    rs = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
          "beta_fast": float(g("rope.scaling.yarn_beta_fast") or 32.0),
          "beta_slow": float(g("rope.scaling.yarn_beta_slow") or 1.0),
          "attention_factor": mscale * float(g("rope.scaling.attn_factor") or 1.0)}
    return yarn_scaling(rs, context, orig)


def dequantize_raw(raw: np.ndarray, type_name: str, rows: torch.Tensor | None = None,
                   shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The one dequantizer of GGUF data: the rows `rows` (every row when None) of a tensor's raw data
    (a view of the mapping: [rows, bytes a row], or the values of an F32/F16 tensor) -> float32
    [len(rows), K], freshly allocated; a 1-D tensor (a norm, a bias) comes back 1-D. The native kernel
    where it built (inferd.kernels.repack), else the `gguf` package's own block maths; the two agree
    bit for bit (tests/test_repack.py)."""
    from inferd.kernels import repack

    out = repack.dequantize_rows(raw, rows, type_name)
    if shape is not None:
        return out.reshape(shape)
    return out.reshape(-1) if np.ndim(raw) == 1 else out


def dequantize_tensor(t) -> np.ndarray:
    """A whole GGUF tensor -> float32 numpy array in PyTorch (out, in) order."""
    shape = tuple(int(s) for s in reversed(list(t.shape)))  # GGUF lists ne[0] (innermost) first
    return dequantize_raw(t.data, t.tensor_type.name).numpy().reshape(shape)


_NAME_MAP = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "q_proj.weight",
    "attn_k.weight": "k_proj.weight",
    "attn_v.weight": "v_proj.weight",
    "attn_q.bias": "q_proj.bias",
    "attn_k.bias": "k_proj.bias",
    "attn_v.bias": "v_proj.bias",
    "attn_output.weight": "o_proj.weight",
    "ffn_gate.weight": "gate_proj.weight",
    "ffn_up.weight": "up_proj.weight",
    "ffn_down.weight": "down_proj.weight",
    "attn_q_norm.weight": "q_norm.weight",
    "attn_k_norm.weight": "k_norm.weight",
    "ffn_gate_inp.weight": "gate.weight",  # a mixture of experts' router, then its stacked experts
    "ffn_gate_exps.weight": "experts.gate_proj",
    "ffn_up_exps.weight": "experts.up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
}


def gguf_name_to_ours(name: str, overrides: dict[str, str] | None = None) -> str | None:
    """Our parameter name for a GGUF tensor; `overrides`: a family's own block names (registry)."""
    if name in _NAME_MAP:
        return _NAME_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        ours = (overrides or {}).get(rest) or _BLOCK_MAP.get(rest)
        if ours is not None:
            return f"layers.{idx}.{ours}"
    return None


ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def rope_tensors(reader) -> dict[str, np.ndarray]:
    """The RoPE scaling tensors the file has (Llama 3.x's `rope_freqs` divisors, Phi-3's long and short
    LongRoPE factors), as float32 vectors by tensor name."""
    return {t.name: dequantize_tensor(t).reshape(-1) for t in reader.tensors if t.name in ROPE_TENSORS}

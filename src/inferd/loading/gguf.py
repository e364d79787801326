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


def config_from_metadata(meta: dict[str, Any], rope_freqs: np.ndarray | None = None):
    """`rope_freqs`: the file's `rope_freqs.weight` tensor where it has one. llama.cpp's converter
    stores Llama 3.x's RoPE scaling there (one divisor per rotary frequency), not in the metadata."""
    from inferd.model.config import ModelConfig

    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise InferdError(f"unsupported architecture in GGUF: {arch!r} (supported: llama, mistral, qwen2)")

    def g(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    rope_scaling = None
    if g("rope.scaling.type") in ("linear",) and g("rope.scaling.factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if rope_freqs is not None:
        rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in np.asarray(rope_freqs).reshape(-1)]}
    return ModelConfig(
        architecture={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings=True,  # corrected by the loader when output.weight exists
        attention_bias=(arch == "qwen2"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


_WHOLE_TENSOR = {"Q4_0", "Q4_1", "Q8_0"}


def dequantize_tensor(t) -> np.ndarray:
    """A ReaderTensor -> float32 array in PyTorch (out, in) order."""
    from gguf import GGMLQuantizationType, quants

    qtype = t.tensor_type
    data = np.asarray(t.data)
    if qtype == GGMLQuantizationType.F32:
        arr = data.astype(np.float32, copy=False)
    elif qtype == GGMLQuantizationType.F16:
        arr = data.view(np.float16).astype(np.float32)
    elif qtype.name in _WHOLE_TENSOR:
        # the gguf package's own block maths, on every block of the tensor in one call: its
        # quants.dequantize walks row groups in Python (1.8 s of the default model's 2.2 s load)
        from gguf import GGML_QUANT_SIZES

        cls = getattr(quants, qtype.name)
        arr = cls.dequantize_blocks(data.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    else:
        try:
            arr = quants.dequantize(data, qtype)
        except NotImplementedError:
            raise InferdError(f"GGUF tensor {t.name}: quantization type {qtype.name} is not supported") from None
        arr = np.asarray(arr, dtype=np.float32)
    shape = tuple(int(s) for s in reversed(list(t.shape)))  # GGUF lists ne[0] (innermost) first
    return arr.reshape(shape)


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
}


def gguf_name_to_ours(name: str) -> str | None:
    if name in _NAME_MAP:
        return _NAME_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _BLOCK_MAP:
            return f"layers.{idx}.{_BLOCK_MAP[rest]}"
    return None


def load_gguf_state_dict(reader, cfg) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 under our parameter names."""
    sd: dict[str, torch.Tensor] = {}
    permuted = cfg.architecture != "qwen2"  # llama.cpp keeps Qwen2 in NeoX (half-rotation) order
    for t in reader.tensors:
        ours = gguf_name_to_ours(t.name)
        if ours is None:
            continue  # e.g. rope_freqs: read into the config (rope_freqs_tensor)
        w = torch.from_numpy(dequantize_tensor(t).copy())
        if not permuted:
            pass
        elif ours.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif ours.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        sd[ours] = w
    return sd


def rope_freqs_tensor(reader) -> np.ndarray | None:
    """The `rope_freqs.weight` divisors as float32, or None when the file has none."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return dequantize_tensor(t).reshape(-1)
    return None

"""ModelConfig: the shape of a Llama-family model, from a HF config.json, GGUF metadata or a built-in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.errors import InferdError

# what model.layers.rope_inv_freq computes (freq_factors: a GGUF's rope_freqs tensor)
ROPE_TYPES = (None, "default", "linear", "llama3", "longrope", "yarn")


@dataclass
class ModelConfig:
    architecture: str = "llama"  # a family of inferd.model.registry
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    sliding_window: int | None = None  # Mistral; honoured only when shorter than the context
    # per layer "sliding_attention" | "full_attention" (Gemma); None: sliding_window, if any, is every layer's
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # the RoPE base of sliding layers where it differs (Gemma 3)
    query_scale: float | None = None  # attention's softmax scale; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(scores / cap) before the softmax
    # mixture of experts (model/moe.py): experts, experts a token is routed to, each expert's MLP width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: Any = None
    eos_token_id: Any = None
    # encoders (model/bert.py): LayerNorm's eps, the token-type table's rows, the MLP's activation
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)


def config_from_hf(d: dict) -> ModelConfig:
    from inferd.model import registry

    fam = registry.for_hf(d.get("architectures"), d.get("model_type"))
    if fam.encoder:
        return encoder_config_from_hf(fam.name, d)
    arch = fam.name
    n_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    rp = d.get("rope_parameters") or {}
    local = None
    if "full_attention" in rp:  # one RoPE per layer type (Gemma 3 in transformers 5)
        local, rp = rp.get("sliding_attention") or {}, rp["full_attention"]
    rope_theta = d.get("rope_theta", rp.get("rope_theta", 10000.0))
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("sliding_window_pattern"):  # older Gemma 3 configs
        n = int(d["sliding_window_pattern"])
        layer_types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(d["num_hidden_layers"])]
    if layer_types is None and arch == "gemma2":  # configs before transformers 4.53: even layers slide
        layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(d["num_hidden_layers"])]
    scalar = d.get("query_pre_attn_scalar")
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    if experts and (d.get("mlp_only_layers") or (d.get("decoder_sparse_step") or 1) != 1):
        raise InferdError("a mixture of experts with dense layers among the sparse ones is not supported")
    rope_scaling = d.get("rope_scaling") or _rope_params_scaling(rp)
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if kind in ("longrope", "su"):  # Phi-3: its original context may sit beside the scaling
        orig = rope_scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
        rope_scaling = {**rope_scaling, "rope_type": "longrope", "original_max_position_embeddings": int(orig)}
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise InferdError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES[2:])})")
    max_pos = d.get("max_position_embeddings", 2048)
    if kind == "yarn":
        rope_scaling, max_pos = yarn_scaling(rope_scaling, max_pos, d.get("original_max_position_embeddings"))
    if float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
        raise InferdError("a partial rotary embedding (partial_rotary_factor < 1) is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=d.get("head_dim") or hidden // n_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", fam.attention_bias)),
        sliding_window=d.get("sliding_window") if d.get("use_sliding_window", fam.sliding_window) else None,
        layer_types=list(layer_types) if layer_types is not None else None,
        rope_local_theta=(local or {}).get("rope_theta", d.get("rope_local_base_freq")),
        query_scale=float(scalar) ** -0.5 if scalar else None,
        final_logit_softcapping=d.get("final_logit_softcapping"),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        num_experts=experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        # Mixtral's experts are intermediate_size wide and always renormalised
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if experts else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)) if fam.name != "mixtral" else True,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


def yarn_scaling(rs: dict, max_pos: int, orig: int | None = None) -> tuple[dict, int]:
    """A YaRN rope_scaling dict in the form model.layers reads (its original context and factor made
    explicit, transformers' defaults: the original context is max_position_embeddings, the factor
    their ratio) and the context the model declares: original context x factor where that is more
    than max_position_embeddings (Qwen2.5's YaRN configs keep 32,768 there and mean 131,072, as vLLM
    reads them)."""
    orig = int(rs.get("original_max_position_embeddings") or orig or max_pos)
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig
    if factor < 1:
        raise InferdError(f"YaRN scaling factor {factor} is below 1")
    out = {**rs, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    return out, max(int(max_pos), int(orig * factor))


# what an encoder's config.json may name its MLP activation (transformers' ACT2FN names)
ENCODER_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def encoder_config_from_hf(arch: str, d: dict) -> ModelConfig:
    """A BERT-style config.json: post-LayerNorm layers, learned absolute positions, token types."""
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise InferdError(f"position_embedding_type {d['position_embedding_type']!r} is not supported (absolute only)")
    act = d.get("hidden_act", "gelu")
    if act not in ENCODER_ACTS:
        raise InferdError(f"hidden_act {act!r} is not supported (supported: {', '.join(ENCODER_ACTS)})")
    n_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        head_dim=hidden // n_heads,
        max_position_embeddings=d.get("max_position_embeddings", 512),
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(d.get("type_vocab_size", 2)),
        hidden_act=act,
        attention_bias=True,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


def attention_scale(cfg: ModelConfig) -> float:
    return cfg.query_scale if cfg.query_scale is not None else cfg.head_dim ** -0.5


def attention_windows(cfg: ModelConfig, max_len: int | None = None) -> int | None | list[int | None]:
    """The sliding window the attention applies: one for every layer (an int, or None for none), or
    one per layer (a list, None for a layer that sees the whole context). A window no shorter than
    `max_len` is no window."""
    w = cfg.sliding_window
    if w is not None and max_len is not None and w >= max_len:
        w = None
    if cfg.layer_types is None or w is None:
        return w
    per_layer = [w if t == "sliding_attention" else None for t in cfg.layer_types]
    return per_layer if len(set(per_layer)) > 1 else per_layer[0]


def _rope_params_scaling(rp: dict | None) -> dict | None:
    # transformers 5 folds rope_scaling into rope_parameters
    if not rp or rp.get("rope_type", "default") == "default":
        return None
    return rp



# Real shapes for `--load-format dummy` (numbers from the models' published config.json files).
BUILTIN_CONFIGS: dict[str, dict] = {
    "smollm2-135m": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "llama-3.2-1b": dict(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3-8b": dict(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5-0.5b": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=151643, eos_token_id=151645,
    ),
    "mistral-7b": dict(
        architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}
BUILTIN_ALIASES = {
    "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
    "llama-3.2-1b-instruct": "llama-3.2-1b", "llama-3-8b-instruct": "llama-3-8b",
    "qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
}


def builtin_config(name: str) -> ModelConfig | None:
    key = name.lower().split("/")[-1]
    key = BUILTIN_ALIASES.get(key, key)
    if key in BUILTIN_CONFIGS:
        return ModelConfig(**BUILTIN_CONFIGS[key])
    return None

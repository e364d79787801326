"""The KV pool: K and V of every layer in one preallocated tensor pair of fixed-size blocks, the
storage the block manager (inferd.engine.kv_cache) hands out by index. It lives with the worker: a
tensor-parallel rank holds its own share of it, and the shared-memory KV connector maps it."""
from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Which pool rows each layer's K/V live in, for models whose layers see different spans.

    A model with sliding-window and full-context layers (Gemma 2/3) keeps each kind in its own KV
    group with its own block tables, so that a window layer's blocks go back once no query can see
    them, while the full layers keep every block. Groups have `group_size` layers each and share
    one pool of equal blocks (the pool's layer axis is `group_size` long): a block holds one
    group's layers, whichever group took it. Group 0 is the full-context group, tracked by a
    request's `block_table`; groups 1.. by its `kv_tables`. One group (every other model) is the
    plain layout: block tables index all layers at once."""
    group_of: tuple[int, ...]  # per layer: its group
    slot_of: tuple[int, ...]  # per layer: its row on the pool's layer axis
    windows: tuple[int | None, ...]  # per group: the window of its layers (None: full context)
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def extra_windows(self) -> tuple[int | None, ...]:
        """The windows of groups 1.. (a request's kv_tables), as the block manager needs them."""
        return self.windows[1:]


def kv_layout(window, num_layers: int) -> KVLayout:
    """The layout for the attention's windows (inferd.model.config.attention_windows: one for every
    layer, or one per layer). Layers are grouped by window, full-context layers first; the group size
    is the fewest layers any window has, so that no group is more than partly empty (Gemma 3 270M:
    3 full layers, 15 of window 512, so 6 groups of 3)."""
    if not isinstance(window, list):
        return KVLayout((0,) * num_layers, tuple(range(num_layers)), (window,), num_layers)
    kinds = sorted(set(window), key=lambda w: (w is not None, w or 0))
    layers = {w: [i for i, x in enumerate(window) if x == w] for w in kinds}
    size = min(len(v) for v in layers.values())
    group_of, slot_of, windows = [0] * num_layers, [0] * num_layers, []
    for w in kinds:
        for start in range(0, len(layers[w]), size):
            for slot, layer in enumerate(layers[w][start:start + size]):
                group_of[layer], slot_of[layer] = len(windows), slot
            windows.append(w)
    return KVLayout(tuple(group_of), tuple(slot_of), tuple(windows), size)


# The 8-bit KV cache: a row (one slot's one kv head) is head_dim int8 codes followed by one fp16
# scale per 32 values (q8_0's granularity; the last group shorter where head_dim is not a multiple
# of 32), stored in the pool's int8 tensor as 2 more bytes a group: value = code * scale, scale = the
# group's largest magnitude / 127 rounded to fp16. 1 + 1/16 bytes a value: 1.88x the tokens of bf16 in
# the same memory at any head_dim that is a multiple of 32. A scale per row (the first layout) let one
# outlier coarsen a whole head: Gemma 3 270M measured mean KL 0.0075 against bf16. Quantized once,
# when written; read in place by the kernels (csrc/cpu/flash_attention_impl.h, kernels.h int8_row).
INT8 = torch.int8
KV_GROUP = 32
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, INT8)


# --kv-cache-dtype: the names a KV cache may be asked for (auto: the model's dtype)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
_KV_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "int8": INT8}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype -> the pool's dtype. fp8 is refused in one line: on these CPUs nothing converts
    e4m3 in hardware (AVX-512 before AVX10.2), so it would cost int8's bytes with 3 mantissa bits
    where int8 with a scale per 32 values keeps 7, and decode slower."""
    from inferd.errors import InferdError

    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3", "fp8_e5m2", "float8"):
        raise InferdError(f"--kv-cache-dtype {name}: not on CPUs; int8 (about the same bytes, a scale per 32 "
                          "values, 7 bits where e4m3 keeps 3) is the 8-bit KV cache here")
    if name not in _KV_NAMES:
        raise InferdError(f"unknown --kv-cache-dtype {name!r} (choose {', '.join(KV_CACHE_DTYPES)})")
    return _KV_NAMES[name]


def kv_groups(head_dim: int) -> int:
    return -(-head_dim // KV_GROUP)


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of the pool's last axis: head_dim, or head_dim + 2 bytes a group's scale for int8."""
    return head_dim + 2 * kv_groups(head_dim) if dtype == INT8 else head_dim


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., groups, 32], the last group zero-padded."""
    D = x.shape[-1]
    pad = kv_groups(D) * KV_GROUP - D
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], kv_groups(D), KV_GROUP)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> int8 cache rows [..., row_width(int8, D)], as the native write_kv_q8 makes
    them (the same operations: the fp16 scale first, then round half to even of x / scale)."""
    D = x.shape[-1]
    g = _grouped(x.float())
    scale = (g.abs().amax(-1, keepdim=True) / 127.0).clamp_(max=65504.0).to(torch.float16)
    sf = scale.float()
    codes = torch.where(sf > 0, torch.round(g / torch.where(sf > 0, sf, torch.ones_like(sf))),
                        torch.zeros_like(g)).clamp_(-127, 127).to(torch.int8)
    codes = codes.reshape(*x.shape[:-1], -1)[..., :D]
    return torch.cat([codes, scale.reshape(*x.shape[:-1], -1).contiguous().view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 cache rows [..., row_width(int8, head_dim)] -> float32 [..., head_dim]."""
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., groups]
    g = _grouped(rows[..., :head_dim].float()) * scale.unsqueeze(-1)
    return g.reshape(*rows.shape[:-1], -1)[..., :head_dim]


class KVPool:
    """K and V for every layer as [layers, num_blocks * block_size, n_kv, row] (slot-major), row =
    head_dim values, or head_dim int8 codes and their fp16 scales' bytes for an int8 cache."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device, shared: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.head_dim = dtype, head_dim
        shape = (num_layers, num_blocks * block_size, n_kv, row_width(dtype, head_dim))
        self.shm: dict | None = None  # {"path", "size"} of the shared mapping, when shared
        if shared:
            self.k, self.v = self._shared(shape, dtype)
            return
        # zeros, not empty: padded gathers read unused slots, and 0 * NaN garbage would poison them
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def quantized(self) -> bool:
        return self.dtype == INT8

    def _shared(self, shape, dtype):
        """K and V in one shared-memory file, so that a consumer engine on this host copies KV
        straight out of it (the shared-memory KV connector). The file is unlinked as soon as it is
        open: its memory goes back when this process exits, however it exits, and other processes
        open it as /proc/PID/fd/FD."""
        n = 1
        for d in shape:
            n *= d
        size = 2 * n * torch.empty((), dtype=dtype).element_size()
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="inferd-kv-", dir=where)
        os.unlink(path)
        os.ftruncate(fd, size)  # a new file reads as zeros
        self._map = mmap.mmap(fd, size)
        self._fd = fd
        flat = torch.frombuffer(self._map, dtype=dtype, count=2 * n)
        self.shm = {"path": f"/proc/{os.getpid()}/fd/{fd}", "size": size, "inode": os.fstat(fd).st_ino}
        return flat[:n].view(shape), flat[n:].view(shape)

    @staticmethod
    def bytes_per_block(num_layers, block_size, n_kv, head_dim, dtype) -> int:
        return (2 * num_layers * block_size * n_kv * row_width(dtype, head_dim)
                * torch.empty((), dtype=dtype).element_size())

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


class KVPool:
    """K and V for every layer as [layers, num_blocks * block_size, n_kv, head_dim] (slot-major)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device, shared: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks * block_size, n_kv, head_dim)
        self.shm: dict | None = None  # {"path", "size"} of the shared mapping, when shared
        if shared:
            self.k, self.v = self._shared(shape, dtype)
            return
        # zeros, not empty: padded gathers read unused slots, and 0 * NaN garbage would poison them
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

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
        return 2 * num_layers * block_size * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()

"""The KV pool: K and V of every layer in one preallocated tensor pair of fixed-size blocks, the
storage the block manager (inferd.engine.kv_cache) hands out by index. It lives with the worker: a
tensor-parallel rank holds its own share of it, and the shared-memory KV connector maps it."""
from __future__ import annotations

import mmap
import os
import tempfile

import torch


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

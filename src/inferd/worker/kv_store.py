"""The KV tier's storage: one file per KV block, named by the block's prefix-cache hash, in a
directory per (model, KV dtype, block size, layout). A directory on local disk is the disk tier; a
directory on /dev/shm (tmpfs) is the shared-memory tier: the same code, and every engine on the
host that opens the same directory shares it.

Why files: a rename is atomic, so a reader sees a whole block or none, whichever process wrote it
and however it died (a crash leaves only a temporary file, never read, swept at start); the kernel
arbitrates between processes with no lock of ours; and a restart finds the blocks where they were.
Each file carries a header (magic, namespace, its own hash, parent hash, seed, token ids, payload
size) and a CRC-32 over tokens and payload: a truncated, corrupt or misplaced file is a miss,
counted and deleted, never wrong KV. LRU by modification time: a load touches its files, and a
writer over the size limit deletes the oldest.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from array import array
from dataclasses import dataclass

import torch

MAGIC = b"IKV1"
# magic, namespace (16 bytes), hash, parent (0 if none), has_parent, seed, n_tokens, payload bytes, crc32
HEADER = struct.Struct("<4s16sQQBQIQI")
SUFFIX = ".kv"


class Miss(Exception):
    """A block file that cannot be used; `reason` names the counter (absent, truncated, corrupt, mismatch)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def namespace_of(fields: dict) -> bytes:
    """16 bytes naming what must agree for a block's KV to mean the same (model, dtype, block size...)."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).digest()


@dataclass
class BlockLayout:
    """One block's K (and V) as the pool holds it: [layers, block_size, n_kv, head_dim] of dtype."""
    layers: int
    block_size: int
    n_kv: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple:
        return (self.layers, self.block_size, self.n_kv, self.head_dim)

    @property
    def half_bytes(self) -> int:
        return self.layers * self.block_size * self.n_kv * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class BlockStore:
    def __init__(self, root: str, fields: dict, layout: BlockLayout, capacity: int):
        self.ns = namespace_of(fields)
        self.dir = os.path.join(root, self.ns.hex())
        os.makedirs(self.dir, exist_ok=True)
        meta = os.path.join(self.dir, "namespace.json")
        if not os.path.exists(meta):  # for people: what these blocks are
            tmp = f"{meta}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(fields, f, indent=1, sort_keys=True)
            os.replace(tmp, meta)
        self.layout = layout
        self.capacity = capacity
        self.bytes = 0  # this process's view of the directory's size: scanned, then kept by its own writes
        self.found = 0  # blocks the directory held when this store opened it
        now = time.time()
        for path, st in self._files():
            if os.path.basename(path).startswith("."):
                if now - st.st_mtime > 60:  # a write a crash interrupted (a live one is younger)
                    _unlink(path)
            elif path.endswith(SUFFIX):
                self.bytes += st.st_size
                self.found += 1

    def path(self, h: int) -> str:
        name = f"{h:016x}"
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def contains(self, h: int) -> bool:
        return os.path.exists(self.path(h))

    def _files(self):
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                try:
                    yield e.path, e.stat()
                except FileNotFoundError:  # another engine evicted it meanwhile
                    continue

    # -- write ---------------------------------------------------------------------------------
    def write(self, h: int, parent: int | None, seed: int, tokens, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write one block; returns its bytes. OSError (a full disk, say) leaves nothing behind."""
        toks = array("i", tokens).tobytes()
        kb, vb = _raw(k), _raw(v)
        crc = zlib.crc32(vb, zlib.crc32(kb, zlib.crc32(toks)))
        head = HEADER.pack(MAGIC, self.ns, h, parent or 0, parent is not None, seed, len(tokens), len(kb) + len(vb), crc)
        final = self.path(h)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(toks)
                f.write(kb)
                f.write(vb)
            os.replace(tmp, final)  # atomic: readers see the whole block or none
        except BaseException:
            _unlink(tmp)
            raise
        n = len(head) + len(toks) + len(kb) + len(vb)
        self.bytes += n
        return n

    # -- read ----------------------------------------------------------------------------------
    def read(self, h: int, parent: int | None, seed: int, tokens) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The block's K and V (new tensors of the layout's shape), and the file's bytes; Miss if the
        file is absent or is not exactly this block."""
        path = self.path(h)
        try:
            with open(path, "rb", buffering=0) as f:
                # straight into a writable buffer the tensors view: no copy between the read and the pool
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
        except FileNotFoundError:
            raise Miss("absent") from None
        if got != len(data):  # shrank under us: another engine's eviction, a truncation
            raise Miss("truncated", f"{got} of {len(data)} bytes read")
        lay = self.layout
        half = lay.half_bytes
        n_tok = len(tokens)
        want = HEADER.size + 4 * n_tok + 2 * half
        if len(data) < HEADER.size:
            raise Miss("truncated", f"{len(data)} bytes")
        magic, ns, fh, fparent, has_parent, fseed, fn, payload, crc = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise Miss("corrupt", "not a block file")
        if ns != self.ns or fh != h or fn != n_tok or payload != 2 * half:
            raise Miss("mismatch", "another model, KV dtype or block size")
        if len(data) != want:
            raise Miss("truncated", f"{len(data)} of {want} bytes")
        view = memoryview(data)
        toks = view[HEADER.size:HEADER.size + 4 * n_tok]
        body = view[HEADER.size + 4 * n_tok:]
        if zlib.crc32(body, zlib.crc32(toks)) != crc:
            raise Miss("corrupt", "checksum")
        if (fparent if has_parent else None) != parent or fseed != seed or array("i", toks.tobytes()).tolist() != list(tokens):
            raise Miss("mismatch", "another prefix under the same hash")
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=HEADER.size + 4 * n_tok)
        k = flat[:half].view(lay.dtype).view(lay.shape)
        v = flat[half:].view(lay.dtype).view(lay.shape)
        return k, v, len(data)

    def touch(self, h: int):
        try:
            os.utime(self.path(h))
        except OSError:
            pass

    def discard(self, h: int):
        _unlink(self.path(h))

    # -- size limit ----------------------------------------------------------------------------
    def over(self) -> bool:
        return self.bytes > self.capacity

    def shrink(self, target: float = 0.9) -> list[int]:
        """Delete the least recently used blocks until the directory holds target x capacity;
        returns their hashes. The directory is scanned: other engines' writes count too."""
        files = sorted(((st.st_mtime_ns, st.st_size, p) for p, st in self._files()
                        if p.endswith(SUFFIX) and not os.path.basename(p).startswith(".")))
        total = sum(s for _, s, _ in files)
        gone = []
        for _, size, p in files:
            if total <= target * self.capacity:
                break
            _unlink(p)
            total -= size
            gone.append(int(os.path.basename(p)[:-len(SUFFIX)], 16))
        self.bytes = total
        return gone

    def size(self) -> tuple[int, int]:
        """(blocks, bytes) in the directory now."""
        n = b = 0
        for p, st in self._files():
            if p.endswith(SUFFIX):
                n += 1
                b += st.st_size
        return n, b


def _unlink(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

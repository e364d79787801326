"""The second KV tier: full prefix blocks kept outside the pool (inferd.worker.kv_store: a directory on
disk or on /dev/shm), found by the prefix cache's own hash chain, so that a prefix the pool evicted,
a restart forgot or another replica computed is loaded instead of recomputed.

Writes go through: every block the pool registers as a full prefix block is copied out at once
(the pool may hand it to someone else as soon as its request ends) and written by the I/O thread,
once per hash. Writing through, rather than at eviction, is what lets a restart or another replica
find blocks this engine never evicted.

Loads are asynchronous. At admission, after the pool's own prefix match, the scheduler asks how
many of the following blocks the tier holds (one stat each), allocates pool blocks for them and
hands the request here; the I/O thread reads, checks and copies them into those blocks while the
other requests' steps go on; the scheduler takes the request back with its computed length set to
the blocks that loaded (a block that fails its checks ends the run: the rest is computed). Loads
go before writes on the one I/O thread: a waiting request is latency, a pending write is not.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict

from inferd.distributed.kv_events import EventLog, lora_id
from inferd.worker.kv_store import BlockLayout, BlockStore, Miss

log = logging.getLogger("inferd")

SHM_ROOT = "/dev/shm/inferd-kv-tier"
MAX_PENDING_WRITE_BYTES = 256 * 2**20  # copies waiting for the I/O thread; past it, new blocks are not written
KNOWN_CAP = 1 << 17  # hashes this engine knows the tier holds (a bounded memo, not the truth: the files are)


def tier_root(value: str) -> tuple[str, str]:
    """--kv-tier -> (directory, medium): "shm" is a directory on /dev/shm."""
    if value == "shm":
        return SHM_ROOT, "SHM"
    return os.path.abspath(os.path.expanduser(value)), "SHM" if os.path.realpath(value).startswith("/dev/shm") else "DISK"


class KVTier:
    def __init__(self, pool, block_manager, fields: dict, root: str, capacity: int, events: bool = False):
        self.pool, self.bm = pool, block_manager
        self.bs = block_manager.block_size
        root, self.medium = tier_root(root)
        layout = BlockLayout(pool.k.shape[0], self.bs, pool.k.shape[2], pool.k.shape[3], pool.k.dtype)
        try:
            self.store = BlockStore(root, fields, layout, capacity)
        except OSError as e:
            from inferd.errors import InferdError

            raise InferdError(f"--kv-tier {root}: {e.strerror or e}") from None
        self.block_bytes = 2 * layout.half_bytes
        self._lock = threading.Lock()  # guards what both threads touch: counters, the memo, the tier's events
        self._log = EventLog() if events else None  # the tier's own stores and removals (medium DISK/SHM)
        self.counters = {"hits": 0, "hit_tokens": 0, "lookups": 0, "loaded_blocks": 0, "loaded_bytes": 0,
                         "stored_blocks": 0, "stored_bytes": 0, "store_skipped": 0, "store_errors": 0,
                         "evicted_blocks": 0, "absent": 0, "truncated": 0, "corrupt": 0, "mismatch": 0,
                         "loads": 0, "load_seconds": 0.0}
        self.seconds: list[float] = []  # load durations not yet taken by a snapshot
        self.known: OrderedDict[int, None] = OrderedDict()
        self.loading: dict[str, tuple] = {}  # request id -> (request, first block, blocks asked)
        self.cancelled: set[str] = set()
        self.done: queue.Queue = queue.Queue()
        self.wake = threading.Event()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._pending_bytes = 0
        self._store_error_logged = 0.0
        self.thread = threading.Thread(target=self._io_loop, name="inferd-kv-tier", daemon=True)
        self.thread.start()
        log.info("KV tier: %s (%s, up to %.1f GiB, %d KiB a block; %d blocks there now)", self.store.dir,
                 self.medium, capacity / 2**30, self.block_bytes // 1024, self.store.found)

    # -- admission (engine thread) ------------------------------------------------------------------
    @staticmethod
    def serves(req) -> bool:
        """Prompt logprobs need every position computed; an adapter's blocks stay out of the tier (a
        restart may load other weights under the same adapter name, and the tier would not know)."""
        return req.params.prompt_logprobs is None and req.lora is None

    def lookup(self, req, first: int) -> int:
        """How many full blocks from block `first` on the tier holds, in a run (at most up to the
        last full block before the prompt's final token, which is always computed)."""
        n_full = (len(req.all_ids) - 1) // self.bs
        if first >= n_full:
            return 0
        self.counters["lookups"] += 1
        hashes = self.bm.extend_hashes(req, n_full)
        k = 0
        while first + k < n_full and self.store.contains(hashes[first + k]):
            with self._lock:  # loaded blocks register in the pool next: not written back
                self._remember(hashes[first + k])
            k += 1
        return k

    def start_load(self, req, first: int, count: int):
        """req holds pool blocks for blocks first..first+count-1: fill them from the tier."""
        ids, bs, seed = req.all_ids, self.bs, lora_id(req.lora)
        hashes = req.block_hashes
        blocks = [(req.block_table[i], hashes[i], hashes[i - 1] if i else None, ids[i * bs:(i + 1) * bs])
                  for i in range(first, first + count)]
        self.loading[req.request_id] = (req, first, count)
        self._jobs.put((0, next(self._order), ("load", req.request_id, seed, blocks)))

    def finished_loads(self) -> list[tuple]:
        """(request, first block, blocks loaded) for each load that ended; cancelled ones are freed here."""
        out = []
        while True:
            try:
                rid, n_ok, secs = self.done.get_nowait()
            except queue.Empty:
                return out
            req, first, count = self.loading.pop(rid)
            self.seconds.append(secs)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                self.bm.free_request(req)
                continue
            out.append((req, first, n_ok))

    def cancel(self, req) -> bool:
        """True if req's load is in flight: its blocks are freed when the load ends, not now (the
        I/O thread is writing into them)."""
        if req.request_id in self.loading:
            self.cancelled.add(req.request_id)
            return True
        return False

    def busy(self) -> bool:
        return bool(self.loading)

    def wait(self, timeout: float):
        if self.done.empty():
            self.wake.wait(timeout)
        self.wake.clear()

    # -- write-through (engine thread) ----------------------------------------------------------------
    def write_through(self, new_blocks: list[tuple]):
        """Blocks the pool just registered: (pool block, hash, parent hash, tokens, seed). Copied now,
        written by the I/O thread, each hash once."""
        if not new_blocks:
            return
        pool, bs = self.pool, self.bs
        for b, h, parent, tokens, seed in new_blocks:
            if seed:  # an adapter's block (see serves)
                continue
            with self._lock:
                if h in self.known:
                    self.known.move_to_end(h)
                    continue
                if self._pending_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
                    self.counters["store_skipped"] += 1
                    continue
                self._remember(h)
                self._pending_bytes += self.block_bytes
            k = pool.k[:, b * bs:(b + 1) * bs].clone()
            v = pool.v[:, b * bs:(b + 1) * bs].clone()
            self._jobs.put((1, next(self._order), ("store", h, parent, seed, tokens, k, v)))

    def _remember(self, h: int):
        self.known[h] = None
        if len(self.known) > KNOWN_CAP:
            self.known.popitem(last=False)

    def take_events(self) -> list:
        if self._log is None:
            return []
        with self._lock:
            return self._log.take()

    # -- the I/O thread ----------------------------------------------------------------------------
    def _io_loop(self):
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if job[0] == "load":
                self._load(*job[1:])
            else:
                self._store(*job[1:])

    def _load(self, rid: str, seed: int, blocks: list):
        t0 = time.monotonic()
        store, bs, pool = self.store, self.bs, self.pool
        n_ok = nbytes = 0
        for b, h, parent, tokens in blocks:
            try:
                k, v, size = store.read(h, parent, seed, tokens)
            except Miss as e:
                with self._lock:
                    self.counters[e.reason] += 1
                if e.reason != "absent":
                    log.warning("KV tier: block %016x is unusable (%s): computing it instead", h, e)
                    store.discard(h)
                    with self._lock:
                        self.known.pop(h, None)
                break
            except OSError as e:
                log.warning("KV tier: cannot read block %016x (%s): computing it instead", h, e)
                break
            pool.k[:, b * bs:(b + 1) * bs].copy_(k)
            pool.v[:, b * bs:(b + 1) * bs].copy_(v)
            store.touch(h)
            n_ok += 1
            nbytes += size
        secs = time.monotonic() - t0
        with self._lock:
            c = self.counters
            c["loaded_blocks"] += n_ok
            c["loaded_bytes"] += nbytes
            c["loads"] += 1
            c["load_seconds"] += secs
            if n_ok:
                c["hits"] += 1
                c["hit_tokens"] += n_ok * bs
        self.done.put((rid, n_ok, secs))
        self.wake.set()

    def _store(self, h, parent, seed, tokens, k, v):
        try:
            if not self.store.contains(h):  # another engine on this tier may have written it since
                n = self.store.write(h, parent, seed, tokens, k, v)
                with self._lock:
                    self.counters["stored_blocks"] += 1
                    self.counters["stored_bytes"] += n
                    if self._log is not None:
                        self._log.stored([h], parent, list(tokens), self.bs, seed, self.medium)
                if self.store.over():
                    gone = self.store.shrink()
                    with self._lock:
                        self.counters["evicted_blocks"] += len(gone)
                        for g in gone:
                            self.known.pop(g, None)
                            if self._log is not None:
                                self._log.removed(g, self.medium)
        except OSError as e:
            with self._lock:
                self.counters["store_errors"] += 1
            now = time.monotonic()
            if now - self._store_error_logged > 30:  # one line, not one a block
                self._store_error_logged = now
                why = "the tier's disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
                log.warning("KV tier: cannot write blocks to %s (%s): they stay in the pool only", self.store.dir, why)
            with self._lock:
                self.known.pop(h, None)
        finally:
            with self._lock:
                self._pending_bytes -= self.block_bytes

    # -- reporting ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        c = self.view()
        c["seconds"], self.seconds = self.seconds, []
        return c

    def view(self) -> dict:
        with self._lock:
            c = dict(self.counters)
        c["medium"] = self.medium
        c["bytes"] = max(0, self.store.bytes)
        c["capacity"] = self.store.capacity
        c["loading"] = len(self.loading)
        return c

    def close(self):
        """Let queued writes finish (a graceful restart finds them), then stop the thread."""
        self._jobs.put((2, next(self._order), None))
        self.thread.join(30)


def fingerprint_fields(engine) -> dict:
    """What the tier's namespace is made of: the model (as the KV transfer fingerprints it), the KV
    dtype, the block size and the pool's layout. Any difference is another directory: a miss."""
    from inferd.distributed.kv_transfer.transfer import model_fingerprint

    pool = engine.pool
    return {"model": model_fingerprint(engine), "block_size": engine.block_manager.block_size,
            "kv_dtype": str(pool.k.dtype).replace("torch.", ""), "pool_rows": list(pool.k.shape[::2]),
            "format": 2}  # 2: int8 rows carry an fp16 scale per 32 values (1: a float32 scale a row)


"""Disaggregated prefill and decode: an engine's side of handing prompt KV to another engine.

A producer (prefill worker) runs a request marked `kv_transfer_params: {"do_remote_decode": true}`
like any other; when it finishes (the router asks for max_tokens=1), its prompt blocks are not
freed but leased (inferd.distributed.kv_transfer.leases), and its answer carries kv_transfer_params
naming the lease, its blocks and where to fetch them. A consumer (decode worker) given those
params allocates blocks for the prompt in its own pool, pulls the KV of every prompt position but
the last over the connector (a thread of its own, so steps go on meanwhile), confirms, and then
schedules the request with one prompt token left to compute: the last position, whose logits give
the first token. So the consumer samples every output token itself, with its own sampling state
(seed, penalties, logprobs), and computes exactly one prompt token per transferred request (vLLM's
choice too). A consumer that cannot get the KV (no answer within transfer_timeout_s, lease gone,
KV in the wrong form) recomputes the whole prompt, counted: never garbage, never a hang.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque

import torch

from inferd.distributed.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from inferd.distributed.kv_transfer.connectors import (KVServer, SharedMemoryConnector, TransferError, dtype_name,
                                                       make_connector)
from inferd.distributed.kv_transfer.leases import LeaseTable
from inferd.distributed.kv_transfer.wire import RemoteKV, bytes_per_token, check_remote, prompt_digest, token_slots
from inferd.errors import InferdError

__all__ = ["KVTransfer", "KVTransferConfig", "parse_kv_transfer_config"]

log = logging.getLogger("inferd")


def model_fingerprint(engine) -> dict:
    """What must agree between producer and consumer for KV to mean the same: the model (its shapes
    and a digest of some of its weights), how it is quantized, and the KV dtype. Block sizes may
    differ: KV travels by token."""
    mc = engine.model_config
    h = hashlib.blake2b(digest_size=8)
    for name, t in list(engine.model.state_dict().items())[:4]:
        h.update(name.encode())
        h.update(t.detach().reshape(-1)[:1024].float().numpy().tobytes())
    return {"layers": mc.num_hidden_layers, "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size, "kv_dtype": dtype_name(engine.pool.k.dtype),
            "quantization": engine.config.quantization, "weights": h.hexdigest()}


class KVTransfer:
    def __init__(self, engine, cfg: KVTransferConfig):
        self.cfg, self.engine = cfg, engine
        self.bm, self.pool = engine.block_manager, engine.pool
        mc = engine.model_config
        self.fingerprint = model_fingerprint(engine)
        # a pool row is head_dim values, or an int8 cache's head_dim codes and its scale's 4 bytes: KV
        # travels as the pool holds it, scales and all
        esize, self.row = self.pool.k.element_size(), self.pool.k.shape[-1]
        self.per_token = bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, self.row, esize)
        self.counters = {"leases": 0, "lease_confirmed": 0, "lease_expired": 0, "transfers": 0, "failures": 0,
                         "recomputes": 0, "bytes": 0, "tokens": 0, "bytes_sent": 0}
        self.seconds: list[float] = []  # transfer durations not yet reported in a snapshot
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]  # lease ids stay unique when a producer restarts under its engine id
        self.leases = self.server = None
        if cfg.producer:
            self.leases = LeaseTable(cfg.lease_timeout_s)
            info = {"engine_id": cfg.engine_id, "fingerprint": self.fingerprint}
            self.server = KVServer(self.pool, self.leases, self.bm.block_size, cfg.kv_ip, cfg.kv_port, info,
                                   engine.faults)
            log.info("KV producer %s: serving leased KV on tcp://%s:%d (%s, lease %.0f s)", cfg.engine_id,
                     cfg.kv_ip, self.server.port, cfg.kv_connector, cfg.lease_timeout_s)
        self.connector = None
        if cfg.consumer:
            self.connector = make_connector(cfg.kv_connector, cfg.transfer_timeout_s, self.pool.k.dtype,
                                            mc.num_hidden_layers, mc.num_key_value_heads, self.row)
            self.jobs: queue.Queue = queue.Queue()
            self.done: queue.Queue = queue.Queue()
            self.wake = threading.Event()
            self.pending: dict[str, object] = {}  # request id -> Request whose KV is on its way
            self.blocked: deque = deque()  # requests waiting for blocks to pull into
            self.cancelled: set[str] = set()  # aborted while their pull runs: freed when it ends
            self.thread = threading.Thread(target=self._fetch_loop, name="inferd-kv-fetch", daemon=True)
            self.thread.start()
            log.info("KV consumer %s: pulls KV with %s (timeout %.0f s)", cfg.engine_id, cfg.kv_connector,
                     cfg.transfer_timeout_s)

    # -- admission (engine thread) ----------------------------------------------------------------
    def parse(self, params, prompt_ids: list[int], sampling) -> tuple[str | None, RemoteKV | None]:
        """A request's kv_transfer_params -> ("export", None) for a producer's request,
        ("import", remote) for a consumer's, (None, None) for neither; a 400 when they are bad."""
        if not isinstance(params, dict):
            raise InferdError("kv_transfer_params must be an object")
        if params.get("do_remote_decode"):
            if self.leases is None:
                raise InferdError("kv_transfer_params ask for remote decode, but this engine is not a KV producer "
                                  "(--kv-transfer-config kv_role kv_producer or kv_both)")
            if sampling.num_samples != 1:
                raise InferdError("a request prefilled for remote decode must have n = 1")
            return "export", None
        if params.get("do_remote_prefill"):
            if self.connector is None:
                raise InferdError("kv_transfer_params carry remote KV, but this engine is not a KV consumer "
                                  "(--kv-transfer-config kv_role kv_consumer or kv_both)")
            if sampling.prompt_logprobs is not None:
                raise InferdError("prompt logprobs need every prompt position computed here: not with remote KV")
            remote = check_remote(params, prompt_ids, self.fingerprint)
            if isinstance(self.connector, SharedMemoryConnector) and remote.shm is None:
                raise InferdError("the producer does not share its KV pool (its kv_connector is not "
                                  "SharedMemoryConnector): give this decode worker the ZmqConnector")
            return "import", remote
        return None, None

    def start_import(self, req):
        self.blocked.append(req)
        self._allocate()

    def _allocate(self):
        """Blocks for queued imports, in arrival order: every prompt position (the last one is
        computed here, so its slot is reserved now), less what the local prefix cache has."""
        bm = self.bm
        while self.blocked:
            req = self.blocked[0]
            n = req.num_prompt
            hit = bm.match_prefix(req)
            if not bm.allocate(req, n - hit):
                bm.free_request(req)
                req.num_computed = 0
                return
            self.blocked.popleft()
            bm.count_admission(req, hit)
            if hit >= n - 1:  # the local cache had it all: nothing to pull
                self._ready(req, 0)
                self._confirm_unused(req.remote)
                continue
            dst = token_slots(req.block_table, bm.block_size, hit, n - 1)
            self.pending[req.request_id] = req
            self.jobs.put((req.request_id, req.remote, hit, n - 1, dst))

    def _confirm_unused(self, remote):
        self.jobs.put(("", remote, 0, 0, None))  # a confirm only: the producer frees the lease now

    def _ready(self, req, tokens: int):
        req.num_computed = req.num_prompt - 1
        req.remote_tokens = tokens
        self.bm.register_full_blocks(req)
        self.engine.scheduler.add(req)

    # -- the fetch thread -----------------------------------------------------------------------
    def _fetch_loop(self):
        conn = self.connector
        while True:
            job = self.jobs.get()
            if job is None:
                return
            rid, remote, start, end, dst = job
            t0 = time.monotonic()
            if dst is None:
                try:
                    conn.confirm(remote)
                except Exception as e:  # noqa: BLE001 - its lease expires instead
                    log.warning("KV confirm to %s:%d failed (%s): the producer's lease will expire", remote.host,
                                remote.port, e)
                continue
            try:
                k, v = conn.pull(remote, start, end)
                idx = torch.tensor(dst)
                self.pool.k.index_copy_(1, idx, k)
                self.pool.v.index_copy_(1, idx, v)
                try:
                    confirmed = conn.confirm(remote)
                except TransferError as e:
                    if isinstance(conn, SharedMemoryConnector):
                        raise
                    confirmed = True  # the reply was copied under the lease: valid; the lease will expire
                    log.warning("KV confirm failed after a complete pull (%s): the producer's lease will expire", e)
                if not confirmed and isinstance(conn, SharedMemoryConnector):
                    raise TransferError("the lease expired before the copy out of shared memory was confirmed")
                self.done.put((rid, None, (end - start) * self.per_token, time.monotonic() - t0, end - start))
            except Exception as e:  # noqa: BLE001 - any failure means: recompute the prompt
                self.done.put((rid, f"{type(e).__name__}: {e}", 0, time.monotonic() - t0, 0))
            self.wake.set()

    # -- every engine step, and when idle (engine thread) -------------------------------------------
    def housekeeping(self) -> bool:
        """Free confirmed and expired leases; admit requests whose KV arrived (or recompute those
        whose KV did not); place queued imports. True if anything changed."""
        changed = False
        if self.leases is not None:
            n = self.leases.expire()
            if n:
                log.warning("%d KV lease(s) expired unclaimed: their blocks are freed", n)
            for blocks in self.leases.take_freeable():
                self.bm.release_blocks(blocks)
                changed = True
        if self.connector is not None:
            while True:
                try:
                    rid, err, nbytes, secs, ntok = self.done.get_nowait()
                except queue.Empty:
                    break
                changed = True
                req = self.pending.pop(rid)
                self.seconds.append(secs)
                if rid in self.cancelled:
                    self.cancelled.discard(rid)
                    self.bm.free_request(req)
                    continue
                if err is None:
                    self.counters["transfers"] += 1
                    self.counters["bytes"] += nbytes
                    self.counters["tokens"] += ntok
                    self._ready(req, ntok)
                else:
                    log.warning("KV pull for %s failed (%s): recomputing its prompt here", rid, err)
                    self.counters["failures"] += 1
                    self.counters["recomputes"] += 1
                    self.bm.free_request(req)
                    req.num_computed = 0
                    req.remote = None
                    self.engine.scheduler.add(req)
            if self.blocked:
                before = len(self.blocked)
                self._allocate()
                changed = changed or len(self.blocked) != before
        return changed

    def busy(self) -> bool:
        return self.connector is not None and bool(self.pending or self.blocked)

    def leased_blocks(self) -> int:
        return self.leases.num_blocks if self.leases is not None else 0

    def wait(self, timeout: float):
        """Nothing to step until a pull ends or a lease goes: sleep, not spinning a core."""
        if self.connector is not None and self.pending:
            if self.done.empty():
                self.wake.wait(timeout)
            self.wake.clear()
        else:
            time.sleep(timeout)

    def abort(self, req) -> bool:
        """True if this request is the connector's (queued or pulling): it is dropped here, and a
        pull in flight keeps its blocks until the pull ends, so nothing is written into reused blocks."""
        if self.connector is None:
            return False
        if req in self.blocked:
            self.blocked.remove(req)
            self._confirm_unused(req.remote)
            return True
        if req.request_id in self.pending:
            self.cancelled.add(req.request_id)
            return True
        return False

    # -- the producer's end of a request ------------------------------------------------------------
    def export(self, req) -> dict:
        """A producer's request finished: lease its prompt blocks; the params say where they are."""
        sched, bm, cfg = self.engine.scheduler, self.bm, self.cfg
        sched.detach(req)
        n = req.num_prompt
        keep = -(-n // bm.block_size)
        blocks = req.block_table[:keep]
        bm.release_blocks(req.block_table[keep:])
        req.block_table, req.block_hashes, req.num_cached_hashed = [], [], 0
        lease = f"{cfg.engine_id}-{self._run}-{next(self._ids)}"
        self.leases.add(lease, blocks, n)
        self.counters["leases"] += 1
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": cfg.engine_id,
                "remote_host": cfg.host, "remote_port": self.server.port, "remote_request_id": lease,
                "remote_block_ids": blocks, "remote_block_size": bm.block_size, "remote_num_blocks": bm.num_blocks,
                "remote_num_tokens": n, "remote_prompt_digest": prompt_digest(req.prompt_ids),
                "remote_fingerprint": self.fingerprint, "remote_connector": cfg.kv_connector,
                "remote_shm": self.pool.shm}

    def snapshot(self) -> dict:
        """The counters, and the transfer times since the last snapshot (taken: they feed a histogram)."""
        c = self.view()
        c["seconds"], self.seconds = self.seconds, []
        return c

    def view(self) -> dict:
        """The counters, changing nothing (the dashboard's read)."""
        c = dict(self.counters)
        if self.leases is not None:
            c["lease_confirmed"], c["lease_expired"] = self.leases.confirmed, self.leases.expired
            c["leased_blocks"] = self.leases.num_blocks
            c["bytes_sent"] = self.server.bytes_sent
        c["connector"] = self.cfg.kv_connector
        return c

    def close(self):
        if self.connector is not None:
            self.jobs.put(None)
            self.thread.join(2)
            self.connector.control.close()
        if self.server is not None:
            self.server.close()

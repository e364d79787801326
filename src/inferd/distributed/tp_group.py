"""A tensor-parallel group as rank 0 sees it: start the other ranks, connect, shard, hand over steps.

Rank 0 is the engine (scheduler, KV block tables, sampler); ranks 1..N-1 are worker processes
(`inferd.distributed.tp_worker`) that hold their shard of the weights and of the KV pool and run
whatever step rank 0 sends (`ModelRunner.run` of a `StepPlan`). Sampling happens on rank 0 only,
from the gathered logits: one sampler, so seeded streams need no agreement between ranks.

An executor (`inferd.distributed.executor`) starts the other ranks: processes on this host (`mp`),
or Ray actors in a placement group (`ray`). They talk through a shared-memory segment when every
rank is on rank 0's node (`--tensor-parallel-backend shm`, the default on CPU), else a
torch.distributed process group (gloo; nccl on CUDA). Any rank that dies makes the others' next
collective fail (`CollectiveError`), and the watchdog aborts rank 0's collective when the
executor reports one gone: an unrecoverable engine fault.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from inferd.distributed import tmpdirs
from inferd.distributed.comm import (ShmComm, connect, ready_counts, resolve_backend, tcp_store, torchrun_backend,
                                    torchrun_rank, weights_of)
from inferd.distributed.executor import Executor, MpExecutor
from inferd.errors import InferdError
from inferd.quant.linear import weight_bytes

log = logging.getLogger("inferd")

def make_executor(cfg, world: int) -> Executor:
    if cfg.distributed_executor_backend == "ray":
        try:
            from inferd.distributed.ray_executor import RayExecutor
        except ImportError:
            raise InferdError("--distributed-executor-backend ray needs Ray: pip install 'inferd[ray]'") from None
        return RayExecutor(cfg, world)
    return MpExecutor(world, cfg.threads)


class TensorParallelGroup:
    """Rank 0's end: `shard` (the model rewrite for load_model), `setup` (the KV pool's size, sent
    once loaded), `comm` (for the ModelRunner), `close`."""

    def __init__(self, cfg, world: int):
        self.world = world
        self.failed: str | None = None
        self._closing = False
        self._dir: str | None = None
        self._threads_before = torch.get_num_threads()
        launched = torchrun_rank()
        if launched is not None:  # torchrun started the other ranks: nothing to start or watch
            if launched != (0, world):
                raise InferdError(f"torchrun started rank {launched[0]} of {launched[1]} as the engine: "
                                  f"--tensor-parallel-size {world} needs exactly {world} processes")
            self.backend = torchrun_backend(cfg.tensor_parallel_backend, cfg.device)
            self.executor = MpExecutor(world, cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        else:
            self.executor = make_executor(cfg, world)
        places = self.executor.placements
        nodes = len({p.node for p in places})
        self.placements = places
        try:
            if launched is None:
                self.backend = resolve_backend(cfg.tensor_parallel_backend, cfg.device, nodes)
            self.threads = places[0].threads
            torch.set_num_threads(self.threads)
            device = torch.device(f"cuda:{0}" if cfg.device.startswith("cuda") else "cpu")
            store = url = None  # torchrun's env:// rendezvous
            shm = ShmComm(0, world) if self.backend == "shm" else None
            if launched is None and shm is None:  # rank 0 holds the store: a file on one host, TCP across nodes
                if nodes == 1:
                    self._dir = tmpdirs.make("tp")  # removed by close(), else swept once this process is gone
                    store = url = os.path.join(self._dir, "store")
                else:
                    store, url = tcp_store(places[0].ip, world)
            ip = (lambda r: places[r].ip) if nodes > 1 else (lambda r: None)
            specs = {r: {"cfg": cfg, "rank": r, "world": world, "backend": self.backend,
                         "store": url,
                         "shm": shm.path if shm else None, "cpus": places[r].cpus, "threads": places[r].threads,
                         "ip": ip(r), "parent": os.getpid() if cfg.distributed_executor_backend == "mp" else None,
                         "log_level": logging.getLogger().getEffectiveLevel()} for r in range(1, world)}
            if launched is None:
                self.executor.start(specs)
            self.comm = shm if shm is not None else connect(self.backend, 0, world, store, None, device, ip=ip(0))[1]
        except Exception:
            self.close()
            raise
        self._watch = threading.Thread(target=self._watchdog, name="inferd-tp-watchdog", daemon=True)
        self._watch.start()
        pinned = places[-1].cpus is not None or cfg.distributed_executor_backend != "mp"
        log.info("tensor parallel: %d ranks over %s on %d node(s), %s executor, %d thread(s) each%s", world,
                 self.backend, nodes, cfg.distributed_executor_backend, self.threads,
                 "" if pinned else " (fewer cores than ranks: not pinned)")

    def shard(self, model):
        """The rewrite load_model applies between quantizing and packing (rank 0's share)."""
        from inferd.distributed.tensor_parallel import apply_tp, plan_of

        shards = plan_of(model.cfg, self.world)
        for s in shards:
            log.info("tensor parallel %s", s.describe())
        self.model = model
        return apply_tp(model, shards[0], self.comm)

    def setup(self, info: dict):
        """Send the KV pool's shape to the other ranks and wait until each has built its pool."""
        self.comm.send_obj(info)
        ready = ready_counts(0, self.world, weight_bytes(self.model))
        self.comm.all_reduce_(ready)  # returns when every rank is ready
        self.rank_weight_bytes = weights_of(ready)  # each rank's share, as each rank counts it
        self.comm.counts.clear()

    def _watchdog(self):
        while not self._closing:
            reason = self.executor.dead()
            if reason is not None and not self._closing:
                self.failed = reason
                log.error("%s", self.failed)
                self.comm.abort_reason = self.failed
                self.comm.abort()
                return
            time.sleep(0.1)

    def close(self):
        if self._closing:
            return
        self._closing = True
        comm = getattr(self, "comm", None)
        executor = getattr(self, "executor", None)
        if comm is not None and self.failed is None and executor.dead() is None:
            try:
                comm.send_obj(None)  # the workers' loop ends
            except Exception:  # noqa: BLE001 - a rank is already gone
                pass
        if executor is not None:
            executor.stop(10)
        watch = getattr(self, "_watch", None)
        if watch is not None and watch is not threading.current_thread():
            # joined, not left as a daemon: one still running when the interpreter exits is torn
            # down mid-call, and that aborted the process ("terminate called without an active
            # exception") in about one test run in three
            watch.join(5)
        if comm is not None:
            comm.close()
        tmpdirs.remove(self._dir)
        torch.set_num_threads(self._threads_before)

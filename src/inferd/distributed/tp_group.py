"""A tensor-parallel group as rank 0 sees it: start the other ranks, connect, shard, hand over steps.

Rank 0 is the engine (scheduler, KV block tables, sampler); ranks 1..N-1 are worker processes
(`inferd.distributed.tp_worker`) that hold their shard of the weights and of the KV pool and run
whatever step rank 0 sends (`ModelRunner.run` of a `StepPlan`). Sampling happens on rank 0 only,
from the gathered logits: one sampler, so seeded streams need no agreement between ranks.

Ranks are processes started with `subprocess` (not multiprocessing: an engine core process is
itself a daemonic child, which multiprocessing forbids to have children), each pinned to its own
cores. They talk through a shared-memory segment (`--tensor-parallel-backend shm`, the default on
CPU), or a torch.distributed process group (gloo; nccl on CUDA). Any rank that dies makes the others' next
collective fail (`CollectiveError`): an unrecoverable engine fault.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

from inferd.distributed.comm import ShmComm, connect, resolve_backend, torchrun_backend, torchrun_rank
from inferd.errors import InferdError
from inferd.quant.linear import weight_bytes

log = logging.getLogger("inferd")

def core_sets(world: int, cpus: list[int] | None = None) -> list[list[int] | None]:
    """Disjoint cores for each rank (their OpenMP workers must not preempt each other at every
    barrier); None for every rank when there are fewer cores than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    per = len(cpus) // world
    if per == 0:
        return [None] * world
    return [cpus[r * per:(r + 1) * per] for r in range(world)]


def ready_counts(rank: int, world: int, nbytes: int) -> torch.Tensor:
    """The all-reduce every rank makes when ready, carrying its weight bytes: MiB and the rest in two
    float32 lanes (exact below 16 TiB; one float32 holds integers exactly only up to 2^24)."""
    t = torch.zeros(world, 2)
    t[rank, 0], t[rank, 1] = divmod(nbytes, 1 << 20)
    return t


def weights_of(ready: torch.Tensor) -> list[int]:
    return [(int(hi) << 20) + int(lo) for hi, lo in ready.tolist()]


class TensorParallelGroup:
    """Rank 0's end: `shard` (the model rewrite for load_model), `setup` (the KV pool's size, sent
    once loaded), `comm` (for the ModelRunner), `close`."""

    def __init__(self, cfg, world: int):
        self.world = world
        launched = torchrun_rank()
        if launched is not None:
            if launched != (0, world):
                raise InferdError(f"torchrun started rank {launched[0]} of {launched[1]} as the engine: "
                                  f"--tensor-parallel-size {world} needs exactly {world} processes")
            self.backend = torchrun_backend(cfg.tensor_parallel_backend, cfg.device)
        else:
            self.backend = resolve_backend(cfg.tensor_parallel_backend, cfg.device)
        self.failed: str | None = None
        self._closing = False
        self.procs: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="inferd-tp-")
        cores = core_sets(int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else world)
        self.threads = cfg.threads or (len(cores[0]) if cores[0] else 1)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        device = torch.device(f"cuda:{0}" if cfg.device.startswith("cuda") else "cpu")
        shm = ShmComm(0, world) if self.backend == "shm" else None
        store_path = os.path.join(self._dir, "store")
        try:
            if launched is not None:  # torchrun started the other ranks
                store_path = None
            else:
                for r in range(1, world):
                    self.procs.append(self._spawn(cfg, r, cores[r], store_path, shm.path if shm else None))
            self.comm = shm if shm is not None else connect(self.backend, 0, world, store_path, None, device)[1]
        except Exception:
            self.close()
            raise
        self._watch = threading.Thread(target=self._watchdog, name="inferd-tp-watchdog", daemon=True)
        self._watch.start()
        log.info("tensor parallel: %d ranks over %s, %d thread(s) each%s", world, self.backend, self.threads,
                 "" if cores[0] else " (fewer cores than ranks: not pinned)")

    def _spawn(self, cfg, rank: int, cpus, store_path: str, shm_path: str | None) -> subprocess.Popen:
        spec = {"cfg": cfg, "rank": rank, "world": self.world, "backend": self.backend, "store": store_path,
                "shm": shm_path, "cpus": cpus, "threads": self.threads, "parent": os.getpid(),
                "log_level": logging.getLogger().getEffectiveLevel()}
        env = dict(os.environ)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch loads in the worker
            env[k] = str(self.threads)
        p = subprocess.Popen([sys.executable, "-m", "inferd.distributed.tp_worker"], stdin=subprocess.PIPE, env=env)
        p.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        p.stdin.close()
        return p

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
            for r, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._closing:
                    self.failed = f"tensor-parallel rank {r} exited with {code}"
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
        if comm is not None and self.failed is None and all(p.poll() is None for p in self.procs):
            try:
                comm.send_obj(None)  # the workers' loop ends
            except Exception:  # noqa: BLE001 - a rank is already gone
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        watch = getattr(self, "_watch", None)
        if watch is not None and watch is not threading.current_thread():
            # joined, not left as a daemon: one still running when the interpreter exits is torn
            # down mid-call, and that aborted the process ("terminate called without an active
            # exception") in about one test run in three
            watch.join(5)
        if comm is not None:
            comm.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        torch.set_num_threads(self._threads_before)

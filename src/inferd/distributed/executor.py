"""Who starts tensor-parallel ranks 1..N-1 and watches them: one small interface, two executors.

- `MpExecutor` (`--distributed-executor-backend mp`, the default): processes on this host
  (`python -m inferd.distributed.tp_worker`, the spec pickled on standard input), each pinned to
  its own cores.
- `RayExecutor` (`ray`, in `inferd.distributed.ray_executor`): Ray actors in a placement group,
  on whichever nodes of the cluster Ray picks.

Both run the same worker loop (`tp_worker.serve(spec)`); the group (rank 0) only asks them where
each rank landed (to pick the collective backend and the interface gloo binds), to start the
ranks, whether one has died, and to stop them.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Placement:
    """Where rank r runs: `node` names the machine (ranks on rank 0's node share memory), `ip` is the
    address gloo binds there, `cpus` the cores it may use (None: not pinned), `threads` its OpenMP
    threads."""
    node: str
    ip: str
    cpus: list[int] | None
    threads: int


def core_sets(world: int, cpus: list[int] | None = None) -> list[list[int] | None]:
    """Disjoint cores for each rank (their OpenMP workers must not preempt each other at every
    barrier); None for every rank when there are fewer cores than ranks."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    per = len(cpus) // world
    if per == 0:
        return [None] * world
    return [cpus[r * per:(r + 1) * per] for r in range(world)]


class Executor:
    placements: list[Placement]  # rank 0's first

    def start(self, specs: dict[int, dict]) -> None:
        """Start rank r (r >= 1) with specs[r]."""
        raise NotImplementedError

    def dead(self) -> str | None:
        """A line naming the first rank that has stopped, else None."""
        raise NotImplementedError

    def stop(self, timeout: float = 10) -> None:
        """Wait up to `timeout` for the ranks to end (rank 0 has told them), then kill what is left."""
        raise NotImplementedError


class MpExecutor(Executor):
    """Ranks as processes started with `subprocess`, not multiprocessing: an engine core process is
    itself a daemonic child, which multiprocessing forbids to have children."""

    def __init__(self, world: int, threads: int | None, local_world: int | None = None):
        cores = core_sets(local_world or world)
        self.threads = threads or (len(cores[0]) if cores[0] else 1)
        self.pinned = cores[0] is not None
        self.placements = [Placement("local", "127.0.0.1", cores[r] if r < len(cores) else None, self.threads)
                           for r in range(world)]
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, specs: dict[int, dict]) -> None:
        env = dict(os.environ)
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before torch loads in the worker
            env[k] = str(self.threads)
        for r, spec in specs.items():
            p = subprocess.Popen([sys.executable, "-m", "inferd.distributed.tp_worker"], stdin=subprocess.PIPE, env=env)
            p.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
            p.stdin.close()
            self.procs[r] = p

    def dead(self) -> str | None:
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return f"tensor-parallel rank {r} exited with {code}"
        return None

    def stop(self, timeout: float = 10) -> None:
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

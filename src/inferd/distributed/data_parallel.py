"""`inferd serve --data-parallel-size N`: N engine replicas behind one engine client.

Each replica is an engine client of its own (today an `EngineCoreClient`: its own process, model copy
and KV pool), started by the function the caller hands in, on its own share of the cores; the group
picks one per request with `Balancer` (inferd.distributed.policy, shared with the router) over token
ids (one chunk = one KV block, so "prefix affinity" means "the engine that already holds these
blocks"), loads being each engine's open requests, known here without asking.

One engine dying is unrecoverable for that engine (its requests end with the engine-process error
at once). The server then stops taking requests (/health 503, new requests 503), lets the other
engines' open requests finish, and exits non-zero. Why not go on with the survivors: a server
that silently serves at 1/N of its capacity with /health green hides the fault from the
supervisor that would restart it, and from the router in front that would route around it; a
clean exit is what both know how to handle (vLLM's DP engines fail together the same way).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from inferd.distributed.policy import Balancer
from inferd.errors import EngineDead, InferdError

log = logging.getLogger("inferd")


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """`n` disjoint, contiguous shares of `cores`, as equal as they can be; with fewer cores than
    engines, engines share cores round-robin (said in a warning by the caller)."""
    if n <= len(cores):
        base, extra = divmod(len(cores), n)
        out, at = [], 0
        for i in range(n):
            k = base + (1 if i < extra else 0)
            out.append(cores[at:at + k])
            at += k
        return out
    return [[cores[i % len(cores)]] for i in range(n)]


class EngineGroup:
    """The EngineClient (inferd.engine.client) of N replicas. `start(i, cpus, on_step=, on_finish=,
    on_fault=)` starts replica i pinned to `cpus` and returns its client: the group never knows
    what a replica is (a process here; an actor elsewhere)."""

    def __init__(self, start: Callable, size: int, max_waiting: int = 512, on_step=None, on_finish=None,
                 on_fault=None, policy: str = "prefix"):
        if size < 1:
            raise InferdError("--data-parallel-size must be >= 1")
        cores = sorted(os.sched_getaffinity(0))
        shares = split_cores(cores, size)
        if size > len(cores):
            log.warning("--data-parallel-size %d on %d cores: engines share cores", size, len(cores))
        self.dead: str | None = None
        self.on_fault = on_fault
        self.clients: list = [None] * size
        errors: list[BaseException] = []

        def start_one(i: int):
            try:
                self.clients[i] = start(
                    i, shares[i],
                    on_step=(lambda snap, i=i: on_step(snap, i)) if on_step else None,
                    on_finish=(lambda out, i=i: on_finish(out, i)) if on_finish else None,
                    on_fault=lambda reason, i=i: self._fault(i, reason))
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others stopped
                errors.append(e)

        threads = [threading.Thread(target=start_one, args=(i,)) for i in range(size)]
        for t in threads:  # the engines load their models at once
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.shutdown()
            raise errors[0]
        for i, c in enumerate(self.clients):
            log.info("engine %d: process %d on cores %s", i, c.info.pid, shares[i])
        self.info = self.clients[0].info
        self.max_waiting = max_waiting
        block = self.info.cache.get("block_size", 16)
        blocks = self.info.cache.get("num_blocks", 1 << 16)
        self.balancer = Balancer(range(size), policy, chunk=block, capacity=blocks)
        self.picks = [0] * size  # requests sent to each engine

    # -- EngineClient -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting for c in self.clients)

    @property
    def num_running(self) -> int:
        return sum(c.num_running for c in self.clients)

    def loads(self) -> dict[int, int]:
        return {i: c.open_requests() for i, c in enumerate(self.clients)}

    async def generate(self, prompt_ids: list[int], params, request_id: str, arrival: float | None = None,
                       kv_transfer_params: dict | None = None, lora: str | None = None):
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        live = [i for i, c in enumerate(self.clients) if not c.dead]
        pick = self.balancer.pick(prompt_ids, self.loads(), live)
        self.picks[pick.target] += 1
        async for out in self.clients[pick.target].generate(prompt_ids, params, request_id, arrival,
                                                            kv_transfer_params, lora):
            yield out

    async def control(self, op: str, **args):
        """The same command to every replica (each holds its own adapters); the first refusal is raised."""
        import asyncio

        results = await asyncio.gather(*(c.control(op, **args) for c in self.clients), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results[0]

    def abort(self, request_id: str):
        """Leaving generate() aborts on the replica that has it; this asks every live one."""
        for c in self.clients:
            if not c.dead:
                c.abort(request_id)

    async def state(self, steps: int) -> list[dict]:
        """Every engine's dashboard state, asked at once, each labelled with its replica."""
        import asyncio

        parts = await asyncio.gather(*(c.state(steps) for c in self.clients))
        return [{**st, "engine": i} for i, part in enumerate(parts) for st in part]

    def shutdown(self):
        threads = [threading.Thread(target=c.shutdown) for c in self.clients if c is not None]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def open_requests(self) -> int:
        return sum(c.open_requests() for c in self.clients if c is not None)

    def _fault(self, i: int, reason: str):
        if self.dead:
            return
        self.dead = f"engine {i}: {reason}"
        if self.on_fault:
            self.on_fault(self.dead)

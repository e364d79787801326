"""The engine client (inferd.engine.client.EngineClient) of a Ray Serve deployment of engine
replicas: what the OpenAI ingress holds instead of an engine process. The ingress runs the same
protocol code as `inferd serve` (inferd.server); only `generate` crosses to a replica, as a
streaming call of its deployment handle, and the request router picks the replica.

A replica that dies under a request ends that request with EngineDead (503, or an error event in a
stream); the ingress itself stays up, because Serve restarts the replica and the others go on.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

import ray

from inferd.engine.client import EngineDead, EngineInfo, Overloaded
from inferd.errors import InferdError

log = logging.getLogger("inferd")


def replica_error(e: BaseException) -> BaseException:
    """The error a request gets for what went wrong with its replica: the engine's own error when
    the replica raised one (Overloaded, a refused request), else EngineDead with one line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, (Overloaded, EngineDead, InferdError)):
        return cause
    text = str(e).strip().splitlines()
    return EngineDead(f"engine replica failed: {type(e).__name__}: {text[0] if text else ''}".rstrip(": "))


class RayEngineClient:
    def __init__(self, handle, info: EngineInfo, max_waiting: int = 512, on_finish=None):
        self.handle = handle
        self.stream = handle.options(stream=True)
        self.info = info
        self.dead: str | None = None  # replicas die and come back; the deployment as a whole does not
        self.max_waiting = max_waiting
        self.on_finish = on_finish
        self._open = 0
        self.failures = 0  # requests a replica failed under

    @property
    def num_waiting(self) -> int:
        return 0  # the replicas queue (and refuse past their own --max-waiting)

    @property
    def num_running(self) -> int:
        return self._open

    def open_requests(self) -> int:
        return self._open

    async def generate(self, prompt_ids: list[int], params, request_id: str, arrival: float | None = None,
                       kv_transfer_params: dict | None = None, lora: str | None = None) -> AsyncIterator:
        # `arrival` is this process's clock: the replica counts its latencies from its own add
        self._open += 1
        outs, done = None, False
        try:
            outs = self.stream.generate.remote(list(prompt_ids), params, request_id,
                                               kv_transfer_params=kv_transfer_params, lora=lora)
            async for batch in outs:  # a replica sends its outputs in lists (EngineReplica.generate)
                for out in batch:
                    if self.on_finish is not None and out.finished:
                        self.on_finish(out)
                    yield out
            done = True
        except (ray.exceptions.RayError, ray.serve.exceptions.RayServeException) as e:
            done = True
            self.failures += 1
            err = replica_error(e)
            log.warning("request %s: %s", request_id, err)
            raise err from None
        finally:
            if outs is not None and not done:  # the client left: the replica's call is cancelled,
                outs.cancel()                  # which aborts the request in its engine
            self._open -= 1

    def abort(self, request_id: str) -> None:
        pass  # leaving generate's iterator cancels the replica's call (above)

    async def control(self, op: str, **args):
        raise InferdError(f"{op} is not supported on a Ray Serve deployment: change the deployment's config")

    async def state(self, steps: int = 100) -> list[dict]:
        try:
            return await self.handle.state.remote(steps)
        except ray.exceptions.RayError as e:
            return [{"engine": 0, "dead": str(replica_error(e))}]

    def shutdown(self) -> None:
        pass

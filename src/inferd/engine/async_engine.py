"""AsyncLLM: the EngineClient (inferd.engine.client) of an engine on a thread of this process.

The engine is not thread-safe, so every call into it (add, abort, step) happens on the engine
thread: the event loop sends commands through a queue, and the engine thread hands each
RequestOutput back to the request's stream with `loop.call_soon_threadsafe`. The forward pass
therefore never blocks HTTP parsing, tokenization or SSE writing. `inferd serve --engine-in-process`
and the tests use it; the server's default is the engine in its own process (inferd.engine.core).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import TYPE_CHECKING, AsyncIterator

from inferd.engine.client import STATE_TIMEOUT_S, EngineDead, EngineInfo, Overloaded, Streams
from inferd.engine.request import RequestOutput, SamplingParams
from inferd.engine.state import STEP_HISTORY, read_state

if TYPE_CHECKING:
    from inferd.engine.interface import Engine

log = logging.getLogger("inferd")


class AsyncLLM:
    def __init__(self, engine: Engine, max_waiting: int = 512, on_step=None, on_finish=None):
        self.engine = engine
        self.info: EngineInfo = engine.info()
        self.max_waiting = max_waiting
        self.on_step = on_step  # called on the engine thread with an EngineSnapshot after every step (metrics)
        self.on_finish = on_finish  # called with each finished RequestOutput
        self._cmds: queue.Queue = queue.Queue()
        self._streams = Streams()
        self._pending_adds = 0
        self._stop = False
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg, **kw) -> AsyncLLM:
        """Load the model of `cfg` in this process and run its engine on a thread."""
        from inferd.engine.factory import make_engine

        return cls(make_engine(cfg), **kw)

    # -- EngineClient, on the event loop ----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def open_requests(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       arrival: float | None = None, kv_transfer_params: dict | None = None,
                       lora: str | None = None) -> AsyncIterator[RequestOutput]:
        # `arrival`: without it latencies would count from the engine thread's add, which waits for
        # the running step to end
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        if self.num_waiting >= self.max_waiting:
            raise Overloaded()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending_adds += 1
        self._streams.open(request_id)
        self._cmds.put(("add", (prompt_ids, params, request_id, arrival, kv_transfer_params, lora), (loop, fut)))
        try:
            await fut  # raises the engine's validation error, if any
        except BaseException:
            self._streams.close(request_id)
            raise
        async for out in self._streams.read(request_id, params, self.abort, lambda: self.dead):
            yield out

    def abort(self, request_id: str):
        self._cmds.put(("abort", request_id, None))

    async def state(self, steps: int = STEP_HISTORY) -> list[dict]:
        """Built on the engine thread between two steps: one engine, so a list of one."""
        if self.dead:
            return [{"engine": 0, "dead": self.dead}]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("state", steps, (loop, fut)))
        return [{"engine": 0, "pid": self.info.pid, **await asyncio.wait_for(fut, STATE_TIMEOUT_S)}]

    async def control(self, op: str, **args):
        """Engine.control on the engine thread, between two steps."""
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("control", (op, args), (loop, fut)))
        return await fut

    def shutdown(self):
        self._stop = True
        self._cmds.put(("stop", None, None))
        self._thread.join(timeout=10)
        self.engine.close()

    # -- engine thread --------------------------------------------------------------------------
    def _handle(self, cmd, arg, reply):
        if cmd == "add":
            loop, fut = reply
            self._pending_adds -= 1
            try:
                self.engine.add_request(*arg[:5], lora=arg[5])
                loop.call_soon_threadsafe(_settle, fut, None)
            except Exception as e:  # InferdError -> 400 in the server
                loop.call_soon_threadsafe(_settle, fut, e)
        elif cmd == "abort":
            self.engine.abort(arg)
        elif cmd == "control":
            loop, fut = reply
            try:
                loop.call_soon_threadsafe(_settle, fut, None, self.engine.control(arg[0], **arg[1]))
            except Exception as e:  # noqa: BLE001 - the refusal is the caller's answer
                loop.call_soon_threadsafe(_settle, fut, e)
        elif cmd == "state":
            loop, fut = reply
            loop.call_soon_threadsafe(_settle, fut, None, read_state(self.engine, arg))

    def _deliver(self, outs):
        for out in outs:
            # accounted before the client can see the end: whoever awaits the stream's last output
            # then reads counters (a group's finished counts, metrics) that already include it
            if out.finished and self.on_finish:
                self.on_finish(out)
            self._streams.put_threadsafe(out.request_id, out)

    def _run(self):
        eng = self.engine
        try:
            while not self._stop:
                try:  # idle: sleep until a command comes; busy: just drain what is there
                    if eng.has_unfinished():
                        cmd, arg, reply = self._cmds.get_nowait()
                    else:
                        cmd, arg, reply = self._cmds.get(timeout=0.5)
                except queue.Empty:
                    cmd = None
                handled = False
                while cmd is not None:
                    if cmd == "stop":
                        return
                    self._handle(cmd, arg, reply)
                    handled = True
                    try:
                        cmd, arg, reply = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                handled = eng.housekeeping() or handled
                if not eng.has_unfinished():
                    if handled:  # an abort or a freed lease on an idle engine shows in the gauges
                        self._deliver(eng.take_aborted())
                        if self.on_step:
                            self.on_step(eng.snapshot())
                    continue
                self._deliver(eng.step())
                if self.on_step:
                    self.on_step(eng.snapshot())
        except Exception as e:  # a bug in a step: fail every open stream rather than hang them
            log.exception("engine loop died")
            self.dead = f"{type(e).__name__}: {e}"
            self._streams.fail_all(EngineDead(f"engine stopped: {self.dead}"), threadsafe=True)


def _settle(fut: asyncio.Future, err, value=None):
    if fut.done():
        return
    if err is None:
        fut.set_result(value)
    else:
        fut.set_exception(err)

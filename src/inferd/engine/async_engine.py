"""AsyncLLM: the engine in its own thread, behind a message boundary the asyncio server can await.

The engine is not thread-safe, so every call into it (add, abort, step) happens on the engine
thread: the event loop sends commands through a queue, and the engine thread hands each
RequestOutput back to the request's asyncio.Queue with `loop.call_soon_threadsafe`. The forward
pass therefore never blocks HTTP parsing, tokenization or SSE writing.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, AsyncIterator

from inferd.engine.request import RequestOutput, SamplingParams
from inferd.engine.state import STEP_HISTORY, read_state

if TYPE_CHECKING:  # the API process never loads torch: the engine runs in its own process
    from inferd.engine.engine import LLMEngine

log = logging.getLogger("inferd")


STATE_TIMEOUT_S = 10.0  # a state query waits for the running step; a longer wait means a stuck engine


class Overloaded(Exception):
    """More requests waiting than --max-waiting: the caller answers 503."""


class EngineDead(RuntimeError):
    """The engine cannot go on (its loop raised, or its process died): every request fails with 503."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting: int = 512, on_step=None, on_finish=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step  # called on the engine thread with an EngineSnapshot after every step (metrics)
        self.on_finish = on_finish  # called with each finished RequestOutput
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_adds = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()
        self.dead: str | None = None

    # -- event-loop side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending_adds

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       arrival: float | None = None,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (all n samples) until every sample finished.
        Leaving the iterator early (client gone) aborts the request. `arrival` (time.monotonic())
        is when the request reached the server; its latencies count from there. Without it they
        would count from the engine thread's add, which waits for the running step to end."""
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        if self.num_waiting >= self.max_waiting:
            raise Overloaded()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = loop.create_future()
        self._pending_adds += 1
        self._streams[request_id] = (loop, q)
        self._cmds.put(("add", (prompt_ids, params, request_id, arrival, kv_transfer_params), (loop, fut)))
        try:
            await fut  # raises the engine's validation error, if any
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in outputs_until_done(self, q, request_id, params):
            yield out

    def abort(self, request_id: str):
        self._cmds.put(("abort", request_id, None))

    async def state(self, steps: int = STEP_HISTORY) -> list[dict]:
        """The engine's dashboard state (inferd.engine.state), built on the engine thread between
        two steps: one engine, so a list of one."""
        if self.dead:
            return [{"engine": 0, "dead": self.dead}]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("state", steps, (loop, fut)))
        return [{"engine": 0, "pid": os.getpid(), **await asyncio.wait_for(fut, STATE_TIMEOUT_S)}]

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
                self.engine.add_request(*arg)
                loop.call_soon_threadsafe(_settle, fut, None)
            except Exception as e:  # InferdError -> 400 in the server
                loop.call_soon_threadsafe(_settle, fut, e)
        elif cmd == "abort":
            self.engine.abort(arg)
        elif cmd == "state":
            loop, fut = reply
            loop.call_soon_threadsafe(_resolve, fut, read_state(self.engine, arg))

    def _deliver(self, outs):
        for out in outs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, out)
            if out.finished and self.on_finish:
                self.on_finish(out)

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
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDead(f"engine stopped: {self.dead}"))


async def outputs_until_done(client, q: asyncio.Queue, request_id: str, params) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until all its samples finished; an exception put on the
    queue (a failed add, a dead engine) is raised. Leaving early aborts the request through
    `client` (AsyncLLM or the engine-process client), unless its engine is already dead."""
    k = params.best_of or params.n
    done = 0
    finished = False
    try:
        while done < k:
            out = await q.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                done += 1
            yield out
        finished = True
    finally:
        client._streams.pop(request_id, None)
        if not finished and not client.dead:
            client.abort(request_id)


def _resolve(fut: asyncio.Future, value):
    if not fut.done():
        fut.set_result(value)


def _settle(fut: asyncio.Future, err):
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)

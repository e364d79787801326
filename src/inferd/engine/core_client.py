"""EngineCoreClient: the EngineClient (inferd.engine.client) of an engine core in its own process
(inferd.engine.core), as the API process sees it.

It keeps what is cheap and per request on this side (the tokenizer, HTTP, SSE) and talks to the
core in messages (inferd.engine.messages). If the core dies (an exception in a step, a kill, an
OOM) the client marks itself dead, fails every open stream with the reason and calls `on_fault`,
which the server uses to answer /health with 503 and exit non-zero.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import select
import threading

from inferd.distributed import tmpdirs
from inferd.engine.client import STATE_TIMEOUT_S, EngineDead, EngineInfo, Overloaded, Streams
from inferd.engine.messages import (Abort, AddFailed, AddRequest, Control, ControlReply, Fault, Shutdown, StateQuery,
                                    StateReply, StepOutputs)
from inferd.engine.state import STEP_HISTORY
from inferd.errors import InferdError

log = logging.getLogger("inferd")


class EngineCoreClient:
    """Its outputs are the in-process engine's, minus the cumulative `output_ids` (None here:
    `num_output_tokens` counts them), and a finished output's timings are whole."""

    def __init__(self, cfg, max_waiting: int = 512, on_step=None, on_finish=None, on_fault=None,
                 start_timeout: float = 600, cpus: list[int] | None = None, name: str = "inferd-engine-core"):
        import multiprocessing as mp

        import zmq

        from inferd.engine.core import run_core

        self.max_waiting = max_waiting
        self.on_step, self.on_finish, self.on_fault = on_step, on_finish, on_fault
        self.dead: str | None = None
        self._streams = Streams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting = self._running = 0
        self._adds_sent = self._adds_seen = 0
        self._state_waits: dict[int, asyncio.Future] = {}
        self._state_seq = 0
        self._lock = threading.Lock()
        self.proc = None
        self._dir = tmpdirs.make("core")  # the two sockets' private directory (see distributed.tmpdirs)
        to_core, from_core = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        try:
            try:
                self._push.bind(to_core)
                self._pull.bind(from_core)
            except zmq.ZMQError as e:  # a TMPDIR too long for a unix socket's path, say
                raise InferdError(f"cannot bind the engine's socket in {self._dir}: {e} (set TMPDIR to a shorter "
                                  "directory)") from None
            # spawn, not fork: forking after torch/OpenMP started can deadlock the child
            level = logging.getLogger().getEffectiveLevel()
            self.proc = mp.get_context("spawn").Process(target=run_core,
                                                        args=(cfg, to_core, from_core, cfg.threads, level, cpus),
                                                        name=name, daemon=True)
            self.proc.start()
            ready = self._wait_ready(start_timeout)
            if isinstance(ready, Fault):
                self.proc.join(10)
                raise InferdError(f"the engine process failed to start: {ready.reason}")
            from inferd.tokenizer import Tokenizer

            tok = Tokenizer.load(ready.tokenizer_path) if ready.tokenizer_path else None
        except BaseException:  # a failed or interrupted start (Ctrl-C, SIGTERM while loading) leaves nothing
            self._abandon()
            raise
        from dataclasses import replace

        log.info("engine core: process %d", ready.info.pid)
        self.info: EngineInfo = replace(ready.info, tokenizer=tok)
        self._send_lock = threading.Lock()
        self._watch = threading.Thread(target=self._watchdog, name="inferd-core-watchdog", daemon=True)
        self._watch.start()

    def _abandon(self):
        """Undo a start that did not finish: the core process, the sockets, their directory. The
        core ignores SIGTERM (run_core: the server decides when it stops), so it is killed."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        tmpdirs.remove(self._dir)

    def _wait_ready(self, timeout: float):
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        waited = 0.0
        while waited < timeout:
            if poller.poll(500):
                return pickle.loads(self._pull.recv())
            waited += 0.5
            if not self.proc.is_alive():
                raise InferdError(f"the engine process exited with {self.proc.exitcode} while loading the model")
        raise InferdError(f"the engine process did not load the model within {timeout:.0f} s")

    def _send(self, msg):
        """Never blocks on a dead core: a PUSH socket whose peer is gone blocks every send, and this
        runs on the server's event loop (a request routed to an engine in the instant after it was
        killed hung the whole server). A full queue to a live core is waited out in 5 ms steps."""
        import zmq

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            while True:
                try:
                    self._push.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    # the sentinel turns readable when the process exits (and, unlike is_alive(), reaps
                    # nothing: the watchdog's join keeps its exit code)
                    if self.dead or select.select([self.proc.sentinel], [], [], 0.005)[0]:
                        raise EngineDead(f"engine stopped: {self.dead or 'the engine process exited'}") from None

    # -- EngineClient, on the event loop ----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._waiting + self._adds_sent - self._adds_seen

    @property
    def num_running(self) -> int:
        return self._running

    def open_requests(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_ids: list[int], params, request_id: str, arrival: float | None = None,
                       kv_transfer_params: dict | None = None, lora: str | None = None):
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        if self.num_waiting >= self.max_waiting:
            raise Overloaded()
        self._attach(asyncio.get_running_loop())
        self._send(AddRequest(request_id, prompt_ids, params, arrival, kv_transfer_params, lora))
        # opened after the send (nothing can arrive for it before this loop runs again), so a
        # send refused by a dead engine leaves no stream behind
        self._streams.open(request_id)
        self._adds_sent += 1
        async for out in self._streams.read(request_id, params, self.abort, lambda: self.dead):
            yield out

    def abort(self, request_id: str):
        if not self.dead:
            try:
                self._send(Abort(request_id))
            except EngineDead:  # it died meanwhile: nothing left to abort
                pass

    async def _ask(self, make, timeout: float | None = None):
        """Send make(seq) and wait for the core's answer to it (a StateReply's state, a ControlReply),
        or {"dead": reason} when the core died meanwhile."""
        loop = asyncio.get_running_loop()
        self._attach(loop)
        self._state_seq += 1
        seq = self._state_seq
        fut = loop.create_future()
        self._state_waits[seq] = fut
        try:
            self._send(make(seq))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._state_waits.pop(seq, None)

    async def state(self, steps: int = STEP_HISTORY) -> list[dict]:
        """The core's dashboard state, asked over the pipe and answered between two of its steps."""
        if self.dead:
            return [{"engine": 0, "dead": self.dead}]
        try:
            st = await self._ask(lambda seq: StateQuery(seq, steps), STATE_TIMEOUT_S)
        except EngineDead as e:
            return [{"engine": 0, "dead": str(e)}]
        return [{"engine": 0, **st}]

    async def control(self, op: str, **args):
        """An operator's command to the core (LLMEngine.control), answered between two steps; its
        refusal (InferdError) is raised here."""
        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        reply = await self._ask(lambda seq: Control(seq, op, args))
        if isinstance(reply, dict):  # {"dead": reason}
            raise EngineDead(f"engine stopped: {reply.get('dead')}")
        if reply.error is not None:
            raise reply.error
        return reply.result

    def shutdown(self):
        import zmq

        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():  # deaf to the message and to SIGTERM (which it ignores)
                self.proc.kill()
                self.proc.join(5)
        # the core is gone: its sockets' files can go now, while the sockets close on their loop
        tmpdirs.remove(self._dir)
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or loop.is_closed() or on_loop:
            self._close_sockets()
            return
        try:  # the reader is the loop's to remove: a server that unloads a model goes on running
            loop.call_soon_threadsafe(self._close_sockets)
        except RuntimeError:  # the loop closed meanwhile (the server is exiting)
            self._push.close(linger=0)

    def _close_sockets(self):
        """Stop watching the core's socket and free both sockets and their context (a server that
        loads and unloads models must not keep a reader, descriptors or a client per load)."""
        import zmq

        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._pull.getsockopt(zmq.FD))
            except (RuntimeError, zmq.ZMQError):
                pass
        self._loop = None
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    # -- receiving, on the event loop -------------------------------------------------------------
    # No receiver thread: the socket's file descriptor is watched by the event loop itself, so a
    # step's outputs wake one thread of this process (not a thread, then the loop through
    # call_soon_threadsafe); on two cores every wake-up preempts one of the engine's workers.
    def _attach(self, loop: asyncio.AbstractEventLoop):
        import zmq

        if loop is self._loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._pull.getsockopt(zmq.FD))
        self._loop = loop
        loop.add_reader(self._pull.getsockopt(zmq.FD), self._drain)
        loop.call_soon(self._drain)  # what came before the loop watched (the fd is edge-triggered)

    def _drain(self):
        import zmq

        try:
            while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._handle(pickle.loads(self._pull.recv(zmq.NOBLOCK)))
        except zmq.ZMQError:  # closed at shutdown
            pass

    def _handle(self, msg):
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                if out.finished and self.on_finish:  # accounted first, as AsyncLLM does
                    self.on_finish(out)
                self._streams.put(out.request_id, out)
            snap = msg.snapshot
            self._adds_seen = msg.adds_seen
            if snap is not None:
                self._waiting, self._running = snap.waiting, snap.running
                if self.on_step:
                    self.on_step(snap)
        elif isinstance(msg, StateReply):
            fut = self._state_waits.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg.state)
        elif isinstance(msg, ControlReply):
            fut = self._state_waits.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, AddFailed):
            self._streams.put(msg.request_id, msg.error)
        elif isinstance(msg, Fault):
            self._fail(msg.reason)

    def _watchdog(self):
        self.proc.join()  # returns when the core exits, however it exits
        if self.dead or self.proc.exitcode in (0, None):
            return
        reason = f"the engine process exited with {self.proc.exitcode}"
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:  # on the loop: a Fault the core sent before it died is read first, with its reason
                loop.call_soon_threadsafe(self._drain_then_fail, reason)
                return
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._drain_then_fail(reason)

    def _drain_then_fail(self, reason: str):
        self._drain()
        self._fail(reason)

    def _fail(self, reason: str):
        with self._lock:
            if self.dead:
                return
            self.dead = reason
        log.error("engine core failed: %s", reason)
        self._streams.fail_all(EngineDead(f"engine stopped: {reason}"))
        for fut in list(self._state_waits.values()):
            if not fut.done():
                fut.set_result({"dead": reason})
        if self.on_fault:
            self.on_fault(reason)

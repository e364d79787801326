"""The engine core in its own process, behind typed messages over ZeroMQ.

Why: in one process the asyncio server (HTTP, tokenizing, SSE) and the engine loop share one
interpreter lock, and on two cores a waiting thread costs the engine's OpenMP workers their core.
vLLM v1 moved its engine loop into a separate EngineCore process for the same reason, and replicas,
disaggregated prefill/decode and tensor parallelism all need the engine behind a message boundary.

The API process (`EngineCoreClient`) keeps what is cheap and per request (templates, tokenizing,
HTTP, SSE); the core process (`run_core`) owns the model, the KV cache and the scheduler and runs
`LLMEngine.step()` in a loop. Two ZeroMQ PUSH/PULL pipes over ipc:// sockets carry the messages
below, pickled (dataclasses as they are: RequestOutput and its timings cross unchanged, and
time.monotonic() is one clock for every process on Linux). One message per engine step carries all
of that step's outputs and the engine's gauges, so a busy step costs one send, not one per token.

Faults are defined once here: if the core dies (any exception in a step, a kill, an OOM) the client
marks itself dead, fails every open stream with the reason, and calls `on_fault`, which the server
uses to answer /health with 503 and exit non-zero.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import tempfile
import threading
import uuid
from dataclasses import dataclass, field

from inferd.engine.state import STEP_HISTORY
from inferd.errors import InferdError

log = logging.getLogger("inferd")


# -- messages ------------------------------------------------------------------------------------

@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    arrival: float | None
    kv_transfer_params: dict | None = None


@dataclass
class Abort:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class StateQuery:
    """Asks for the engine's dashboard state (inferd.engine.state); answered between two steps."""
    seq: int
    steps: int = STEP_HISTORY


@dataclass
class StateReply:
    seq: int
    state: dict


@dataclass
class Ready:
    """The core loaded its model: what the API process needs to know about it."""
    pid: int
    model_name: str
    tokenizer_path: str | None
    max_model_len: int
    vocab_size: int
    speculative: bool
    cache_info: dict = field(default_factory=dict)  # LLMEngine.cache_info()


@dataclass
class AddFailed:
    request_id: str
    error: BaseException  # the engine's validation error (InferdError: a 400)


@dataclass
class StepOutputs:
    outputs: list = field(default_factory=list)  # RequestOutput, this step's
    snapshot: object = None  # EngineSnapshot after the step
    adds_seen: int = 0  # AddRequests the core has taken so far (the rest are still in the pipe)


@dataclass
class Fault:
    """The core cannot go on: every open request fails, and the server exits."""
    reason: str


# -- the core process ----------------------------------------------------------------------------

def run_core(cfg, to_core: str, from_core: str, threads: int | None, log_level: int = logging.INFO,
             cpus: list[int] | None = None):
    """The core process's main (started with `spawn`): build the engine, then serve messages.
    `cpus`: the cores this engine is pinned to (data parallelism: replicas must not share cores,
    or their OpenMP workers preempt each other at every barrier)."""
    import signal
    import sys

    # The server decides when the core stops (after draining, on a Shutdown message); a SIGINT or
    # SIGTERM sent to the whole process group must not kill it under the open requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
        threads = threads or len(cpus)
    if threads:  # before torch loads, so OpenMP starts with this many workers
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[k] = str(threads)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(to_core)
    push = ctx.socket(zmq.PUSH)
    push.connect(from_core)

    def send(msg):
        push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from inferd.engine.engine import LLMEngine
        from inferd.gguf_file import default_model_path

        engine = LLMEngine(cfg)
        src = engine.loaded.source
        tok_path = src.path if src.kind != "builtin" else (default_model_path() if engine.tokenizer else None)
        send(Ready(os.getpid(), src.name, tok_path if engine.tokenizer else None, engine.max_model_len,
                   engine.model_config.vocab_size, engine.spec is not None, engine.cache_info()))
        try:
            _serve(engine, pull, send, os.getppid())
        finally:
            engine.close()
    except Exception as e:  # the engine cannot go on: say why, then exit non-zero
        from inferd.engine.parallel.comm import CollectiveError

        one_line = isinstance(e, (InferdError, CollectiveError))  # the reason is the whole story
        if not one_line:  # a user-facing error is the API process's one line
            log.exception("engine core died")
        try:
            send(Fault(str(e) if one_line else f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        raise SystemExit(1)
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()


def _serve(engine, pull, send, parent: int):
    import zmq

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    adds = 0
    while True:
        # idle: wait for a message; busy: take what is there and step
        timeout = 0 if engine.has_unfinished() else 500
        if os.getppid() != parent:  # the server is gone (killed): nothing to serve
            return
        handled = False
        while poller.poll(timeout):
            msg = pickle.loads(pull.recv())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequest):
                adds += 1
                try:
                    engine.add_request(msg.prompt_ids, msg.params, msg.request_id, msg.arrival,
                                       msg.kv_transfer_params)
                except Exception as e:  # InferdError: the client's 400
                    send(AddFailed(msg.request_id, e))
            elif isinstance(msg, Abort):
                engine.abort(msg.request_id)
            elif isinstance(msg, StateQuery):  # changes nothing: no gauges to send after it
                from inferd.engine.state import read_state

                send(StateReply(msg.seq, {"pid": os.getpid(), **read_state(engine, msg.steps)}))
                timeout = 0
                continue
            handled = True
            timeout = 0
        if engine.has_unfinished():
            send(StepOutputs([_slim(o) for o in engine.step()], engine.snapshot(), adds))
        elif engine.housekeeping() or handled:  # an abort or a freed lease on an idle engine shows in the gauges
            send(StepOutputs([_slim(o) for o in engine.take_aborted()], engine.snapshot(), adds))


def _slim(out):
    """What crosses the boundary of one output: the step's delta. The cumulative ids and text, and
    the timings before the finish, would make every message grow with the sequence (quadratic in
    its length); the client rebuilds them."""
    from dataclasses import replace

    if out.finish_reason == "abort":  # once, and nobody streams it: the whole count is what the metrics need
        return replace(out, text="")
    return replace(out, output_ids=None, text="", timings=out.timings if out.finished else None)


# -- the API process's side ----------------------------------------------------------------------

class EngineView:
    """What the server reads of the engine when the engine is in another process."""

    def __init__(self, ready: Ready, tokenizer):
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.model_name = ready.model_name
        self.model_config = SimpleNamespace(vocab_size=ready.vocab_size)
        self.speculative = ready.speculative
        self._cache_info = ready.cache_info
        self.pid = ready.pid

    def cache_info(self) -> dict:
        return self._cache_info


class EngineCoreClient:
    """AsyncLLM's interface (generate, abort, shutdown, dead, num_waiting) over a core process.

    Its RequestOutputs carry the same ids as the in-process engine's; `text` (the whole text so far)
    is filled on the finishing output only, as joining it every step would cost O(length) a token."""

    def __init__(self, cfg, max_waiting: int = 512, on_step=None, on_finish=None, on_fault=None,
                 start_timeout: float = 600, cpus: list[int] | None = None, name: str = "inferd-engine-core"):
        import multiprocessing as mp

        import zmq

        from inferd.errors import InferdError

        self.max_waiting = max_waiting
        self.on_step, self.on_finish, self.on_fault = on_step, on_finish, on_fault
        self.dead: str | None = None
        # request id -> (its queue, {sample index: (output ids so far, [text so far])})
        self._streams: dict[str, tuple[asyncio.Queue, dict]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting = self._running = 0
        self._adds_sent = self._adds_seen = 0
        self._state_waits: dict[int, asyncio.Future] = {}
        self._state_seq = 0
        self._lock = threading.Lock()
        base = os.path.join(tempfile.gettempdir(), f"inferd-core-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        to_core, from_core = f"ipc://{base}-in", f"ipc://{base}-out"
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(to_core)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(from_core)
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

        log.info("engine core: process %d", ready.pid)
        tok = Tokenizer.load(ready.tokenizer_path) if ready.tokenizer_path else None
        self.engine = EngineView(ready, tok)
        self._send_lock = threading.Lock()
        self._watch = threading.Thread(target=self._watchdog, name="inferd-core-watchdog", daemon=True)
        self._watch.start()

    def _wait_ready(self, timeout: float):
        import zmq

        from inferd.errors import InferdError

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
                        from inferd.engine.async_engine import EngineDead

                        raise EngineDead(f"engine stopped: {self.dead or 'the engine process exited'}") from None

    # -- event-loop side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._waiting + self._adds_sent - self._adds_seen

    @property
    def num_running(self) -> int:
        return self._running

    def open_requests(self) -> int:
        """Requests whose streams are open (sent, not finished or aborted yet)."""
        return len(self._streams)

    async def generate(self, prompt_ids: list[int], params, request_id: str, arrival: float | None = None,
                       kv_transfer_params: dict | None = None):
        from inferd.engine.async_engine import EngineDead, Overloaded, outputs_until_done

        if self.dead:
            raise EngineDead(f"engine stopped: {self.dead}")
        if self.num_waiting >= self.max_waiting:
            raise Overloaded()
        self._attach(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        self._send(AddRequest(request_id, prompt_ids, params, arrival, kv_transfer_params))
        # registered after the send (nothing can arrive for it before this loop runs again), so a
        # send refused by a dead engine leaves no stream behind
        self._streams[request_id] = (q, {})
        self._adds_sent += 1
        async for out in outputs_until_done(self, q, request_id, params):
            yield out

    def abort(self, request_id: str):
        from inferd.engine.async_engine import EngineDead

        if not self.dead:
            try:
                self._send(Abort(request_id))
            except EngineDead:  # it died meanwhile: nothing left to abort
                pass

    async def state(self, steps: int = STEP_HISTORY, engine: int = 0) -> list[dict]:
        """The core's dashboard state, asked over the pipe and answered between two of its steps."""
        from inferd.engine.async_engine import STATE_TIMEOUT_S, EngineDead

        if self.dead:
            return [{"engine": engine, "dead": self.dead}]
        loop = asyncio.get_running_loop()
        self._attach(loop)
        self._state_seq += 1
        seq = self._state_seq
        fut = loop.create_future()
        self._state_waits[seq] = fut
        try:
            self._send(StateQuery(seq, steps))
            st = await asyncio.wait_for(fut, STATE_TIMEOUT_S)
        except EngineDead as e:
            return [{"engine": engine, "dead": str(e)}]
        finally:
            self._state_waits.pop(seq, None)
        return [{"engine": engine, **st}]

    def shutdown(self):
        import zmq

        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._pull.getsockopt(zmq.FD))
            except RuntimeError:  # called from another thread while the loop runs: it stops anyway
                pass
        self._push.close(linger=0)

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

    def _deliver(self, request_id: str, item):
        target = self._streams.get(request_id)
        if target is not None:
            target[0].put_nowait(item)

    def _handle(self, msg):
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    ids, text = target[1].setdefault(out.index, ([], []))
                    ids.extend(out.new_token_ids)
                    text.append(out.text_delta)
                    out.output_ids, out.text = ids, "".join(text) if out.finished else ""
                    target[0].put_nowait(out)
                if out.finished and self.on_finish:
                    if out.output_ids is None:  # its stream is gone (aborted): count what the metrics need
                        out.output_ids = []
                    self.on_finish(out)
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
        elif isinstance(msg, AddFailed):
            self._deliver(msg.request_id, msg.error)
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
        from inferd.engine.async_engine import EngineDead

        log.error("engine core failed: %s", reason)
        for q, _ in list(self._streams.values()):
            q.put_nowait(EngineDead(f"engine stopped: {reason}"))
        for fut in list(self._state_waits.values()):
            if not fut.done():
                fut.set_result({"dead": reason})
        if self.on_fault:
            self.on_fault(reason)

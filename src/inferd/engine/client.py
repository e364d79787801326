"""The one interface a server has to an engine: `EngineClient`, and what it raises.

Three classes implement it: `AsyncLLM` (the engine on a thread of this process), `EngineCoreClient`
(the engine core in its own process) and `inferd.distributed.data_parallel.EngineGroup` (N core
processes behind one client). The server holds an `EngineClient` and never knows which: it submits
token ids with `generate`, reads the outputs as they come, aborts by leaving the iterator early, and
learns what it serves from `info`. Nothing here loads torch or reaches into the engine's internals.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, runtime_checkable

from inferd.engine.state import STEP_HISTORY
from inferd.errors import EngineDead, Overloaded  # noqa: F401  (re-exported: the client's errors)

if TYPE_CHECKING:
    from inferd.engine.request import RequestOutput, SamplingParams

STATE_TIMEOUT_S = 10.0  # a state query waits for the running step; a longer wait means a stuck engine


@dataclass
class EngineInfo:
    """What a client knows of its engine once the model is loaded: the same whichever process the
    engine runs in."""
    model_name: str
    tokenizer: object | None  # inferd.tokenizer.Tokenizer, or None for a model without one
    max_model_len: int
    vocab_size: int
    speculative: bool
    pid: int
    cache: dict = field(default_factory=dict)  # LLMEngine.cache_info(): block size, blocks, dtype
    # what a prompt may hold besides token ids: every family inferd serves today reads text only;
    # the server refuses a chat's image or audio parts until a model here takes them
    modalities: tuple[str, ...] = ("text",)
    architecture: str = ""  # the model's family (ModelConfig.architecture): what APIs that describe a model tell
    model_path: str | None = None  # the file or folder the weights came from (None: built in)
    # generate, or pooling (embeddings: inferd.engine.pooling) with the model's pooling: mode,
    # normalize and dimensions (the vector's length)
    runner: str = "generate"
    pooling: dict | None = None
    # how the load went (inferd.loading.report): seconds, peak resident memory, weights held, the
    # layers left dense for want of a kernel, by GGUF type
    load: dict = field(default_factory=dict)


@runtime_checkable
class EngineClient(Protocol):
    info: EngineInfo
    dead: str | None  # why the engine stopped, once it has: every call then raises EngineDead
    max_waiting: int

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def open_requests(self) -> int:
        """Requests whose streams are open (sent, not finished or aborted yet)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 arrival: float | None = None, kv_transfer_params: dict | None = None,
                 lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (all its samples) until every sample finished.
        Leaving the iterator early (client gone) aborts the request. `arrival` (time.monotonic())
        is when the request reached the server: its latencies count from there. Raises Overloaded
        past max_waiting, EngineDead once the engine stopped, InferdError for a request the engine
        refuses."""

    def abort(self, request_id: str) -> None: ...

    async def control(self, op: str, **args):
        """An operator's command to the engine(s) (LLMEngine.control: load_lora, unload_lora)."""

    async def state(self, steps: int = STEP_HISTORY) -> list[dict]:
        """Each engine's dashboard state (inferd.engine.state), one dict an engine."""

    def shutdown(self) -> None: ...


class Streams:
    """A client's open requests: request id -> the queue its outputs (or an exception) arrive on,
    with the event loop that reads it, so that an engine thread can deliver from outside it."""

    def __init__(self):
        self._open: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def open(self, request_id: str) -> None:
        self._open[request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def put(self, request_id: str, item) -> None:
        """On the event loop: one output or exception for that request, if its stream is open."""
        target = self._open.get(request_id)
        if target is not None:
            target[1].put_nowait(item)

    def put_threadsafe(self, request_id: str, item) -> None:
        """The same from another thread (the engine's)."""
        target = self._open.get(request_id)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, item)

    def fail_all(self, err: BaseException, threadsafe: bool = False) -> None:
        for rid in list(self._open):
            (self.put_threadsafe if threadsafe else self.put)(rid, err)

    async def read(self, request_id: str, params: SamplingParams, abort: Callable[[str], None],
                   dead: Callable[[], str | None]) -> AsyncIterator[RequestOutput]:
        """The request's outputs until all its samples finished; an exception put on its queue (a
        failed add, a dead engine) is raised. Leaving early aborts it (unless the engine is dead);
        either way its stream is closed."""
        q = self._open[request_id][1]
        left = params.num_samples
        finished = False
        try:
            while left:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    left -= 1
                yield out
            finished = True
        finally:
            self.close(request_id)
            if not finished and not dead():
                abort(request_id)

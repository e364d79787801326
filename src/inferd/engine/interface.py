"""`Engine`: what the loops that drive an engine call on it, whichever runner it is.

Three loops drive one: AsyncLLM's engine thread (inferd.engine.async_engine), the engine core
process (inferd.engine.core) and offline `LLM` (inferd.engine.llm). They hold an `Engine`, so
`LLMEngine` (generation) and `PoolingEngine` (embeddings) serve them alike, and `make_engine`
(inferd.engine.factory) is the one place that tells them apart. Both declare it as their base: a
method one of them lacks is a TypeError when it is built, not an AttributeError mid-loop.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from inferd.engine.state import STEP_HISTORY

if TYPE_CHECKING:
    from inferd.config import EngineConfig
    from inferd.engine.client import EngineInfo
    from inferd.engine.request import RequestOutput
    from inferd.engine.stats import EngineSnapshot


class Engine(Protocol):
    config: EngineConfig
    tokenizer: Any  # None for a model without one: prompts are then token ids
    scheduler: Any  # its queues, `waiting` and `running`, which AsyncLLM counts for back-pressure

    # -- what clients read ------------------------------------------------------------------------
    @abstractmethod
    def info(self) -> EngineInfo:
        """What a client of this engine knows of it (inferd.engine.client)."""

    @abstractmethod
    def tokenizer_path(self) -> str | None:
        """The file another process loads this engine's tokenizer from (None: no tokenizer)."""

    @abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The gauges after a step (metrics)."""

    @abstractmethod
    def state(self, steps: int = STEP_HISTORY) -> dict:
        """What the dashboard shows of this engine (inferd.engine.state); called between steps."""

    # -- requests -----------------------------------------------------------------------------------
    @abstractmethod
    def add_request(self, prompt, params=None, request_id: str | None = None, arrival: float | None = None,
                    kv_transfer_params: dict | None = None, lora: str | None = None) -> str:
        """Queue a request (text or token ids); its id. A request the engine cannot take raises
        InferdError: the client's 400."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a request; False if it is not (or no longer) here."""

    @abstractmethod
    def control(self, op: str, **args):
        """An operator's command, run between two steps."""

    # -- the loop ---------------------------------------------------------------------------------
    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether a step has work to do."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One step: the outputs it made, with those of requests aborted since the last one."""

    @abstractmethod
    def housekeeping(self) -> bool:
        """Work outside steps, done when idle too; True if anything changed."""

    @abstractmethod
    def take_aborted(self) -> list[RequestOutput]:
        """The finished outputs of requests aborted since the last call (metrics count them)."""

    @abstractmethod
    def close(self):
        """Stop what the engine started."""

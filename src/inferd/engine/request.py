"""Request, SamplingParams and the per-request timing events every latency metric comes from."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from inferd.errors import InferdError


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InferdError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise InferdError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InferdError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InferdError("top_k must be -1, 0 (off) or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timings:
    """Monotonic timestamps (time.monotonic()) of one request's life."""
    arrived: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    preempted: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrived

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrived

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 arrival: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # tokens whose K/V are in the cache; the scheduler advances it, preemption resets it
        self.num_computed = 0
        self.max_computed = 0  # high-water mark of num_computed: recompute lies below it
        self.block_table: list[int] = []
        self.num_cached_hashed = 0  # leading blocks already registered in the prefix cache
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        self.num_prefill_chunks = 0
        self.prefix_hit_tokens = 0  # on first admission only
        self.timings = Timings(arrived=time.monotonic() if arrival is None else arrival)
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self):
        return (f"Request({self.request_id}, prompt={self.num_prompt}, out={len(self.output_ids)}, "
                f"computed={self.num_computed}, {self.status.value})")


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step: the tokens added since the last one."""
    request_id: str
    new_token_ids: list[int]
    output_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    timings: Timings | None = None
    error: str | None = None

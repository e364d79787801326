"""Request, SamplingParams and the per-request timing events every latency metric comes from."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferd.errors import InferdError

if TYPE_CHECKING:  # a Request lives in the engine process; SamplingParams in the API process too (no torch)
    import torch


@dataclass
class StructuredOutputs:
    """A constraint on the output, vLLM's `structured_outputs`: exactly one of a JSON schema (a dict
    or its text), any JSON object, a regular expression, a list of choices, or a grammar (Lark, or
    llama.cpp's GBNF). The engine compiles it with llguidance and masks every step's logits by it."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    @property
    def kind(self) -> str:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InferdError("structured_outputs needs exactly one of " + ", ".join(self.KINDS)
                              + (f" (got {', '.join(given)})" if given else ""))
        return given[0]

    def validate(self):
        kind = self.kind
        if kind == "choice" and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                 or not all(isinstance(c, str) for c in self.choice)):
            raise InferdError("structured_outputs.choice must be a non-empty list of strings")
        if kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise InferdError(f"structured_outputs.{kind} must be a string")
        if kind == "json" and not isinstance(self.json, (dict, str)):
            raise InferdError("structured_outputs.json must be a JSON schema (an object or its text)")


@dataclass
class SamplingParams:
    """The OpenAI / vLLM sampling knobs, meaning what they mean there."""
    max_tokens: int | None = 16  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + output
    presence_penalty: float = 0.0  # OpenAI: over the output
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top alternatives per generated token (0: the sampled one only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # suffix decoding's shared cache of outputs: drafts come only from requests of the same salt;
    # suffix_cache False keeps the request out of it altogether
    cache_salt: str | None = None
    suffix_cache: bool = True

    def validate(self, vocab_size: int | None = None):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise InferdError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InferdError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise InferdError("top_k must be -1, 0 (off) or positive")
        if not 0 <= self.min_p <= 1:
            raise InferdError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise InferdError("repetition_penalty must be > 0")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise InferdError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.n < 1:
            raise InferdError("n must be at least 1")
        if self.best_of is not None and self.best_of < self.n:
            raise InferdError("best_of must be >= n")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InferdError("min_tokens must be in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise InferdError(f"{name} must be in [0, 20]")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise InferdError("stop must be a non-empty string or a list of them")
        if vocab_size is not None:
            for t in list(self.stop_token_ids) + [int(k) for k in (self.logit_bias or {})]:
                if not 0 <= int(t) < vocab_size:
                    raise InferdError(f"token id {t} is outside the vocabulary [0, {vocab_size})")
        if self.logit_bias:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                unknown = set(self.structured_outputs) - set(StructuredOutputs.KINDS)
                if unknown:
                    raise InferdError(f"unknown structured_outputs field(s): {', '.join(sorted(unknown))}")
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            self.structured_outputs.validate()
        if self.num_samples > 1:
            if self.temperature == 0:
                raise InferdError("n > 1 needs temperature > 0 (greedy samples would all be equal)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for the request: best_of of them when set, else n."""
        return self.best_of or self.n


@dataclass
class PoolingParams:
    """A pooling request (an embedding): one forward pass over the prompt, one vector back. Stands
    where SamplingParams stands in `EngineClient.generate`, so every client carries it unchanged.
    `normalize` None: the model's own choice (its sentence-transformers Normalize module); `dimensions`
    a Matryoshka cut, refused by a model that was not trained for one."""
    normalize: bool | None = None
    dimensions: int | None = None

    num_samples = 1  # one output, as Streams.read counts them
    n = 1
    greedy = True  # nothing is sampled: a Request holds no generator

    def validate(self):
        if self.dimensions is not None:
            raise InferdError("dimensions: this model does not support a shortened embedding (no Matryoshka "
                              "training declared)")


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
                 arrival: float | None = None, group: str | None = None, index: int = 0):
        self.request_id = request_id
        self.group = group or request_id  # the client's request id (n > 1 samples share it)
        self.index = index
        self.lora: str | None = None  # the LoRA adapter this request runs with (None: the base model)
        self.detok = None  # IncrementalDetokenizer, when the engine has a tokenizer
        self.held = ""  # decoded text held back: it may be the start of a stop string
        self.logprobs: list = []  # per generated token: (logprob, rank, [(id, logprob)])
        self.prompt_logprobs: list | None = None  # per prompt token: None for the first, then as above
        self.cumulative_logprob = 0.0
        self.fork_into = 0  # a parent of n > 1 samples forks into this many after its prompt
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
        self.kv_tables: list[list[int]] = []  # KV groups 1.. (sliding-window layers); see kv_cache
        self.num_cached_hashed = 0  # leading blocks already registered in the prefix cache
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        self.num_prefill_chunks = 0
        self.prefix_hit_tokens = 0  # on first admission only
        # disaggregated prefill/decode (inferd.distributed.kv_transfer): a producer's request leases its
        # prompt KV when it finishes; a consumer's pulls it (RemoteKV) before it is scheduled
        self.kv_export = False
        self.remote = None
        self.remote_tokens = 0  # prompt tokens whose KV came from the producer
        self.tier_tokens = 0  # prompt tokens whose KV was loaded from the KV tier (inferd.engine.kv_tier)
        self.tier_tried = False  # its tier load ran since its last admission: not asked again
        # speculative decoding: this step's guesses, the distributions they were drawn from
        # ([k, vocab], None for greedy or prompt lookup), and the draft's own sampling stream
        self.spec_tokens: list[int] = []
        self.spec_q: torch.Tensor | None = None
        self.draft_generator: torch.Generator | None = None
        self.spec_skip = 0  # prompt lookup: steps left without guesses after a fully rejected run
        self.spec_backoff = 0  # ... and the length of the last such pause
        # structured output (inferd.engine.structured): the llguidance matcher that has consumed
        # output_ids, and the token masks computed ahead for the next position(s)
        self.matcher = None
        self.masks = None  # (key, bool tensor [positions, vocab]); key says which state they are for
        self.timings = Timings(arrived=time.monotonic() if arrival is None else arrival)
        self.generator: torch.Generator | None = None
        if not params.greedy:
            import torch

            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed + index)  # sample i of n: its own stream
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
    """What the engine reports for one sequence after a step: what it gained since the last one."""
    request_id: str  # the client's id (shared by the n samples of one request)
    new_token_ids: list[int]
    output_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    timings: Timings | None = None
    error: str | None = None
    index: int = 0  # which of the n samples
    text_delta: str = ""  # the text these tokens add (stop strings cut); the whole text is the consumer's to join
    logprobs: list | None = None  # for new_token_ids
    prompt_logprobs: list | None = None  # once, with the first output
    prompt_ids: list[int] | None = None
    kv_transfer_params: dict | None = None  # a KV producer's finished request: where its prompt KV is
    num_cached_tokens: int = 0  # prompt tokens not computed here (prefix cache, remote KV), when finished
    num_output_tokens: int = 0  # tokens generated so far (output_ids does not cross a process boundary)
    embedding: list[float] | None = None  # a pooling request's vector (PoolingParams)

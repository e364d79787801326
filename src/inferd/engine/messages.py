"""The messages between an engine client (the API process) and the engine core process.

Two ZeroMQ PUSH/PULL pipes over ipc:// sockets carry them, pickled: dataclasses as they are, so a
RequestOutput and its timings cross unchanged (time.monotonic() is one clock for every process on
Linux). One StepOutputs per engine step carries all of that step's outputs and the engine's gauges,
so a busy step costs one send, not one per token. Nothing here loads torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.state import STEP_HISTORY


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    arrival: float | None
    kv_transfer_params: dict | None = None
    lora: str | None = None  # the LoRA adapter to run with (None: the base model)


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
class Control:
    """An operator's command, run between two steps (LLMEngine.control: load_lora, unload_lora)."""
    seq: int
    op: str
    args: dict = field(default_factory=dict)


@dataclass
class ControlReply:
    seq: int
    result: object = None
    error: BaseException | None = None  # InferdError: the command was refused (400, or Busy: 409)


@dataclass
class Ready:
    """The core loaded its model: what the API process needs to know about it (the tokenizer
    crosses as its file, which the API process loads)."""
    info: object  # inferd.engine.client.EngineInfo, tokenizer None
    tokenizer_path: str | None


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

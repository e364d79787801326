"""What an engine reports about its steps. Torch-free: an EngineSnapshot crosses the process boundary
to the API process (inferd.engine.core), which unpickles it without loading torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_recompute_tokens: int
    num_preempted: int
    kv_blocks_used: int
    duration: float


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recompute_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    max_batch_seqs: int = 0
    max_mixed_batch_seqs: int = 0  # largest step that held both prefill and decode work
    peak_kv_blocks: int = 0
    max_prefill_chunks: int = 0  # most steps any one prompt was split over
    forks: int = 0  # n > 1 requests split into samples
    failed: int = 0  # sequences ended by an error in their step (the engine went on)
    sample_events: int = 0  # (sequence, step) pairs that gained tokens: target forwards per sequence
    fused_steps: int = 0  # steps the fused C++ decode call computed (inferd.model.fused_decode), not eager ones
    eager_decode_steps: int = 0  # one-token-per-sequence steps the eager forward computed (fused declined or off)
    history: list[StepStats] = field(default_factory=list)


@dataclass
class EngineSnapshot:
    """The engine's gauges and running counters after a step: what /metrics shows, and what crosses
    the process boundary when the engine runs in its own process (inferd.engine.core)."""
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_total: int = 1
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    spec: dict | None = None  # SpecStats counters and rates, with speculation
    steps: int = 0
    kv: dict | None = None  # KVTransfer counters, with --kv-transfer-config
    prefill_tokens: int = 0  # prompt tokens this engine computed (not cached, not received)
    lora: dict | None = None  # with --enable-lora: {"running": [adapters], "waiting": [...], "max_loras": n}
    tier: dict | None = None  # with --kv-tier: KVTier counters, and load times since the last snapshot
    events: dict | None = None  # with --kv-events-config: batches published and dropped
    blocks_stored: int = 0  # prefix blocks made findable (the KV events' BlockStored hashes)
    blocks_removed: int = 0  # findable blocks evicted (BlockRemoved's)
    attention: dict | None = None  # the native attention kernels' counters since this engine started

"""What one engine shows of itself while it runs (GET /v1/engine/state, the dashboard).

Built on demand, on the engine's own thread or process between two steps, from what the engine
keeps anyway: the scheduler's queues, the block manager's reference counts, and two short rings
(recent steps, recently finished requests) that cost one tuple append each. Nobody looking means
nothing built. The result is plain JSON-ready data, so it crosses the engine-core boundary pickled
like any other message and the API process never needs torch to read it.

Request ids and lengths only, never prompts or outputs: the dashboard is for whoever runs the
server, and the requests are other people's.
"""
from __future__ import annotations

import time
from collections import deque

from inferd.engine.paths import engine_paths

STEP_HISTORY = 240  # steps kept for the step chart
FINISHED_HISTORY = 256  # finished requests kept for the latency distributions
MAX_LISTED = 256  # running / waiting requests listed by id (the counts are always whole)

# one character a block: the KV map as a string is ~1 byte a block on the wire and in the page
KV_FREE, KV_USED, KV_SHARED, KV_CACHED = ".", "u", "s", "c"


class History:
    """The engine's two rings. Tuples, not dicts: appended every step on the hot path."""

    STEP_FIELDS = ("step", "time", "seqs", "prefill", "decode", "recompute", "preempted", "kv_used", "ms")
    FINISHED_FIELDS = ("seq", "id", "prompt_tokens", "output_tokens", "cached_tokens", "finish_reason", "time",
                       "queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "preemptions")

    def __init__(self):
        self.steps: deque = deque(maxlen=STEP_HISTORY)
        self.finished: deque = deque(maxlen=FINISHED_HISTORY)
        self.num_finished = 0  # the seq of the next finished row: a reader asks for rows after the last it saw

    def step(self, step: int, seqs: int, prefill: int, decode: int, recompute: int, preempted: int,
             kv_used: int, seconds: float):
        self.steps.append((step, time.time(), seqs, prefill, decode, recompute, preempted, kv_used,
                           round(seconds * 1e3, 3)))

    def finish(self, req):
        t = req.timings
        self.num_finished += 1
        self.finished.append((self.num_finished, shown_id(req), req.num_prompt,
                              len(req.output_ids), req.prefix_hit_tokens + req.remote_tokens, req.finish_reason,
                              time.time(), _ms(t.queue_time), _ms(t.ttft), _ms(t.tpot), _ms(t.e2e),
                              req.num_preemptions))


def shown_id(req) -> str:
    """The client's request id; the n > 1 samples of one request as id#index."""
    return req.group if req.index == 0 else f"{req.group}#{req.index}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def kv_map(ref: list[int], evictable) -> str:
    """Every block's state, one character each: free, in use by one sequence, shared by several
    (prefix-cache hits, n > 1 forks), or cached (no owner, but findable by its prefix until evicted)."""
    out = bytearray(KV_FREE.encode()) * len(ref)
    used, shared, cached = ord(KV_USED), ord(KV_SHARED), ord(KV_CACHED)
    for b, r in enumerate(ref):
        if r:
            out[b] = used if r == 1 else shared
    for b in evictable:
        out[b] = cached
    return out.decode()


def kv_counts(m: str) -> dict:
    return {"free": m.count(KV_FREE), "used": m.count(KV_USED) + m.count(KV_SHARED), "shared": m.count(KV_SHARED),
            "cached": m.count(KV_CACHED)}


def _listed(reqs, now: float, held) -> list[dict]:
    out = []
    for r in list(reqs)[:MAX_LISTED]:
        out.append({"id": shown_id(r),
                    "phase": "prefill" if r.num_computed < r.num_prompt else "decode",
                    "prompt_tokens": r.num_prompt, "output_tokens": len(r.output_ids),
                    "computed_tokens": r.num_computed, "blocks": held(r),
                    "preemptions": r.num_preemptions, "age_ms": round((now - r.timings.arrived) * 1e3, 1)})
    return out


def _role(engine) -> str | None:
    """prefill, decode or both, whichever way the KV transfer was configured (--role or the JSON)."""
    if engine.kv is None:
        return None
    c = engine.kv.cfg
    return "both" if c.producer and c.consumer else "prefill" if c.producer else "decode"


def read_state(engine, steps: int = STEP_HISTORY) -> dict:
    """engine.state(), or what went wrong building it: a bug here must not stop the engine."""
    try:
        return engine.state(steps)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def engine_state(engine, steps: int = STEP_HISTORY) -> dict:
    """One engine's state after its last step; `step` is that step's id (EngineStats.steps)."""
    bm, sched, cfg, hist = engine.block_manager, engine.scheduler, engine.config, engine.history
    now = t0 = time.monotonic()
    m = kv_map(bm.ref, bm.evictable)
    stats = engine.stats
    waiting = list(sched.waiting)
    if engine.kv is not None and engine.kv.connector is not None:  # pulls in flight wait too
        waiting += list(engine.kv.pending.values()) + list(engine.kv.blocked)
    kv = {"num_blocks": bm.num_blocks, "block_size": bm.block_size, "used_blocks": bm.num_used,
          "map": m, **{f"{k}_blocks": v for k, v in kv_counts(m).items() if k != "used"}}
    counters = {"steps": stats.steps, "prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
                "recompute_tokens": stats.recompute_tokens, "generated_tokens": stats.generated_tokens,
                "preemptions": stats.preemptions, "prefix_queries": bm.queries, "prefix_hits": bm.hits,
                "prefix_hit_rate": bm.hits / bm.queries if bm.queries else None, "failed": stats.failed,
                "evictions": bm.evictions}
    out = {
        "step": stats.steps,
        "time": time.time(),
        "num_running": len(sched.running), "num_waiting": engine.num_waiting(),
        "running": _listed(sched.running, now, bm.held_blocks), "waiting": _listed(waiting, now, bm.held_blocks),
        "kv": kv,
        "steps": {"fields": list(History.STEP_FIELDS), "rows": list(hist.steps)[-steps:] if steps > 0 else []},
        "finished": {"fields": list(History.FINISHED_FIELDS), "rows": list(hist.finished)},
        "counters": counters,
        "speculative": engine.spec_counters(),
        "kv_transfer": engine.kv.view() if engine.kv is not None else None,
        "kv_tier": engine.tier.view() if getattr(engine, "tier", None) is not None else None,
        "config": {**engine.cache_info(), "max_num_seqs": cfg.max_num_seqs,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_model_len": engine.max_model_len,
                   "speculative_method": cfg.speculative_method, "role": _role(engine),
                   "tensor_parallel_size": cfg.tensor_parallel_size, "scheduling": cfg.scheduling},
        "paths": engine_paths(engine),  # which fast paths ran: what a benchmark labels its rows from
        # the load: seconds, peak resident memory, weights held, layers left dense for want of a kernel
        "load": getattr(engine, "load_report", None),
    }
    out["build_ms"] = round((time.monotonic() - t0) * 1e3, 3)  # what this read cost the engine, between two steps
    return out

"""The pooling runner (`--runner pooling`, vLLM's name): embeddings from an encoder (BERT) or from
any decoder family, one forward pass a request and no KV cache.

`PoolingEngine` is an `Engine` (inferd.engine.interface) as `LLMEngine` is, so the engine thread,
the core process and data parallelism serve it unchanged; a pooling request is a `PoolingParams`
where a generation request has `SamplingParams`, and its one `RequestOutput` carries the vector.

Scheduling: waiting requests in arrival order, as many as fit `max_num_seqs` and the token budget
(at least one whole request: a sequence is never split, attention needs all of it at once), in one
flat batch; every request of a step finishes in that step. `make_engine` (inferd.engine.factory)
picks the runner.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque

import torch

from inferd.config import EngineConfig
from inferd.engine.client import EngineInfo
from inferd.engine.interface import Engine
from inferd.engine.request import PoolingParams, Request, RequestOutput, Status
from inferd.engine.state import STEP_HISTORY, History
from inferd.engine.stats import EngineSnapshot, EngineStats
from inferd.errors import InferdError
from inferd.model import registry
from inferd.model.config import attention_scale, attention_windows
from inferd.model.pooling import PoolingConfig
from inferd.worker.pooling import PoolingRunner

log = logging.getLogger("inferd")

POOLING_BUDGET = 16384  # tokens of one pooling forward, at most, unless --max-num-batched-tokens asks more

# what a pooling engine cannot combine with, and the flag that asks for it
_NOT_WITH = (("tensor_parallel_size", lambda v: v > 1, "--tensor-parallel-size"),
             ("speculative_method", lambda v: v is not None, "--speculative-method"),
             ("kv_transfer_config", lambda v: v is not None, "--kv-transfer-config"),
             ("role", lambda v: v is not None, "--role"),
             ("kv_tier", lambda v: v is not None, "--kv-tier"),
             ("kv_events_config", lambda v: v is not None, "--kv-events-config"),
             ("enable_lora", bool, "--enable-lora"))


def pooling_paths(engine: "PoolingEngine") -> dict:
    """What ran in a pooling engine (inferd.engine.paths' record, with the runner's counters)."""
    from inferd.engine.paths import module_paths

    return {"engine": "inferd", "runner": "pooling", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **module_paths(engine.model), "pooling": engine.pooling.mode, "steps": engine.stats.steps,
            "prefill_tokens": engine.stats.prefill_tokens, "decode_tokens": 0, **engine.counters()}


class _Queue:
    """The scheduler's face to the clients (AsyncLLM counts `waiting` and `running`)."""

    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []


def model_pooling(cfg: EngineConfig, loaded) -> PoolingConfig:
    """The model's own pooling (its sentence-transformers files), --pooling over it; without files: CLS
    for an encoder (BERT's pooler token), the last token for a decoder (Qwen3-Embedding's), both
    normalised."""
    from inferd.loading.encoder import read_pooling

    src = loaded.source
    own = read_pooling(src.path, cfg.pooling) if src.kind == "hf" else None
    if own is not None:
        return own
    encoder = registry.by_name(loaded.config.architecture).encoder
    return PoolingConfig(cfg.pooling or ("cls" if encoder else "last"), True, None)


class PoolingEngine(Engine):
    kind = "pooling"  # the runner it is (LLMEngine generates)

    def __init__(self, config: EngineConfig, loaded=None):
        cfg = config.validate()
        for name, on, flag in _NOT_WITH:
            if on(getattr(cfg, name)):
                raise InferdError(f"{flag} does not apply to the pooling runner (one forward a request, no KV cache)")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if loaded is None:
            from inferd.loading.loader import load_model

            loaded = load_model(cfg.load_config())
        self.config = cfg
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.model_config = mcfg
        encoder = registry.by_name(mcfg.architecture).encoder
        if not encoder and (attention_windows(mcfg) is not None or mcfg.attn_logit_softcapping):
            raise InferdError(f"{mcfg.architecture} as a pooling model: sliding-window and soft-capped attention "
                              "are not in the pooling runner yet")
        self.pooling = model_pooling(cfg, loaded)
        limit = self.pooling.max_seq_length or mcfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or limit, mcfg.max_position_embeddings)
        # A pooling step is one forward with nothing to stream back until it ends, so the budget is as
        # many whole sequences as max_num_seqs, up to POOLING_BUDGET tokens (the generate runner's 512
        # cut 64 texts into ~20 forwards: 2.6x slower, measured); never below one whole sequence
        self.budget = max(cfg.max_num_batched_tokens, self.max_model_len,
                          min(cfg.max_num_seqs * self.max_model_len, POOLING_BUDGET))
        self.runner = PoolingRunner(self.model, attention_scale(mcfg), causal=not encoder)
        self.scheduler = _Queue()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.history = History()
        self.keep_history = False
        self.aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        log.info("pooling runner: %s pooling%s, up to %d tokens a sequence, %d a step (%s attention)",
                 self.pooling.mode, ", normalised" if self.pooling.normalize else "", self.max_model_len,
                 self.budget, "causal" if not encoder else "bidirectional")

    # -- what clients read ------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        m = self.pooling
        return EngineInfo(self.loaded.source.name, self.tokenizer, self.max_model_len, self.model_config.vocab_size,
                          False, os.getpid(), self.cache_info(), runner="pooling",
                          pooling={"mode": m.mode, "normalize": m.normalize,
                                   "dimensions": self.model_config.hidden_size})

    def tokenizer_path(self) -> str | None:
        return self.loaded.source.path if self.tokenizer is not None else None

    def cache_info(self) -> dict:
        return {"block_size": 0, "num_blocks": 0, "dtype": str(self.model.dtype).replace("torch.", ""),
                "prefix_caching": False}

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(0, len(self.scheduler.waiting), 0, 1, steps=self.stats.steps,
                              prefill_tokens=self.stats.prefill_tokens)

    def counters(self) -> dict:
        """The runner's counters: forwards, sequences, tokens computed against their real lengths."""
        return self.runner.counters()

    def state(self, steps: int = STEP_HISTORY) -> dict:
        """The dashboard's view (inferd.engine.state's shape where it applies; no KV cache)."""
        now = time.monotonic()
        st = self.stats
        return {"step": st.steps, "time": time.time(), "num_running": 0, "num_waiting": self.num_waiting(),
                "running": [], "waiting": [{"id": r.group, "phase": "waiting", "prompt_tokens": r.num_prompt,
                                            "output_tokens": 0, "computed_tokens": 0, "blocks": 0, "preemptions": 0,
                                            "age_ms": round((now - r.timings.arrived) * 1e3, 1)}
                                           for r in list(self.scheduler.waiting)[:256]],
                "kv": {"num_blocks": 0, "block_size": 0, "used_blocks": 0, "map": "", "free_blocks": 0,
                       "shared_blocks": 0, "cached_blocks": 0},
                "steps": {"fields": list(History.STEP_FIELDS),
                          "rows": list(self.history.steps)[-steps:] if steps > 0 else []},
                "finished": {"fields": list(History.FINISHED_FIELDS), "rows": list(self.history.finished)},
                "counters": {"steps": st.steps, "prefill_tokens": st.prefill_tokens, "failed": st.failed,
                             "pooling": self.counters()},
                "speculative": None, "kv_transfer": None, "kv_tier": None,
                "config": {**self.cache_info(), "max_num_seqs": self.config.max_num_seqs,
                           "max_num_batched_tokens": self.budget, "max_model_len": self.max_model_len,
                           "runner": "pooling", "pooling": self.pooling.mode},
                "paths": pooling_paths(self)}

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt, params=None, request_id: str | None = None, arrival: float | None = None,
                    kv_transfer_params: dict | None = None, lora: str | None = None) -> str:
        if not isinstance(params, PoolingParams):
            raise InferdError(f"model `{self.loaded.source.name}` is an embedding model (the pooling runner): it "
                              "answers /v1/embeddings, /pooling and /api/embed, not text generation")
        if kv_transfer_params is not None or lora is not None:
            raise InferdError("kv_transfer_params and LoRA adapters do not apply to an embedding request")
        params.validate()
        if isinstance(prompt, str) and self.tokenizer is None:
            raise InferdError("this model has no tokenizer: pass token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InferdError("input is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InferdError(f"input token ids must be in [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise InferdError(f"input is {len(ids)} tokens; this model takes at most {self.max_model_len} "
                              "(set truncate_prompt_tokens to cut it)")
        rid = request_id if request_id is not None else f"emb-{next(self._ids)}"
        if rid in self.requests:
            raise InferdError(f"duplicate request id {rid!r}")
        req = Request(rid, ids, params, arrival)
        self.requests[rid] = req
        self.scheduler.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        try:
            self.scheduler.waiting.remove(req)
        except ValueError:
            pass
        req.status, req.finish_reason = Status.FINISHED, "abort"
        req.timings.finished = time.monotonic()
        self.aborted.append(RequestOutput(req.group, [], [], True, "abort", None, req.num_prompt, req.timings))
        return True

    def control(self, op: str, **args):
        raise InferdError(f"{op}: the pooling runner takes no engine commands (no LoRA adapters)")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting)

    def housekeeping(self) -> bool:
        return False

    def take_aborted(self) -> list[RequestOutput]:
        out, self.aborted = self.aborted, []
        return out

    def close(self):
        pass

    # -- the loop ---------------------------------------------------------------------------------
    def schedule(self) -> list[Request]:
        """Arrival order, up to max_num_seqs and the token budget; the first always goes."""
        batch: list[Request] = []
        tokens = 0
        q = self.scheduler.waiting
        while q and len(batch) < self.config.max_num_seqs and (not batch or tokens + q[0].num_prompt <= self.budget):
            req = q.popleft()
            tokens += req.num_prompt
            batch.append(req)
        return batch

    def step(self) -> list[RequestOutput]:
        out = self.take_aborted()
        batch = self.schedule()
        if not batch:
            return out
        t0 = time.monotonic()
        for r in batch:
            r.timings.first_scheduled = t0
            r.status = Status.RUNNING
        normalize = [self.pooling.normalize if r.params.normalize is None else r.params.normalize for r in batch]
        try:
            vecs = self.runner.execute([r.prompt_ids for r in batch], self.pooling.mode, normalize)
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the engine goes on
            log.error("the pooling forward failed for %d request(s)", len(batch), exc_info=e)
            return out + self._finish(batch, None, f"the forward pass failed: {type(e).__name__}: {e}")
        out += self._finish(batch, vecs, None)
        dt = time.monotonic() - t0
        st = self.stats
        st.steps += 1
        n_tok = sum(r.num_prompt for r in batch)
        st.prefill_tokens += n_tok
        st.max_batch_seqs = max(st.max_batch_seqs, len(batch))
        self.history.step(st.steps, len(batch), n_tok, 0, 0, 0, 0, dt)
        return out

    def _finish(self, batch: list[Request], vecs, error: str | None) -> list[RequestOutput]:
        now = time.monotonic()
        outs = []
        for j, r in enumerate(batch):
            r.status = Status.FINISHED
            r.finish_reason = "error" if error else "stop"
            r.timings.first_token = r.timings.finished = now
            self.requests.pop(r.request_id, None)
            self.history.finish(r)
            outs.append(RequestOutput(r.group, [], [], True, r.finish_reason, None, r.num_prompt, r.timings,
                                      error=error, embedding=None if vecs is None else vecs[j]))
        if error:
            self.stats.failed += len(batch)
        return outs

"""LLMEngine.step(): schedule -> run the model -> sample -> append, stop, free.

The engine's boundary is message-shaped: `add_request` takes a request in, `step` returns
RequestOutput messages (the tokens each request gained this step). `LLM` wraps it for offline use;
the server drives the same loop from its own thread.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from inferd.config import EngineConfig, available_memory_bytes
from inferd.engine.attention import PagedAttention
from inferd.engine.kv_cache import BlockManager, KVPool
from inferd.engine.request import Request, RequestOutput, SamplingParams, Status
from inferd.engine.runner import ModelRunner
from inferd.engine.sampler import sample_rows
from inferd.engine.scheduler import ScheduledBatch, Scheduler
from inferd.errors import InferdError

log = logging.getLogger("inferd")

CPU_KV_DEFAULT_FRACTION = 0.2
CPU_KV_DEFAULT_CAP = 2 * 1024**3


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
    history: list[StepStats] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded=None, **overrides):
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise InferdError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        self.config = cfg.validate()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if loaded is None:
            from inferd.model.loader import load_model

            loaded = load_model(cfg.model, load_format=cfg.load_format, dtype=cfg.dtype, device=cfg.device)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.model_config = mcfg
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise InferdError(f"max_model_len {self.max_model_len} exceeds the model's context "
                              f"length {mcfg.max_position_embeddings}")
        kv_dtype = self._kv_dtype()
        per_block = KVPool.bytes_per_block(mcfg.num_hidden_layers, cfg.block_size, mcfg.num_key_value_heads,
                                           mcfg.head_dim, kv_dtype)
        num_blocks = cfg.num_kv_blocks or max(1, self._kv_bytes() // per_block)
        self.pool = KVPool(mcfg.num_hidden_layers, num_blocks, cfg.block_size, mcfg.num_key_value_heads,
                           mcfg.head_dim, kv_dtype, self.model.device)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.scheduling)
        window = mcfg.sliding_window if mcfg.sliding_window and mcfg.sliding_window < self.max_model_len else None
        self.runner = ModelRunner(self.model, PagedAttention(self.pool, mcfg.head_dim, window))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.keep_history = False
        self._ids = itertools.count()
        self.eos_ids = set(self.tokenizer.eos_token_ids) if self.tokenizer else (
            {mcfg.eos_token_id} if isinstance(mcfg.eos_token_id, int) else set(mcfg.eos_token_id or []))
        log.info("KV cache: %d blocks of %d tokens (%s, %.1f MiB): up to %d tokens in flight",
                 num_blocks, cfg.block_size, str(kv_dtype).replace("torch.", ""),
                 num_blocks * per_block / 2**20, num_blocks * cfg.block_size)

    def _kv_dtype(self) -> torch.dtype:
        c = self.config.kv_cache_dtype
        if c == "auto":
            return self.model.dtype
        from inferd.model.loader import resolve_dtype

        return resolve_dtype(c)

    def _kv_bytes(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory:
            return int(cfg.kv_cache_memory)
        if self.model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            used_by_others = total - free
            return max(0, int(total * cfg.gpu_memory_utilization) - used_by_others)
        return int(min(CPU_KV_DEFAULT_CAP, CPU_KV_DEFAULT_FRACTION * available_memory_bytes()))

    # -- requests -------------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InferdError("this model has no tokenizer: pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise InferdError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InferdError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InferdError(f"prompt is {len(prompt_ids)} tokens; the context limit is {self.max_model_len}")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise InferdError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                              f"exceeds the context limit of {self.max_model_len}")
        need = -(-(len(prompt_ids) + params.max_tokens) // self.config.block_size)
        if need > self.num_kv_blocks:
            raise InferdError(f"request needs {need} KV blocks but the cache holds {self.num_kv_blocks}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InferdError(f"duplicate request id {rid!r}")
        req = Request(rid, prompt_ids, params, arrival)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        req.timings.finished = time.monotonic()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler cannot admit any request (KV cache too small?)")
            return []
        logits, idx = self.runner.execute(batch.requests, batch.num_new)
        for req, n in zip(batch.requests, batch.num_new):
            req.num_computed += n
            req.max_computed = max(req.max_computed, req.num_computed)
            self.block_manager.register_full_blocks(req)
        outputs: list[RequestOutput] = []
        if idx:
            reqs = [batch.requests[i] for i in idx]
            tokens = self._sample(logits, reqs).tolist()
            now = time.monotonic()
            for req, tok in zip(reqs, tokens):
                outputs.append(self._append(req, tok, now))
        self._record(batch, time.monotonic() - t0)
        return outputs

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in reqs], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32)
        return sample_rows(logits, temp, top_k, top_p, [r.generator for r in reqs])

    def _append(self, req: Request, tok: int, now: float) -> RequestOutput:
        req.output_ids.append(tok)
        self.stats.generated_tokens += 1
        t = req.timings
        if t.first_token is None:
            t.first_token = now
        t.token_times.append(now)
        p = req.params
        if not p.ignore_eos and tok in self.eos_ids:
            req.finish_reason, req.stop_reason = "stop", None
        elif tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", tok
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            req.status = Status.FINISHED
            t.finished = now
            self.scheduler.remove(req)
            self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, [tok], req.output_ids, req.finished, req.finish_reason,
                             req.stop_reason, req.num_prompt, t)

    def _record(self, batch: ScheduledBatch, dt: float):
        s = self.stats
        s.steps += 1
        s.prefill_tokens += batch.num_prefill_tokens
        s.decode_tokens += batch.num_decode_tokens
        s.recompute_tokens += batch.num_recompute_tokens
        s.preemptions += len(batch.preempted)
        n = len(batch.requests)
        s.max_batch_seqs = max(s.max_batch_seqs, n)
        if batch.num_prefill_tokens + batch.num_recompute_tokens and batch.num_decode_tokens:
            s.max_mixed_batch_seqs = max(s.max_mixed_batch_seqs, n)
        used = self.block_manager.num_used
        s.peak_kv_blocks = max(s.peak_kv_blocks, used)
        for req, k in zip(batch.requests, batch.num_new):
            if req.num_computed <= req.num_prompt and req.num_preemptions == 0 and k > 0:
                req.num_prefill_chunks += 1
                s.max_prefill_chunks = max(s.max_prefill_chunks, req.num_prefill_chunks)
        if self.keep_history:
            s.history.append(StepStats(n, batch.num_prefill_tokens, batch.num_decode_tokens,
                                       batch.num_recompute_tokens, len(batch.preempted), used, dt))


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None
    timings: object


class LLM:
    """Offline use: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, loaded=None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model), loaded=loaded, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams() for _ in prompts]
        from copy import deepcopy

        ids = [self.engine.add_request(p, deepcopy(sp)) for p, sp in zip(prompts, params)]
        reqs = {rid: self.engine.requests[rid] for rid in ids}
        while self.engine.has_unfinished():
            self.engine.step()
        return [self._result(reqs[rid]) for rid in ids]

    def _result(self, req: Request) -> CompletionOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return CompletionOutput(req.request_id, req.prompt_ids, list(req.output_ids), text,
                                req.finish_reason, req.stop_reason, req.timings)

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield (text delta, RequestOutput) for one prompt as tokens come; runs other queued work too."""
        from inferd.tokenizer import IncrementalDetokenizer

        rid = self.engine.add_request(prompt, params or SamplingParams())
        req = self.engine.requests[rid]
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        while not req.finished:
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                toks = [t for t in out.new_token_ids if not (out.finished and out.finish_reason == "stop"
                                                             and out.stop_reason is None and t in self.engine.eos_ids)]
                delta = detok.add(toks) if detok else ""
                if out.finished and detok:
                    delta += detok.flush()
                yield delta, out

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

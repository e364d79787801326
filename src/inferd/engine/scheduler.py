"""Which tokens of which requests run in the next step.

Every request is just "tokens known" (prompt + outputs) and "tokens whose K/V are computed";
a step computes up to `max_num_batched_tokens` of the difference across requests. Decodes are one
token each; a prompt is a run of tokens that may be split over several steps (chunked prefill); a
preempted request, having lost its blocks, simply has everything to recompute.

Order within a step: running decodes first (a long prompt never stalls streams), then running
requests still in prefill, then waiting requests in arrival order. When blocks run out, the most
recently arrived running request is preempted (recompute) and returns to the head of the queue.

`static` mode admits a batch of up to `max_num_seqs` only when nothing is running, and nothing
joins until the whole batch has finished — the baseline continuous batching is measured against.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from inferd.engine.kv_cache import BlockManager
from inferd.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt tokens computed for the first time
    num_recompute_tokens: int = 0  # tokens recomputed after a preemption
    num_decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    def __len__(self):
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 mode: str = "continuous"):
        assert mode in ("continuous", "static")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.mode = mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.static_batch: set[str] = set()
        self.max_loras = 0  # LoRA adapters a step may hold (0: the engine has none)
        self.tier = None  # KVTier (inferd.engine.kv_tier): prefix blocks to load instead of compute

    def add(self, req: Request):
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.tier is not None and self.tier.loading))

    def remove(self, req: Request):
        """Take a finished or aborted request out and give its blocks back."""
        if self.tier is not None and self.tier.cancel(req):
            return  # its load is writing into its blocks: the tier frees them when it ends
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.bm.free_request(req)
        self.static_batch.discard(req.request_id)

    def detach(self, req: Request):
        """Take a finished request out, keeping its blocks (a KV producer leases them)."""
        if req in self.running:
            self.running.remove(req)
        self.static_batch.discard(req.request_id)

    def _lora_fits(self, adapters: set) -> bool:
        """Bring the first waiting request whose adapter fits the step's slots (the base model's, one
        already running, or a free slot's) to the head of the queue; False if none does. Requests of
        other adapters keep their places and go once a slot frees (vLLM skips them the same way)."""
        if len(adapters) < self.max_loras:
            return True
        for i, req in enumerate(self.waiting):
            if req.lora is None or req.lora in adapters:
                if i:
                    del self.waiting[i]
                    self.waiting.appendleft(req)
                return True
        return False

    def _preempt(self, req: Request, batch: ScheduledBatch):
        if req in batch.requests:
            i = batch.requests.index(req)
            batch.requests.pop(i)
            batch.num_new.pop(i)
        self.running.remove(req)
        self.bm.free_request(req)
        req.num_computed = 0
        req.spec_tokens = []
        req.tier_tried = False
        req.status = Status.WAITING
        req.num_preemptions += 1
        req.timings.preempted.append(time.monotonic())
        batch.preempted.append(req)

    def _take_loaded(self):
        """Requests whose tier load ended go back to the head of the queue, holding their blocks,
        their computed length the blocks that loaded (the rest of the run is given back)."""
        bs = self.bm.block_size
        for req, first, n_ok in self.tier.finished_loads():
            keep = (first + n_ok) * bs
            self.bm.truncate(req, keep)
            req.num_computed = keep
            req.max_computed = max(req.max_computed, keep)
            req.tier_tokens += n_ok * bs
            req.prefix_hit_tokens += n_ok * bs
            self.bm.register_full_blocks(req)
            if not req.block_table:
                req.num_computed = 0
            self.waiting.appendleft(req)

    def _start_tier_load(self, req: Request, hit: int) -> bool | None:
        """After the pool's prefix match: if the tier holds the blocks that follow, allocate them and
        hand the request to the tier's I/O thread (True); None if it holds none; False if the pool
        is short (the caller gives the matched blocks back and waits)."""
        first = hit // self.bm.block_size
        k = self.tier.lookup(req, first)
        if not k:
            return None
        if not self.bm.allocate(req, k * self.bm.block_size):
            return False
        self.bm.count_admission(req, hit)
        req.tier_tried = True
        self.tier.start_load(req, first, k)
        return True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        if self.tier is not None and self.tier.loading:
            self._take_loaded()
        # decodes first, then requests still working through their prompt; arrival order within each
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed > 1, r.timings.arrived))
        for req in order:
            if budget == 0:
                break
            if req.status != Status.RUNNING:  # preempted earlier in this loop
                continue
            # speculative guesses ride along as extra tokens of the chunk; a short budget trims them
            n = min(req.num_tokens - req.num_computed + len(req.spec_tokens), budget)
            if req.spec_tokens:
                del req.spec_tokens[max(0, n - 1):]
            while not self.bm.allocate(req, n):
                victim = max(self.running, key=lambda r: r.timings.arrived)
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                continue
            batch.requests.append(req)
            batch.num_new.append(n)
            budget -= n
        budget = self.budget - sum(batch.num_new)

        if self.waiting and any(r.block_table for r in self.waiting):
            # requests whose prompt KV came from another engine hold their blocks already and need
            # none: they go first (stable: arrival order within each kind), or a request at the head
            # waiting for blocks they hold would wait forever
            self.waiting = deque(sorted(self.waiting, key=lambda r: not r.block_table))
        if self.mode == "static" and not self.static_batch:
            self.static_batch = {r.request_id for r in list(self.waiting)[: self.max_num_seqs]}
        # no new admissions in a step that had to preempt: memory is the bottleneck right now
        adapters = {r.lora for r in self.running if r.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            if self.max_loras and not self._lora_fits(adapters):
                break
            req = self.waiting[0]
            if self.mode == "static" and req.request_id not in self.static_batch:
                break
            # a request that arrives with blocks has its prompt KV from another engine (kv_transfer)
            prefilled = bool(req.block_table)
            hit = 0 if prefilled else self.bm.match_prefix(req)
            if self.tier is not None and not prefilled and not req.tier_tried and self.tier.serves(req):
                loading = self._start_tier_load(req, hit)
                if loading:
                    self.waiting.popleft()
                    continue
                if loading is False:
                    self.bm.free_request(req)
                    req.num_computed = 0
                    break
            n = min(req.num_tokens - req.num_computed, budget)
            if not self.bm.allocate(req, n):
                if not prefilled:
                    self.bm.free_request(req)  # give the matched blocks back; try again next step
                    req.num_computed = 0
                break
            if not prefilled and not req.tier_tried:  # a tier load that failed was counted when it began
                self.bm.count_admission(req, hit)
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = time.monotonic()
            self.running.append(req)
            if req.lora is not None:
                adapters.add(req.lora)
            batch.requests.append(req)
            batch.num_new.append(n)
            budget -= n
        for req in sorted(batch.preempted, key=lambda r: r.timings.arrived, reverse=True):
            self.waiting.appendleft(req)
        for req, n in zip(batch.requests, batch.num_new):
            # tokens below the request's high-water mark were computed before a preemption
            c = req.num_computed
            lo = max(c, req.max_computed)
            first_time = max(0, c + n - lo)
            prompt_part = max(0, min(c + n, req.num_prompt) - lo)
            batch.num_prefill_tokens += prompt_part
            batch.num_decode_tokens += first_time - prompt_part
            batch.num_recompute_tokens += n - first_time
        return batch

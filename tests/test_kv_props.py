"""Property-based tests: the real Scheduler + BlockManager driven by random add / step / abort /
finish sequences, with the model replaced by a simulator that applies each step's results the way
LLMEngine.step does (tokens drawn by hypothesis from a tiny vocabulary, so prefix hits are common).

Besides the BlockManager's own bookkeeping, a shadow KV pool records, for every slot written, the
KV group and token prefix whose K/V it would hold; every step then checks that each scheduled
request would read exactly its own prefix through each group's table (no two writers share a slot,
cached blocks hold what their key says, a window group holds every position its window shows).
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

from inferd.engine.kv_cache import BlockManager, first_visible_block  # noqa: E402
from inferd.engine.processor import kv_blocks_needed  # noqa: E402
from inferd.engine.request import Request, SamplingParams, Status  # noqa: E402
from inferd.engine.scheduler import Scheduler  # noqa: E402

VOCAB = 5
MAX_PROMPT = 60
tok = st.integers(0, VOCAB - 1)


class KVMachine(RuleBasedStateMachine):
    # -- setup ----------------------------------------------------------------------------------
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 16]),
        pool=st.one_of(st.integers(1, 4), st.integers(1, 12), st.integers(13, 40), st.just(400)),
        budget=st.one_of(st.integers(1, 8), st.integers(9, 64)),
        max_seqs=st.integers(1, 8),
        caching=st.booleans(),
        mode=st.sampled_from(["continuous", "static"]),
        # KV groups beside the full one: none (most models), a window group (Gemma), a full one too
        groups=st.sampled_from([(), (), (3,), (8,), (5, None), (2, 2)]),
        first=st.lists(st.tuples(st.integers(0, 1000), st.integers(0, MAX_PROMPT), st.lists(tok, max_size=MAX_PROMPT),
                                 st.integers(1, 16)), min_size=1, max_size=6),
    )
    def setup(self, block_size, pool, budget, max_seqs, caching, mode, groups, first):
        # room for at least 1 prompt + 1 output token in every group
        pool = max(pool, kv_blocks_needed(1, 1, 1, block_size, groups, budget))
        self.bs, self.budget, self.max_seqs, self.mode = block_size, budget, max_seqs, mode
        self.groups = groups
        self.bm = BlockManager(pool, block_size, enable_prefix_caching=caching, group_windows=groups)
        self.sched = Scheduler(self.bm, max_seqs, budget, mode)
        self.cap = pool * block_size  # the engine's admission check: ceil((prompt+max)/bs) <= pool
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.aborted: list[Request] = []
        self.history: list[list[int]] = []  # earlier requests' tokens, to draw shared prefixes from
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix held
        self.prefill_sum = self.decode_sum = self.recompute_sum = 0
        self.n_ids = 0
        self.static_batches: list[set[str]] = []
        self.gone: set[str] = set()
        for args in first:
            self.add(*args)

    # -- helpers --------------------------------------------------------------------------------
    def _leave(self, req: Request):
        self.sched.remove(req)
        self.live.remove(req)
        self.gone.add(req.request_id)

    def _step(self, toks: list[int], stops: list[int]) -> bool:
        """One engine step without a model. Returns whether anything was scheduled."""
        s, bm, bs = self.sched, self.bm, self.bs
        had_work = s.has_work()
        waiting_before = [r.request_id for r in s.waiting]
        running_before = list(s.running)
        hits, evictions, rhits = bm.hits, bm.evictions, bm.recompute_hits
        batch = s.schedule()
        for name, happened in [("preemption", batch.preempted), ("prefix hit", bm.hits > hits),
                               ("re-found own blocks after preemption", bm.recompute_hits > rhits),
                               ("eviction", bm.evictions > evictions), ("recompute", batch.num_recompute_tokens)]:
            if happened:
                event(name)

        # -- the batch itself
        assert len(batch.requests) == len(batch.num_new)
        assert len({id(r) for r in batch.requests}) == len(batch.requests)
        assert sum(batch.num_new) <= self.budget
        assert len(s.running) <= self.max_seqs
        assert batch.num_prefill_tokens + batch.num_decode_tokens + batch.num_recompute_tokens == batch.num_tokens
        for r, n in zip(batch.requests, batch.num_new):
            assert n >= 1
            assert r in s.running and r.status == Status.RUNNING
            assert r.num_computed + n <= r.num_tokens
            assert len(r.block_table) * bs >= r.num_computed + n, "blocks do not cover this step's tokens"
        for r in batch.preempted:
            assert r in s.waiting and r not in s.running and r not in batch.requests
            assert r.status == Status.WAITING and r.num_computed == 0 and not r.block_table
        # progress: every live request fits the pool on its own, so a step with work schedules some
        if had_work:
            assert batch.requests, f"livelock: nothing scheduled; running={running_before}, waiting={list(s.waiting)}"
        # static mode: a new batch forms only once every member of the previous one has left
        if self.mode == "static":
            cur = s.static_batch
            if cur and (not self.static_batches or not cur <= self.static_batches[-1]):
                if self.static_batches:
                    assert self.static_batches[-1] <= self.gone, "new static batch before the old one left"
                assert not running_before, "static batch re-formed while requests were running"
                assert len(cur) <= self.max_seqs and cur <= set(waiting_before)
                self.static_batches.append(set(cur))
                if len(self.static_batches) > 1:
                    event("static batch re-formed")
            assert {r.request_id for r in s.running} <= cur

        # -- "run the model": write K/V for the new tokens into every group's table, then every
        # request reads its context: all of it through the full groups, its windows through the others
        for r, n in zip(batch.requests, batch.num_new):
            assert len(r.kv_tables) == len(self.groups)
            for g, (table, w) in enumerate(self._tables(r)):
                # a window group holds nothing before what this step's first query sees
                first = first_visible_block(r.num_computed, w, bs)
                assert all(b == bm.NULL for b in table[:first]) and bm.NULL not in table[first:]
                ids = r.all_ids
                for p in range(r.num_computed, r.num_computed + n):
                    self.shadow[(table[p // bs], p % bs)] = (g, tuple(ids[: p + 1]))
        for r, n in zip(batch.requests, batch.num_new):
            ids = r.all_ids
            for g, (table, w) in enumerate(self._tables(r)):
                lo = 0 if w is None else max(0, r.num_computed - w + 1)
                for p in range(lo, r.num_computed + n):
                    got = self.shadow.get((table[p // bs], p % bs))
                    assert got == (g, tuple(ids[: p + 1])), f"{r.request_id} reads wrong K/V at {p} in group {g}"

        # -- apply results as LLMEngine.step does
        self.prefill_sum += batch.num_prefill_tokens
        self.decode_sum += batch.num_decode_tokens
        self.recompute_sum += batch.num_recompute_tokens
        done = []
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new)):
            r.num_computed += n
            r.max_computed = max(r.max_computed, r.num_computed)
            bm.register_full_blocks(r)
            if r.num_computed == r.num_tokens:
                r.output_ids.append(toks[i % len(toks)])
                if len(r.output_ids) >= r.params.max_tokens or stops[i % len(stops)] == 0:
                    r.status = Status.FINISHED
                    done.append(r)
        for r in done:
            self._leave(r)
            self.finished.append(r)
            self.history.append(r.all_ids)
        self.check()
        return bool(batch.requests)

    def _tables(self, r: Request):
        return [(r.block_table, None)] + list(zip(r.kv_tables, self.groups))

    # -- operations -----------------------------------------------------------------------------
    @rule(src=st.integers(0, 1000), keep=st.integers(0, MAX_PROMPT), suffix=st.lists(tok, max_size=MAX_PROMPT),
          max_tokens=st.integers(1, 16))
    def add(self, src, keep, suffix, max_tokens):
        pool = self.history + [r.all_ids for r in self.live]
        base = pool[src % len(pool)][:keep] if pool else []
        prompt = (base + suffix)[: min(MAX_PROMPT, self.cap - 1)] or [suffix[0] if suffix else 0]
        max_tokens = min(max_tokens, self.cap - len(prompt))

        def need():  # the engine's admission check (inferd.engine.processor.check_request)
            return kv_blocks_needed(len(prompt), max_tokens, 1, self.bs, self.groups, self.budget)

        while need() > self.bm.num_blocks and max_tokens > 1:
            max_tokens -= 1
        while need() > self.bm.num_blocks and len(prompt) > 1:
            prompt = prompt[:-1]
        assert need() <= self.bm.num_blocks
        req = Request(f"r{self.n_ids}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                      arrival=float(self.n_ids))
        self.n_ids += 1
        self.sched.add(req)
        self.live.append(req)
        self.history.append(list(prompt))

    @rule(toks=st.lists(tok, min_size=1, max_size=8), stops=st.lists(st.integers(0, 9), min_size=1, max_size=8),
          times=st.integers(1, 4))
    def step(self, toks, stops, times):
        for _ in range(times):
            self._step(toks, stops)

    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        if not self.live:
            return
        req = self.live[i % len(self.live)]
        self._leave(req)
        req.status = Status.FINISHED
        self.aborted.append(req)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def check(self):
        bm, s, bs = self.bm, self.sched, self.bs
        live = self.live
        assert set(map(id, live)) == set(map(id, list(s.waiting) + s.running))
        assert len(s.waiting) + len(s.running) == len(live)
        bm.check_invariants(live)
        assert all(c >= 0 for c in bm.ref)
        assert bm.num_free + bm.num_used == bm.num_blocks
        assert len(s.running) <= self.max_seqs
        for r in s.waiting:
            assert not r.block_table and not r.kv_tables and r.num_computed == 0 and r.status == Status.WAITING
        holders: dict[int, list[tuple[Request, int]]] = {}
        for r in s.running:
            assert r.status == Status.RUNNING
            assert len(r.block_table) * bs >= r.num_computed
            assert r.num_computed < r.num_tokens  # a computed tail always produced a token
            assert len(set(r.block_table)) == len(r.block_table), f"duplicate block in {r.request_id}"
            for g, (table, _) in enumerate(self._tables(r)):
                for i, b in enumerate(table):
                    if b == bm.NULL:
                        continue
                    holders.setdefault(b, []).append((r, i))
                    key = bm.key_of[b]
                    if key is not None and g == 0:  # a cached block holds exactly the tokens its key names
                        assert list(key[1]) == r.all_ids[i * bs:(i + 1) * bs]
                    elif key is not None:  # a window group's block: its group, the full chain's hash
                        assert key == ("group", g - 1, r.block_hashes[i])
        for b, hs in holders.items():
            if len(hs) > 1:
                event("shared block")  # only full, hashed prefix-cache blocks are shared
                assert bm.key_of[b] is not None and bm.cached.get(bm.key_of[b]) == b, f"block {b} shared: {hs}"
                assert len({i for _, i in hs}) == 1
                assert all((i + 1) * bs <= r.num_computed for r, i in hs)
        for r in self.finished + self.aborted:
            assert not r.block_table and not r.kv_tables

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        # termination: with no more arrivals, all work completes within a bounded number of steps
        bound = 10 + 4 * sum(r.num_prompt + r.params.max_tokens for r in self.live) ** 2
        steps = 0
        while self.sched.has_work():
            assert steps < bound, f"no termination after {steps} steps"
            self._step([1], [1])
            steps += 1
        assert not self.live
        bm.check_invariants([])
        assert bm.num_free == bm.num_blocks and all(c == 0 for c in bm.ref)
        assert bm.num_used == 0
        # counters: every prompt token of an admitted request is either a hit or prefilled once
        admitted = [r for r in self.finished + self.aborted if r.timings.first_scheduled is not None]
        assert bm.queries == sum(r.num_prompt for r in admitted)
        assert bm.hits == sum(r.prefix_hit_tokens for r in admitted)
        assert all(r.timings.first_scheduled is not None for r in self.finished)
        uncovered = sum(r.num_prompt - min(r.max_computed, r.num_prompt) for r in self.aborted
                        if r.timings.first_scheduled is not None)
        assert self.prefill_sum == bm.queries - bm.hits - uncovered
        if not self.aborted:
            assert self.prefill_sum == bm.queries - bm.hits
        # decode tokens: each output token but the last was computed once for the first time
        dec = sum(len(r.output_ids) - 1 for r in self.finished)
        dec += sum(max(0, r.max_computed - r.num_prompt) for r in self.aborted)
        assert self.decode_sum == dec
        if not bm.caching:
            assert bm.hits == 0 and not bm.cached


KVMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVProps = KVMachine.TestCase

"""SpecDecoder: speculative decoding inside the engine's continuous-batching step.

Per step: every running sequence that is decoding gets up to K proposed tokens (`propose`): the
proposer (proposal.py: prompt lookup, suffix decoding or a draft model, each behind the same
interface) returns a `Draft` per sequence, and the budget (budget.py) says how many of its guesses
to verify; the scheduler then treats [last token, d1..dk] as a k+1-token chunk at the sequence's
position (its blocks reserved, all k+1 counted against the token budget, fewer guesses when the
budget is short); the one target forward returns logits for all k+1 positions; `verify` applies the
request's own logit processors position by position (each position sees the history including the
guesses before it), accepts (greedy match or the lossless rejection rule), appends the tokens
through the engine's normal stop handling, and rolls the KV cache back to the accepted length. The
step never asks which method drafted: the proposer's hooks (`accepted`, `preempted`, `free`,
`keep_only`) keep its own state in step, the budget's (`verified`, `after_schedule`) its learning.

Rollback keeps the prefix cache right by construction: a block is registered only once the
request's computed length (the accepted one) covers it, so no block holding a rejected token is
ever findable; blocks allocated past the accepted length are returned at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from inferd.engine.request import Status
from inferd.engine.sampler import build_batch, process_logits, top_logprobs
from inferd.engine.speculative.budget import CostBudget, VerifyAll, measure_step_cost
from inferd.engine.speculative.draft import DraftProposer, SeqView
from inferd.engine.speculative.ngram import NgramProposer
from inferd.engine.speculative.proposal import Proposer
from inferd.engine.speculative.suffix import SuffixProposer
from inferd.engine.speculative.rejection import accept_greedy, rejection_sample
from inferd.errors import InferdError
from inferd.worker.spec_attention import SpecPagedAttention

COST_BUDGETED = {"suffix"}  # methods whose drafts the cost budget cuts; the others verify every guess


@dataclass
class SpecStats:
    num_drafts: int = 0  # sequence-steps that verified at least one proposed token
    num_draft_tokens: int = 0  # tokens proposed (and verified)
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + the target's own token, after stop truncation
    draft_time: float = 0.0
    verify_time: float = 0.0
    draft_forwards: int = 0
    num_skipped: int = 0  # sequence-steps with no lookup because of a backoff pause (ngram)
    # suffix decoding: where each proposed guess went
    num_proposed_tokens: int = 0  # guesses the proposer made (before the grammar and the cost model)
    num_grammar_cut_tokens: int = 0  # ... cut because the request's grammar forbids them
    num_cost_skipped_tokens: int = 0  # ... not verified because they did not pay for their rows
    num_cost_skipped_drafts: int = 0  # sequence-steps whose whole draft the cost model skipped
    num_budget_cut_tokens: int = 0  # ... chosen, then trimmed by a short token budget or not scheduled
    num_explored: int = 0  # ... verified anyway (one guess) to keep learning their acceptance
    num_cost_probes: int = 0  # drafts the cost model cut, verified whole to learn what the longer step costs
    num_cache_drafts: int = 0  # drafts taken from the shared cache of other requests' outputs
    num_verified_rows: int = 0  # rows of verify chunks: guesses + 1 each
    accepted_per_pos: list = field(default_factory=list)  # [j]: verify steps whose guess j was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_num_emitted_tokens": self.num_emitted_tokens,
                "spec_acceptance_rate": self.acceptance_rate, "spec_mean_accepted_length": self.mean_accepted_length,
                "spec_draft_time_s": self.draft_time, "spec_verify_time_s": self.verify_time,
                "spec_draft_forwards": self.draft_forwards, "spec_num_skipped": self.num_skipped,
                "spec_num_proposed_tokens": self.num_proposed_tokens,
                "spec_num_grammar_cut_tokens": self.num_grammar_cut_tokens,
                "spec_num_cost_skipped_tokens": self.num_cost_skipped_tokens,
                "spec_num_cost_skipped_drafts": self.num_cost_skipped_drafts, "spec_num_explored": self.num_explored,
                "spec_num_budget_cut_tokens": self.num_budget_cut_tokens, "spec_num_cost_probes": self.num_cost_probes,
                "spec_num_cache_drafts": self.num_cache_drafts, "spec_num_verified_rows": self.num_verified_rows,
                "spec_accepted_per_pos": list(self.accepted_per_pos)}


class SpecDecoder:
    def __init__(self, engine, draft_loaded=None):
        cfg = engine.config
        self.engine = engine
        self.method = cfg.speculative_method
        self.k = cfg.num_speculative_tokens
        self.stats = SpecStats()
        # the engine runs verify chunks (k + 1 tokens) through the decode kernel (SpecPagedAttention)
        if not isinstance(engine.runner.attn, SpecPagedAttention):
            raise InferdError("speculative decoding needs the engine's SpecPagedAttention")
        self.proposer = self._proposer(engine, draft_loaded)
        self.draft_desc = self.proposer.desc
        self.budget = VerifyAll()
        if self.method in COST_BUDGETED:
            self.budget = CostBudget(engine, self.stats, measure_step_cost(engine, self.k) if cfg.spec_cost_model
                                     else None)

    def _proposer(self, engine, draft_loaded) -> Proposer:
        cfg = engine.config
        if self.method == "draft":
            return DraftProposer.for_engine(engine, self.k, draft_loaded)
        if self.method == "suffix":
            return SuffixProposer(engine.model_config.vocab_size, cfg.suffix_max_tree_depth, cfg.suffix_max_spec_factor,
                                  cfg.suffix_min_token_prob, cfg.suffix_max_cached_requests,
                                  cfg.suffix_max_cached_tokens)
        return NgramProposer(cfg.ngram_min, cfg.ngram_max, cfg.ngram_backoff)

    @property
    def cost(self):
        """The budget's step-cost curve (cost.StepCost), None where none decides."""
        return self.budget.cost

    @cost.setter
    def cost(self, curve):
        self.budget.cost = curve

    @property
    def pending(self) -> dict:
        """rid -> (its draft, guesses chosen) of the guesses in flight that the budget learns from."""
        return self.budget.pending

    def release_finished(self):
        """What is kept for requests that finished, were aborted or preempted goes back at once (the
        proposer says what it keeps for a preempted request)."""
        alive = set(self.engine.requests)
        running = {r.request_id for r in self.engine.scheduler.running if r.status == Status.RUNNING}
        self.proposer.keep_only(running, alive)
        self.budget.keep_only(alive)

    # -- before scheduling ----------------------------------------------------------------------
    def propose(self, running):
        """Set req.spec_tokens (and req.spec_q) for every decoding sequence: the proposer's drafts,
        as much of each as the budget keeps."""
        t0 = time.monotonic()
        self.release_finished()
        cands, ks = self._candidates(running)
        if not cands:
            return
        drafts = self.proposer.propose(cands, ks)
        for r, d, k in zip(cands, drafts, self.budget.choose(running, cands, drafts)):
            if k:
                r.spec_tokens, r.spec_q = d.tokens[:k], d.q
        self.stats.draft_forwards = self.proposer.forwards
        self.stats.draft_time += time.monotonic() - t0

    def _candidates(self, running) -> tuple[list, list[int]]:
        """The decoding sequences that draft this step, and how many guesses each may have. Every
        running sequence's guesses are reset."""
        eng = self.engine
        cands, ks = [], []
        for r in running:
            r.spec_tokens, r.spec_q = [], None
            if r.status != Status.RUNNING or r.fork_into or r.num_tokens - r.num_computed != 1:
                continue
            # never guess past max_tokens or the context: k guesses can yield k + 1 tokens
            k = min(self.k, r.params.max_tokens - len(r.output_ids) - 1, eng.max_model_len - r.num_tokens)
            if k >= 1 and r.spec_skip > 0:
                r.spec_skip -= 1
                self.stats.num_skipped += 1
                continue
            if k >= 1:
                cands.append(r)
                ks.append(k)
        return cands, ks

    def observe_step(self, total: float, forward: float, rows: int):
        """A step's seconds in all and in its forward of `rows` rows (the budget's cost curve learns
        from them)."""
        self.budget.observe_step(total, forward, rows)

    def after_schedule(self, batch):
        """Guesses of sequences that were preempted or not scheduled are dropped."""
        scheduled = set(map(id, batch.requests))
        for r in self.engine.scheduler.running:
            if r.spec_tokens and id(r) not in scheduled:
                r.spec_tokens, r.spec_q = [], None
        for r in batch.preempted:
            r.spec_tokens, r.spec_q = [], None
            self.proposer.preempted(r.request_id)
        self.budget.after_schedule(self.engine.requests)

    # -- after the target forward ---------------------------------------------------------------
    def verify(self, items: list) -> list:
        """items: (request, logits [k+1, V]) for each sequence that verified guesses this step."""
        eng = self.engine
        vocab = eng.model_config.vocab_size
        views = [SeqView(r, r.spec_tokens[:j]) for r, _ in items for j in range(len(r.spec_tokens) + 1)]
        raw = torch.cat([lg for _, lg in items])
        b = build_batch(views, vocab, eng.eos_ids)
        if eng.structured is not None:  # the constraint at each verified position: a guess it forbids is rejected
            b.allowed = eng.constraint_masks([r for r, _ in items], [1 + len(r.spec_tokens) for r, _ in items])
        proc = process_logits(raw, b)
        outputs = []
        off = 0
        st = self.stats
        for req, lg in items:
            d = list(req.spec_tokens)
            k = len(d)
            P = proc[off:off + k + 1]
            off += k + 1
            if req.params.greedy:
                a, toks = accept_greedy(d, P.argmax(-1).tolist())
            else:
                q = req.spec_q[:k] if req.spec_q is not None else None
                a, toks = rejection_sample(P.softmax(-1), q, d, req.generator)
            lps = None
            if req.params.logprobs is not None:
                lps = top_logprobs(lg[:len(toks)], torch.tensor(toks), [req.params.logprobs] * len(toks))
            req.spec_tokens, req.spec_q = [], None
            L = req.num_tokens
            c = req.num_computed  # == L - 1: the last known token was part of the chunk
            out = eng.append_tokens(req, toks, lps)
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += a
            st.num_verified_rows += k + 1
            if len(st.accepted_per_pos) < k:
                st.accepted_per_pos.extend([0] * (k - len(st.accepted_per_pos)))
            for j in range(a):
                st.accepted_per_pos[j] += 1
            self.budget.verified(req.request_id, k, a)
            backoff = self.proposer.backoff
            if backoff:
                # a draft the model does not follow tends to keep failing: pause, 1, 2, 4 .. steps,
                # until a guess is kept
                req.spec_backoff = 0 if a else min(backoff, max(1, 2 * req.spec_backoff))
                req.spec_skip = req.spec_backoff
            st.num_emitted_tokens += len(out.new_token_ids)
            outputs.append(out)
            if req.finished:
                self.proposer.free(req.request_id)
                continue
            # K/V of the last known token and the accepted guesses is final; the rest is rolled back
            req.num_computed = c + 1 + a
            req.max_computed = max(req.max_computed, req.num_computed)
            eng.block_manager.truncate(req, req.num_computed)
            eng.block_manager.register_full_blocks(req)
            self.proposer.accepted(req.request_id, L + a)
        return outputs


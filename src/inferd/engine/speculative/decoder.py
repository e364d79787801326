"""SpecDecoder: speculative decoding inside the engine's continuous-batching step.

Per step: every running sequence that is decoding gets up to K proposed tokens (`propose`); the
scheduler then treats [last token, d1..dk] as a k+1-token chunk at the sequence's position (its
blocks reserved, all k+1 counted against the token budget, fewer guesses when the budget is
short); the one target forward returns logits for all k+1 positions; `verify` applies the
request's own logit processors position by position (each position sees the history including the
guesses before it), accepts (greedy match or the lossless rejection rule), appends the tokens
through the engine's normal stop handling, and rolls the KV cache back to the accepted length.

Rollback keeps the prefix cache right by construction: a block is registered only once the
request's computed length (the accepted one) covers it, so no block holding a rejected token is
ever findable; blocks allocated past the accepted length are returned at once.

Suffix decoding adds two decisions between proposing and scheduling: a constrained request's draft
is cut where its grammar forbids a token (that row could never be accepted), and the cost model
(cost.py) keeps of each draft only the guesses whose expected acceptance pays for their rows in
this step, as measured on this machine at start. Every guess proposed is counted where it went:
verified, cut by the grammar, or skipped by the cost model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from inferd.engine.request import Status
from inferd.engine.sampler import build_batch, process_logits, top_logprobs
from inferd.engine.speculative import cost as spec_cost
from inferd.engine.speculative.draft import DraftProposer, SeqView, parse_self_draft, self_draft_model
from inferd.engine.speculative.ngram import NgramProposer
from inferd.engine.speculative.suffix import SuffixProposer
from inferd.engine.speculative.rejection import accept_greedy, rejection_sample
from inferd.errors import InferdError
from inferd.model.config import attention_windows
from inferd.worker.runner import StepPlan
from inferd.worker.spec_attention import SpecPagedAttention

log = logging.getLogger("inferd")

EXPLORE_MIN, EXPLORE_MAX = 16, 256  # a skipped request verifies one guess after this many skipped drafts
PROBE_EVERY = 64  # steps with drafts between two drafts the cost model cut, verified whole


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
        self.n_min, self.n_max = cfg.ngram_min, cfg.ngram_max
        self.backoff = cfg.ngram_backoff if self.method == "ngram" else 0
        self.stats = SpecStats()
        self.draft_desc = None
        # the engine runs verify chunks (k + 1 tokens) through the decode kernel (SpecPagedAttention)
        if not isinstance(engine.runner.attn, SpecPagedAttention):
            raise InferdError("speculative decoding needs the engine's SpecPagedAttention")
        self.calibration = None  # suffix: acceptance learned from verification (cost.Calibration)
        self.cost = None  # suffix with the cost model: step seconds by rows (cost.StepCost)
        self.overhead = 0.0  # ... and a step's seconds outside its forward (observe_step)
        self.steps_since_probe = 0  # steps with drafts since a cut one was verified whole
        self.pending: dict[str, tuple] = {}  # rid -> (its draft, guesses chosen) of the guesses in flight
        self.explore: dict[str, list[int]] = {}  # rid -> [drafts skipped since its last verify, interval]
        if self.method == "draft":
            model = self._draft_model(engine, draft_loaded)
            mcfg = engine.model_config
            window = attention_windows(model.cfg, engine.max_model_len)
            # the same token capacity as the target's cache, plus room for every sequence's guesses
            blocks = engine.num_kv_blocks + cfg.max_num_seqs * (-(-self.k // cfg.block_size) + 1)
            self.proposer = DraftProposer(model, blocks, cfg.block_size, mcfg.vocab_size, engine.eos_ids, window)
        elif self.method == "suffix":
            self.proposer = SuffixProposer(engine.model_config.vocab_size, cfg.suffix_max_tree_depth,
                                           cfg.suffix_max_spec_factor, cfg.suffix_min_token_prob,
                                           cfg.suffix_max_cached_requests, cfg.suffix_max_cached_tokens)
            self.calibration = spec_cost.Calibration()
            if cfg.spec_cost_model:
                self.cost = self._measure(engine)
        else:
            self.proposer = NgramProposer(self.n_min, self.n_max)

    def _draft_model(self, engine, draft_loaded):
        cfg = engine.config
        vocab = engine.model_config.vocab_size
        if draft_loaded is not None:
            model = getattr(draft_loaded, "model", draft_loaded)  # a LoadedModel or the module
            self.draft_desc = "given model"
        else:
            n = parse_self_draft(cfg.draft_model)
            if n is not None:
                model = self_draft_model(engine.model, n, cfg.draft_quantization, cfg.quant_group_size)
                self.draft_desc = f"self, first {n} of {engine.model_config.num_hidden_layers} layers"
            else:
                from inferd.loading.loader import load_model

                lm = load_model(cfg.draft_model, dtype=str(engine.model.dtype).replace("torch.", ""),
                                device=cfg.device, with_tokenizer=False, quantization=cfg.draft_quantization,
                                quant_group_size=cfg.quant_group_size)
                model = lm.model
                self.draft_desc = lm.source.name
            if cfg.draft_quantization not in (None, "none"):
                self.draft_desc += f", {cfg.draft_quantization}"
        if model.cfg.vocab_size != vocab:
            raise InferdError(f"draft model vocabulary ({model.cfg.vocab_size} tokens) differs from the "
                              f"target's ({vocab}): speculative decoding needs the same vocabulary")
        return model

    def _measure(self, engine) -> spec_cost.StepCost | None:
        """Seconds of a step of R decode rows on this machine, R up to what a step can hold (every
        sequence with k + 1 rows, within the token budget): one row each at a context of up to 512
        tokens (attention's share of a row, as a chat's), through the runner as a step runs (fused or eager, every tensor-parallel rank). The
        K/V written land in free blocks, which any request writes before it reads; the runner's and
        the attention's path counters are put back, so that they count requests' steps only."""
        cfg = engine.config
        runner = engine.runner
        bs = cfg.block_size
        nb = max(1, min(engine.num_kv_blocks, -(-512 // bs)))
        ctx = nb * bs - 1
        table = list(range(nb))
        groups = engine.kv_layout.num_groups
        max_rows = max(2, min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (self.k + 1)))
        saved = _counters(runner)

        def run_rows(R: int):
            plan = StepPlan([0] * R, [table] * R, [ctx] * R, [1] * R, list(range(R)), list(range(R)),
                            kv_tables=[[table] * (groups - 1)] * R if runner.attn.layout is not None else None,
                            lora_slots=None)
            if runner.comm is not None:
                runner.comm.send_obj(plan)
            runner.run(plan)

        t0 = time.monotonic()
        try:
            cost = spec_cost.measure(run_rows, max_rows)
        except Exception as e:  # noqa: BLE001 - no curve: every draft is verified whole, and the log says so
            if runner.comm is not None:  # a rank out of step cannot be recovered from here
                raise
            log.warning("speculative cost model off: measuring the step cost failed (%s: %s); every draft is "
                        "verified whole", type(e).__name__, e)
            return None
        finally:
            _restore(runner, saved)
        log.info("speculative cost model: step seconds by rows measured in %.1f s (%s)", time.monotonic() - t0,
                 cost.describe())
        return cost

    def release_finished(self):
        """Draft caches of sequences that finished, were aborted or preempted go back at once. Suffix
        decoding keeps a preempted request's index (its tokens are final) until the request ends."""
        if self.method == "suffix":
            live = set(self.engine.requests)
        else:
            live = {r.request_id for r in self.engine.scheduler.running if r.status == Status.RUNNING}
        self.proposer.keep_only(live)
        if self.calibration is not None:
            for rid in [r for r in self.explore if r not in live]:
                del self.explore[rid]
            for rid in [r for r in self.calibration.requests if r not in live]:
                self.calibration.forget(rid)

    # -- before scheduling ----------------------------------------------------------------------
    def propose(self, running):
        """Set req.spec_tokens (and req.spec_q) for every decoding sequence."""
        t0 = time.monotonic()
        eng = self.engine
        self.release_finished()
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
        if not cands:
            return
        if self.method == "suffix":
            self._propose_suffix(running, cands, ks)
        else:
            for r, (toks, q) in zip(cands, self.proposer.propose(cands, ks)):
                r.spec_tokens, r.spec_q = toks, q
        self.stats.draft_forwards = self.proposer.forwards
        self.stats.draft_time += time.monotonic() - t0

    def _propose_suffix(self, running, cands, ks):
        st = self.stats
        live = []
        for r, d in zip(cands, self.proposer.propose(cands, ks)):
            if d is None:
                continue
            st.num_proposed_tokens += len(d.tokens)
            if r.matcher is not None:
                n = r.matcher.validate_tokens(d.tokens)
                if n < len(d.tokens):
                    st.num_grammar_cut_tokens += len(d.tokens) - n
                    del d.tokens[n:], d.probs[n:], d.support[n:]
                if not n:
                    continue
            st.num_cache_drafts += d.source == "cache"
            live.append((r, d))
        if not live:
            return
        cal = self.calibration
        expected = [cal.expected(r.request_id, d) for r, d in live]
        if self.cost is not None:
            rows, tokens = self._base_rows(running)
            lengths = spec_cost.choose_lengths(expected, rows, tokens, self._step_seconds)
        else:
            lengths = [len(d.tokens) for _, d in live]
        if self.cost is not None:
            self.steps_since_probe += 1
            cut = [i for i, ((_, d), k) in enumerate(zip(live, lengths)) if k and k < len(d.tokens)]
            if cut and self.steps_since_probe >= PROBE_EVERY:
                # now and then a draft the cost model cut short is verified whole: the curve learns
                # what the longer step really costs (it is only corrected where steps run)
                i = max(cut, key=lambda j: len(live[j][1].tokens) - lengths[j])
                lengths[i] = len(live[i][1].tokens)
                self.steps_since_probe = 0
                st.num_cost_probes += 1
        for (r, d), k in zip(live, lengths):
            if k == 0:
                k = self._explore(r.request_id)
            if k < len(d.tokens):
                st.num_cost_skipped_tokens += len(d.tokens) - k
                st.num_cost_skipped_drafts += k == 0
            if k:
                r.spec_tokens = d.tokens[:k]
                self.pending[r.request_id] = (d, k)

    def observe_step(self, total: float, forward: float, rows: int):
        """A step's seconds in all and in its forward of `rows` rows: the forward corrects the cost
        curve where it ran; what a step costs beside its rows (scheduling, sampling, verifying,
        detokenizing) is paid once a step however many tokens it yields, so it counts toward what a
        guess saves (a running average)."""
        if self.cost is not None:
            self.cost.observe(rows, forward)
            self.overhead = 0.9 * self.overhead + 0.1 * max(0.0, total - forward)

    def _step_seconds(self, rows: float) -> float:
        return self.cost(rows) + self.overhead

    def _explore(self, rid: str) -> int:
        """A request whose drafts the cost model keeps skipping verifies one guess now and then, so
        that its acceptance (and the table's) keeps being learned; the pauses double while those
        guesses fail (16 .. 256 drafts) and shrink back once one is accepted."""
        ex = self.explore.setdefault(rid, [0, EXPLORE_MIN])
        ex[0] += 1
        if ex[0] < ex[1]:
            return 0
        ex[0] = 0
        self.stats.num_explored += 1
        return 1

    def _base_rows(self, running) -> tuple[int, int]:
        """(rows, sampled sequences) of this step before any guess: a row per decoding sequence, and
        the prompt tokens waiting, as far as the token budget goes."""
        decode = prefill = 0
        for r in running:
            left = r.num_tokens - r.num_computed
            if r.status == Status.RUNNING and left == 1:
                decode += 1
            elif left > 0:
                prefill += left
        prefill += sum(r.num_tokens - r.num_computed for r in self.engine.scheduler.waiting)
        return max(1, min(self.engine.config.max_num_batched_tokens, decode + prefill)), max(decode, 1)

    def after_schedule(self, batch):
        """Guesses of sequences that were preempted or not scheduled are dropped."""
        scheduled = set(map(id, batch.requests))
        for r in self.engine.scheduler.running:
            if r.spec_tokens and id(r) not in scheduled:
                r.spec_tokens, r.spec_q = [], None
        for r in batch.preempted:
            r.spec_tokens, r.spec_q = [], None
            if self.method != "suffix":
                self.proposer.free(r.request_id)
        for rid, (_, chosen) in list(self.pending.items()):
            req = self.engine.requests.get(rid)
            left = len(req.spec_tokens) if req is not None else 0
            # the scheduler trims guesses a short token budget cannot hold (or drops an unscheduled
            # sequence's): counted, so that every proposed guess is accounted for
            self.stats.num_budget_cut_tokens += chosen - left
            if not left:
                del self.pending[rid]

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
            info = self.pending.pop(req.request_id, None)
            if info is not None:
                self.calibration.update(req.request_id, info[0], k, a)
                ex = self.explore.get(req.request_id)
                if ex is not None:  # an explored guess: pauses shrink once one is accepted, else grow
                    ex[1] = EXPLORE_MIN if a else min(EXPLORE_MAX, 2 * ex[1])
            if self.backoff:
                # a lookup whose continuation the model does not follow tends to keep failing (it
                # paraphrases instead of copying): pause, 1, 2, 4 .. steps, until a guess is kept
                req.spec_backoff = 0 if a else min(self.backoff, max(1, 2 * req.spec_backoff))
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
            self.proposer.rollback(req.request_id, L + a)
        return outputs


_COUNTERS = (("runner", "fused_steps"), ("runner", "eager_decode_steps"), ("runner", "lora_fused_steps"),
             ("runner", "lora_eager_steps"), ("attn", "kernel_calls"), ("fused", "steps"), ("fused", "max_rows"))


def _counters(runner) -> dict:
    """The path counters a measured step moves (the dashboard and the benchmarks' records read them)."""
    objs = {"runner": runner, "attn": runner.attn, "fused": runner.fused}
    out = {}
    for o, name in _COUNTERS:
        obj = objs[o]
        if obj is not None and hasattr(obj, name):
            out[(o, name)] = getattr(obj, name)
    lora = getattr(runner, "lora", None)
    if lora is not None:
        out[("lora", "lora_steps")] = lora.lora_steps
        out[("lora", "multi_adapter_steps")] = lora.multi_adapter_steps
    return out


def _restore(runner, saved: dict):
    objs = {"runner": runner, "attn": runner.attn, "fused": runner.fused, "lora": getattr(runner, "lora", None)}
    for (o, name), v in saved.items():
        setattr(objs[o], name, v)

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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from inferd.engine.request import Status
from inferd.engine.sampler import build_batch, process_logits, top_logprobs
from inferd.engine.speculative.draft import DraftProposer, SeqView, parse_self_draft, self_draft_model
from inferd.engine.speculative.ngram import NgramProposer
from inferd.engine.speculative.rejection import accept_greedy, rejection_sample
from inferd.errors import InferdError
from inferd.model.config import attention_windows
from inferd.worker.spec_attention import SpecPagedAttention


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
                "spec_draft_forwards": self.draft_forwards, "spec_num_skipped": self.num_skipped}


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
        if self.method == "draft":
            model = self._draft_model(engine, draft_loaded)
            mcfg = engine.model_config
            window = attention_windows(model.cfg, engine.max_model_len)
            # the same token capacity as the target's cache, plus room for every sequence's guesses
            blocks = engine.num_kv_blocks + cfg.max_num_seqs * (-(-self.k // cfg.block_size) + 1)
            self.proposer = DraftProposer(model, blocks, cfg.block_size, mcfg.vocab_size, engine.eos_ids, window)
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

    def release_finished(self):
        """Draft caches of sequences that finished, were aborted or preempted go back at once."""
        self.proposer.keep_only({r.request_id for r in self.engine.scheduler.running if r.status == Status.RUNNING})

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
        for r, (toks, q) in zip(cands, self.proposer.propose(cands, ks)):
            r.spec_tokens, r.spec_q = toks, q
        self.stats.draft_forwards = self.proposer.forwards
        self.stats.draft_time += time.monotonic() - t0

    def after_schedule(self, batch):
        """Guesses of sequences that were preempted or not scheduled are dropped."""
        scheduled = set(map(id, batch.requests))
        for r in self.engine.scheduler.running:
            if r.spec_tokens and id(r) not in scheduled:
                r.spec_tokens, r.spec_q = [], None
        for r in batch.preempted:
            r.spec_tokens, r.spec_q = [], None
            self.proposer.free(r.request_id)

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

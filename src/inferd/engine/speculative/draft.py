"""Draft-model proposals: a smaller model with the target's vocabulary guesses K tokens ahead.

The draft keeps its own paged KV cache (own pool, own BlockManager, no prefix caching) so that
each step only feeds it what changed since the last one: the tokens the target accepted (plus the
token it chose itself) as one catch-up chunk, then K-1 single-token steps for the guesses. After
verification its cache is cut back to the longest prefix that still matches the sequence.

Self-draft (`self:layers=N`): the target's own embedding, first N decoder layers, final norm and
head, as a second module object over the same weights (nothing copied), the layer-skip idea of
early-exit drafting. With `draft_quantization` those N layers are copied and quantized instead.
"""
from __future__ import annotations

import copy
import dataclasses
import re

import torch
from torch import nn

from inferd.engine.kv_cache import BlockManager
from inferd.engine.sampler import build_batch, categorical, process_logits
from inferd.engine.speculative.proposal import Draft, Proposer
from inferd.errors import InferdError
from inferd.model.config import attention_scale, attention_windows
from inferd.worker.kv_pool import KVPool
from inferd.worker.spec_attention import SpecPagedAttention


class DraftSeq:
    """The draft cache's view of one sequence (duck-types the Request fields BlockManager uses)."""
    __slots__ = ("num_computed", "block_table", "kv_tables", "block_hashes", "num_cached_hashed")

    def __init__(self):
        self.num_computed = 0
        self.block_table: list[int] = []
        self.kv_tables: list[list[int]] = []  # one KV group: the draft's pool keeps every layer's blocks
        self.block_hashes: list[int] = []
        self.num_cached_hashed = 0


class SeqView:
    """What the sampling functions read from a request, with speculative tokens appended to its
    output: the processors at verified position j must see the history up to that position."""
    __slots__ = ("prompt_ids", "output_ids", "params", "generator")

    def __init__(self, req, extra: list[int], generator=None):
        self.prompt_ids = req.prompt_ids
        self.output_ids = req.output_ids + list(extra) if extra else req.output_ids
        self.params = req.params
        self.generator = generator if generator is not None else req.generator


def parse_self_draft(spec: str) -> int | None:
    """'self:layers=N' -> N; None for a path."""
    if not spec.startswith("self"):
        return None
    m = re.fullmatch(r"self:layers=(\d+)", spec)
    if not m:
        raise InferdError(f"cannot read draft model {spec!r}: the self-draft form is self:layers=N")
    return int(m.group(1))


def self_draft_model(model: nn.Module, num_layers: int, quantization: str = "none", group_size: int = 32):
    """The target's first `num_layers` layers with its embedding, norm and head, as another module
    object over the same tensors (a shallow copy with its own submodule table)."""
    total = len(model.layers)
    if not 1 <= num_layers <= total:
        raise InferdError(f"self-draft layers={num_layers} is out of range: the model has {total} layers")
    d = copy.copy(model)
    d._modules = dict(model._modules)
    d._parameters = dict(model._parameters)
    d._buffers = dict(model._buffers)
    layers = list(model.layers[:num_layers])
    if quantization not in (None, "none"):
        if not all(isinstance(getattr(layer, "qkv_proj", None), nn.Linear) for layer in layers):
            raise InferdError("--draft-quantization of a self-draft needs an unquantized target model")
        layers = [copy.deepcopy(layer) for layer in layers]
    d._modules["layers"] = nn.ModuleList(layers)
    d.cfg = dataclasses.replace(model.cfg, num_hidden_layers=num_layers)
    if quantization not in (None, "none"):
        from inferd.quant import quantize

        quantize(d, quantization, group_size)
    return d


def load_draft_model(engine, draft_loaded=None) -> tuple[nn.Module, str]:
    """The engine's draft model (the one given, the target's first layers, or a model path), and what
    it is, for the log."""
    cfg = engine.config
    vocab = engine.model_config.vocab_size
    if draft_loaded is not None:
        model = getattr(draft_loaded, "model", draft_loaded)  # a LoadedModel or the module
        desc = "given model"
    else:
        n = parse_self_draft(cfg.draft_model)
        if n is not None:
            model = self_draft_model(engine.model, n, cfg.draft_quantization, cfg.quant_group_size)
            desc = f"self, first {n} of {engine.model_config.num_hidden_layers} layers"
        else:
            from inferd.loading.loader import load_model

            lm = load_model(cfg.draft_model, dtype=str(engine.model.dtype).replace("torch.", ""),
                            device=cfg.device, with_tokenizer=False, quantization=cfg.draft_quantization,
                            quant_group_size=cfg.quant_group_size)
            model = lm.model
            desc = lm.source.name
        if cfg.draft_quantization not in (None, "none"):
            desc += f", {cfg.draft_quantization}"
    if model.cfg.vocab_size != vocab:
        raise InferdError(f"draft model vocabulary ({model.cfg.vocab_size} tokens) differs from the "
                          f"target's ({vocab}): speculative decoding needs the same vocabulary")
    return model, desc


class DraftProposer(Proposer):
    @classmethod
    def for_engine(cls, engine, k: int, draft_loaded=None) -> DraftProposer:
        """The engine's draft model with a cache of the target's token capacity, plus room for every
        sequence's k guesses."""
        cfg = engine.config
        model, desc = load_draft_model(engine, draft_loaded)
        window = attention_windows(model.cfg, engine.max_model_len)
        blocks = engine.num_kv_blocks + cfg.max_num_seqs * (-(-k // cfg.block_size) + 1)
        prop = cls(model, blocks, cfg.block_size, engine.model_config.vocab_size, engine.eos_ids, window)
        prop.desc = desc
        return prop

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, vocab: int, eos_ids: set[int],
                 sliding_window: int | None = None):
        cfg = model.cfg
        self.model = model
        self.vocab = vocab
        self.eos_ids = eos_ids
        pool = KVPool(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                      model.dtype, model.device)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.attn = SpecPagedAttention(pool, cfg.head_dim, sliding_window, scale=attention_scale(cfg),
                                       softcap=cfg.attn_logit_softcapping)
        self.seqs: dict[str, DraftSeq] = {}
        self.forwards = 0

    # -- bookkeeping ------------------------------------------------------------------------------
    def free(self, rid: str):
        ds = self.seqs.pop(rid, None)
        if ds is not None:
            self.bm.free_request(ds)

    def preempted(self, rid: str):
        self.free(rid)  # its blocks are the draft pool's: they go back as the target's do

    def keep_only(self, running: set[str], alive: set[str]):
        for rid in [r for r in self.seqs if r not in running]:
            self.free(rid)

    def accepted(self, rid: str, valid: int):
        """The draft's K/V beyond the sequence's first `valid` tokens is stale: cut back."""
        ds = self.seqs.get(rid)
        if ds is not None and ds.num_computed > valid:
            ds.num_computed = valid
            self.bm.truncate(ds, valid)

    # -- proposing --------------------------------------------------------------------------------
    def _forward(self, seqs: list[DraftSeq], chunks: list[list[int]]) -> torch.Tensor:
        """Feed each sequence its chunk at its current position; logits of each chunk's last token."""
        lens = [len(c) for c in chunks]
        pos = self.attn.prepare([s.block_table for s in seqs], [s.num_computed for s in seqs], lens)
        dev = self.model.device
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=dev)
        hidden = self.model(ids, pos.to(dev), self.attn)
        last = torch.tensor(lens).cumsum(0) - 1
        for s, n in zip(seqs, lens):
            s.num_computed += n
        self.forwards += 1
        return self.model.compute_logits(hidden[last.to(dev)])

    def _sample(self, reqs, drafts, logits: torch.Tensor):
        """Draft tokens from the same processors the target uses (so q is close to p), drawn with
        the request's draft generator; returns tokens and the probabilities they were drawn from."""
        views = [SeqView(r, d, r.draft_generator) for r, d in zip(reqs, drafts)]
        b = build_batch(views, self.vocab, self.eos_ids)
        proc = process_logits(logits, b)
        toks = proc.argmax(-1)
        probs = [None] * len(reqs)
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rand:
            pr = proc[rand].softmax(-1)
            toks[rand] = categorical(pr, [reqs[i].draft_generator for i in rand])
            for j, i in enumerate(rand):
                probs[i] = pr[j]
        return toks.tolist(), probs

    @torch.inference_mode()
    def propose(self, reqs, ks: list[int]) -> list[Draft | None]:
        """For each request, up to ks[i] draft tokens and their [k, V] draw distributions (`Draft.q`,
        None for greedy requests). A sequence the draft cache has no room for gets no proposal."""
        out: list[Draft | None] = [None] * len(reqs)
        act, seqs, chunks = [], [], []
        for i, (r, k) in enumerate(zip(reqs, ks)):
            ds = self.seqs.get(r.request_id) or DraftSeq()
            L = r.num_tokens
            if ds.num_computed >= L:  # proposed last step but never verified: redo the last token
                ds.num_computed = L - 1
                self.bm.truncate(ds, L - 1)
            chunk = r.all_ids[ds.num_computed:L] if ds.num_computed < L else []
            if not chunk or not self.bm.allocate(ds, len(chunk) + k - 1):
                self.bm.free_request(ds)
                self.seqs.pop(r.request_id, None)
                continue
            self.seqs[r.request_id] = ds
            if r.draft_generator is None and not r.params.greedy:
                g = torch.Generator()
                if r.params.seed is not None:
                    g.manual_seed((r.params.seed + r.index) ^ 0x5DEECE66D)
                else:
                    g.seed()
                r.draft_generator = g
            act.append(i)
            seqs.append(ds)
            chunks.append(chunk)
        if not act:
            return out
        drafts = {i: [] for i in act}
        qs = {i: [] for i in act}
        live = act
        feed = chunks
        step = 0
        while live:
            logits = self._forward([self.seqs[reqs[i].request_id] for i in live], feed)
            toks, probs = self._sample([reqs[i] for i in live], [drafts[i] for i in live], logits)
            step += 1
            for i, t, p in zip(live, toks, probs):
                drafts[i].append(t)
                qs[i].append(p)
            live = [i for i in live if len(drafts[i]) < ks[i]]
            feed = [[drafts[i][-1]] for i in live]
        for i in act:
            q = None if reqs[i].params.greedy else torch.stack(qs[i])
            out[i] = Draft(drafts[i], q=q)
        return out

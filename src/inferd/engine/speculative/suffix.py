"""Suffix decoding: guesses from what this request and earlier requests already wrote.

Agents quote tool output back, edits copy most of a file, JSON echoes its input, and a model given
the same kind of task twice tends to answer in the same words. Prompt lookup (ngram.py) continues
the latest earlier occurrence of the last few tokens in the request itself. Suffix decoding (the
idea of Snowflake's ArcticInference, vLLM's method "suffix") looks in two places:

  * the request's own prompt and output;
  * a cache shared by requests: earlier and concurrent requests' outputs, one namespace per LoRA
    adapter and cache_salt, bounded in tokens and in requests, least recently used dropped first
    (`SuffixCache`).

In each it finds the occurrences of the longest context (up to `max_depth` tokens) that ends the
sequence, and walks forward along the continuation most of them share: a guess's probability is
the share of the occurrences still agreeing that continue with it. The walk stops where the running
product of those shares falls below `min_prob`, or at `spec_factor` x the context's length; of the
two places the draft with the higher score (its expected accepted length under those shares) wins.

Where a suffix tree keeps every suffix as a path, this keeps each sequence once and an index of
where each run of three (and of two) tokens ends: two entries per token whatever the text, the
sequences themselves are the paths, and dropping a sequence removes exactly its entries. A lookup
reads the newest `CANDIDATES` places the last three tokens (else two) occurred, measures how far
back each agrees with the context, and keeps the longest; the places that continued last step's
draft are looked at too, so a long copy keeps its source however common its last tokens are. Where
the model strays from a copy (skips or adds a few tokens, writes a renamed word), the copy goes on
at once from the source's nearest occurrence of its last token, or past the replaced token (an edit
draft, its acceptance learned apart), instead of waiting for two tokens of new context to match.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

from inferd.engine.speculative.proposal import Draft, Proposer

CANDIDATES = 64  # newest occurrences of the last tokens read per lookup
FOLLOW = 8  # occurrences carried from one step's draft to the next lookup
EDIT_OVER = 4  # an edit draft is taken over a fresh lookup whose context is shorter than this
NEAR = 8  # how far from where a copy would be its realigning token is looked for


class TokenIndex:
    """Token sequences by id and, for each position, an entry under the run of two and of three
    tokens ending there: (sequence id << 32) | the position after the run."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.seqs: dict[int, array] = {}
        self.sid_of: dict[int, int] = {}  # id(sequence) -> its id
        self.bi: dict[int, array] = {}
        self.tri: dict[int, array] = {}
        self.num_tokens = 0

    def extend(self, sid: int, tokens) -> None:
        seq = self.seqs.get(sid)
        if seq is None:
            seq = self.seqs[sid] = array("i")
            self.sid_of[id(seq)] = sid
        n0 = len(seq)
        seq.extend(tokens)
        self.num_tokens += len(seq) - n0
        V, base, bi, tri = self.vocab, sid << 32, self.bi, self.tri
        for i in range(max(n0, 1), len(seq)):
            e = base | (i + 1)
            k2 = seq[i - 1] * V + seq[i]
            lst = bi.get(k2)
            if lst is None:
                bi[k2] = array("q", (e,))
            else:
                lst.append(e)
            if i >= 2:
                k3 = seq[i - 2] * V * V + k2
                lst = tri.get(k3)
                if lst is None:
                    tri[k3] = array("q", (e,))
                else:
                    lst.append(e)

    def drop(self, sid: int) -> int:
        """Remove a sequence and its entries; -> its length."""
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return 0
        del self.sid_of[id(seq)]
        V, base = self.vocab, sid << 32
        for i in range(1, len(seq)):
            e = base | (i + 1)
            k2 = seq[i - 1] * V + seq[i]
            _remove(self.bi, k2, e)
            if i >= 2:
                _remove(self.tri, seq[i - 2] * V * V + k2, e)
        self.num_tokens -= len(seq)
        return len(seq)

    def num_entries(self) -> int:
        return sum(len(a) for a in self.bi.values()) + sum(len(a) for a in self.tri.values())

    def candidates(self, ctx, skip: int | None = None, limit: int = CANDIDATES) -> list[tuple[array, int]]:
        """(sequence, position after the occurrence) for the newest places the last three tokens of
        ctx (else its last two) occur with at least one token after them."""
        n = len(ctx)
        if n < 2:
            return []
        V = self.vocab
        k2 = ctx[n - 2] * V + ctx[n - 1]
        lst = self.tri.get(ctx[n - 3] * V * V + k2) if n >= 3 else None
        if not lst:
            lst = self.bi.get(k2)
            if not lst:
                return []
        out = []
        seqs = self.seqs
        for j in range(len(lst) - 1, -1, -1):
            e = lst[j]
            sid = e >> 32
            if sid == skip:
                continue
            seq = seqs[sid]
            p = e & 0xFFFFFFFF
            if p < len(seq):
                out.append((seq, p))
                if len(out) >= limit:
                    break
        return out


def _remove(index: dict, key: int, e: int) -> None:
    lst = index[key]
    if len(lst) == 1:
        del index[key]
    else:
        lst.remove(e)


def context_len(seq, p: int, ctx, cap: int) -> int:
    """How many tokens before position p of seq equal the last tokens of ctx (at most cap)."""
    n = len(ctx)
    cap = min(cap, p, n)
    m = 0
    while m < cap and seq[p - 1 - m] == ctx[n - 1 - m]:
        m += 1
    return m


def near(seq, at: int, tok: int, window: int = NEAR) -> int | None:
    """The position after the occurrence of tok in seq closest to `at` (within `window`, ahead
    first at equal distance), or None."""
    n = len(seq)
    for d in range(window + 1):
        for x in (at + d, at - d) if d else (at,):
            if 0 <= x < n - 1 and seq[x] == tok:
                return x + 1
    return None


def longest(cands, ctx, max_depth: int) -> tuple[int, list]:
    """The longest context any candidate shares with ctx, and the candidates that share it (each
    place once)."""
    best, occ = 0, []
    seen = set()
    for seq, p in cands:
        key = (id(seq), p)
        if key in seen:
            continue
        seen.add(key)
        m = context_len(seq, p, ctx, max_depth)
        if m > best:
            best, occ = m, [(seq, p)]
        elif m == best and m:
            occ.append((seq, p))
    return best, occ


def walk(occ: list, max_len: int, min_prob: float) -> tuple[list[int], list[float], list[int], float, list]:
    """Follow the continuation most occurrences share: -> tokens, shares, supports, score, and the
    occurrences that agree with the whole draft."""
    toks: list[int] = []
    probs: list[float] = []
    support: list[int] = []
    cum, score = 1.0, 0.0
    live = occ
    while len(toks) < max_len and live:
        if len(live) == 1:  # one place: its continuation, share 1 all the way
            seq, p = live[0]
            j = len(toks)
            run = seq[p + j:p + max_len]
            toks.extend(run)
            probs.extend([1.0] * len(run))
            support.extend([1] * len(run))
            score += len(run) * cum
            break
        j = len(toks)
        counts: dict[int, int] = {}
        for seq, p in live:  # newest first: a tie goes to the newest occurrence
            if p + j < len(seq):
                t = seq[p + j]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        total = sum(counts.values())
        tok, c = max(counts.items(), key=lambda kv: kv[1])
        share = c / total
        if cum * share < min_prob:
            break
        cum *= share
        score += cum
        toks.append(tok)
        probs.append(share)
        support.append(total)
        if c != len(live):
            live = [(seq, p) for seq, p in live if p + j < len(seq) and seq[p + j] == tok]
    return toks, probs, support, score, live[:FOLLOW]


class SuffixCache:
    """Outputs of earlier and running requests, shared for drafting: one TokenIndex per namespace
    (LoRA adapter, cache_salt), at most `max_tokens` tokens and `max_requests` sequences over all of
    them; the least recently used sequence (written to, or drafted from) is dropped first."""

    def __init__(self, vocab: int, max_requests: int, max_tokens: int):
        self.vocab = vocab
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.spaces: dict[tuple, TokenIndex] = {}
        self.members: dict[tuple, int] = {}  # sequences of each namespace
        self.lru: OrderedDict[int, tuple] = OrderedDict()  # sid -> namespace
        self.num_tokens = 0
        self.evicted = 0  # sequences dropped for the bounds
        self._next = 1

    def new_seq(self, namespace: tuple) -> int:
        sid = self._next
        self._next += 1
        self.lru[sid] = namespace
        self.spaces.setdefault(namespace, TokenIndex(self.vocab))
        self.members[namespace] = self.members.get(namespace, 0) + 1
        self._evict()
        return sid

    def extend(self, sid: int, tokens) -> None:
        ns = self.lru.get(sid)
        if ns is None or not len(tokens):  # dropped already: the rest of it is not kept either
            return
        idx = self.spaces[ns]
        before = idx.num_tokens
        idx.extend(sid, tokens)
        self.num_tokens += idx.num_tokens - before
        self.lru.move_to_end(sid)
        self._evict()

    def touch(self, sids) -> None:
        for sid in sids:
            if sid in self.lru:
                self.lru.move_to_end(sid)

    def index(self, namespace: tuple) -> TokenIndex | None:
        return self.spaces.get(namespace)

    def alive(self, sid: int) -> bool:
        return sid in self.lru

    def _evict(self) -> None:
        while self.lru and (self.num_tokens > self.max_tokens or len(self.lru) > self.max_requests):
            sid, ns = self.lru.popitem(last=False)
            self.num_tokens -= self.spaces[ns].drop(sid)
            self.evicted += 1
            self.members[ns] -= 1
            if not self.members[ns]:
                del self.members[ns], self.spaces[ns]

    def num_entries(self) -> int:
        return sum(idx.num_entries() for idx in self.spaces.values())


class _Seq:
    """A request as the proposer sees it: its own index (prompt and output), its sequence in the
    shared cache (None: not shared), the occurrences that continued its last draft."""
    __slots__ = ("req", "index", "sid", "namespace", "follow", "follow_len", "follow_match", "follow_edit")

    def __init__(self, req, vocab: int):
        self.req = req
        self.index = TokenIndex(vocab)
        self.sid: int | None = None
        self.namespace: tuple | None = None
        self.follow: list = []
        self.follow_len = 0  # the sequence's length when `follow` was taken
        self.follow_match = 0  # ... the context length of the draft it came from
        self.follow_edit = False  # ... and whether that draft was an edit's


def namespace_of(req) -> tuple | None:
    """Whose outputs a request may draft from and adds to: None when it opted out."""
    p = req.params
    if not getattr(p, "suffix_cache", True):
        return None
    return (getattr(req, "lora", None), getattr(p, "cache_salt", None))


class SuffixProposer(Proposer):
    """Suffix decoding as a proposer. Drafts are deterministic (q one-hot), so sampling verifies
    them as prompt lookup's. Only accepted tokens are ever indexed (each lookup first indexes what
    the request wrote since the last), so nothing is rolled back; a preempted request keeps its
    index (its tokens are final) until it is done."""

    def __init__(self, vocab: int, max_depth: int = 24, spec_factor: float = 1.0, min_prob: float = 0.1,
                 max_cached_requests: int = 10000, max_cached_tokens: int = 1 << 18):
        self.vocab = vocab
        self.max_depth, self.spec_factor, self.min_prob = max_depth, spec_factor, min_prob
        self.cache = SuffixCache(vocab, max_cached_requests, max_cached_tokens) if max_cached_requests > 0 else None
        self.seqs: dict[str, _Seq] = {}
        self.forwards = 0  # no model runs
        self.from_cache = 0  # drafts the shared cache won

    # -- keeping up with the requests -------------------------------------------------------------
    def _sync(self, req) -> _Seq:
        """Index what the request wrote since the last call (the whole prompt the first time), and
        share its output."""
        s = self.seqs.get(req.request_id)
        if s is None:
            s = self.seqs[req.request_id] = _Seq(req, self.vocab)
            s.index.extend(0, req.prompt_ids)
            s.namespace = namespace_of(req) if self.cache is not None else None
        seq = s.index.seqs[0]
        new = req.output_ids[len(seq) - len(req.prompt_ids):]
        if new:
            s.index.extend(0, new)
            if s.namespace is not None:
                if s.sid is None:
                    s.sid = self.cache.new_seq(s.namespace)
                self.cache.extend(s.sid, new)
        return s

    def free(self, rid: str):
        s = self.seqs.pop(rid, None)
        if s is not None and s.namespace is not None:
            self._sync_output(s)

    def _sync_output(self, s: _Seq):
        """A finished request's last tokens, which no lookup indexed, still go to the cache."""
        req = s.req
        done = len(s.index.seqs[0]) - len(req.prompt_ids)
        new = req.output_ids[done:]
        if new:
            if s.sid is None:
                s.sid = self.cache.new_seq(s.namespace)
            self.cache.extend(s.sid, new)

    def keep_only(self, running: set[str], alive: set[str]):
        for rid in [r for r in self.seqs if r not in alive]:
            self.free(rid)

    # -- proposing --------------------------------------------------------------------------------
    def propose(self, reqs, ks: list[int]) -> list[Draft | None]:
        return [self.draft(r, k) for r, k in zip(reqs, ks)]

    def draft(self, req, k: int) -> Draft | None:
        s = self._sync(req)
        ctx = s.index.seqs[0]
        cands = s.index.candidates(ctx)
        edit = None
        if s.follow:
            kept, edit = self._followed(s, ctx, k)
            cands = kept + cands
        best = self._draft(cands, ctx, k, "request")
        if best is not None and best.follow and best.follow[0][0] is not ctx:
            best.source = "cache"  # a copy from another request's output, followed from the last step
        if s.namespace is not None:
            idx = self.cache.index(s.namespace)
            if idx is not None:
                other = self._draft(idx.candidates(ctx, skip=s.sid), ctx, k, "cache")
                if other is not None and (best is None or other.score > best.score):
                    best = other
                    self.cache.touch(idx.sid_of.get(id(seq)) for seq, _ in other.follow)
        if edit is not None and (best is None or best.match_len < EDIT_OVER):
            best = edit
        if best is not None:
            s.follow, s.follow_len, s.follow_match, s.follow_edit = best.follow, len(ctx), best.match_len, best.edit
        elif len(ctx) - s.follow_len > NEAR:  # kept a few steps: a copy the model left may resume
            s.follow = []
        if best is not None and best.source == "cache":
            self.from_cache += 1
        return best

    def _followed(self, s: _Seq, ctx, k: int) -> tuple[list, Draft | None]:
        """Last draft's occurrences moved on by what the request wrote since, where it agrees; and
        where it agrees but for the last token (the model wrote its own token in place of the
        source's: a renamed word in a copied file), an edit draft: the source on past that token.
        Its context length is the copy's so far, its acceptance is learned apart (`Draft.edit`)."""
        grown = len(ctx) - s.follow_len
        new = ctx[s.follow_len:]
        out, edit = [], None
        for seq, p in s.follow:
            q = p + grown
            if q <= len(seq) and seq[p:q] == new:
                if q < len(seq):
                    out.append((seq, q))
                continue
            if edit is not None:
                continue
            # the model strayed from the copy: its last token a little before or after where the copy
            # would be (it skipped or added a few tokens), else in place of the source's (a renamed word)
            start = near(seq, q - 1, ctx[-1])
            if start is None and not s.follow_edit and q <= len(seq) and seq[p:q - 1] == new[:-1]:
                start = q
            if start is None:
                continue
            run = seq[start:start + min(k, int(self.spec_factor * s.follow_match))]
            if len(run):
                n = len(run)
                source = "request" if seq is ctx else "cache"
                edit = Draft(list(run), [1.0] * n, [1] * n, s.follow_match, source, float(n), [(seq, start)], True)
        return out, edit

    def _draft(self, cands, ctx, k: int, source: str) -> Draft | None:
        if not cands:
            return None
        m, occ = longest(cands, ctx, self.max_depth)
        max_len = min(k, int(self.spec_factor * m))
        if max_len < 1:
            return None
        toks, probs, support, score, live = walk(occ, max_len, self.min_prob)
        if not toks:
            return None
        return Draft(toks, probs, support, m, source, score, live)

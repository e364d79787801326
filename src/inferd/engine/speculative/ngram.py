"""Prompt lookup ("n-gram") proposals: no second model, only the sequence's own history.

Copy-heavy work (quote, repeat, edit a passage, code refactors) keeps producing runs of tokens
that already occur earlier in the prompt or output; when the last n tokens occurred before, what
followed them then is a good guess for what follows now.
"""
from __future__ import annotations

from inferd.engine.speculative.proposal import Draft, Proposer


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens continuing the longest (n_max down to n_min) suffix n-gram of `tokens` that
    also occurs earlier; among equal lengths the most recent occurrence wins (it reflects the
    current context best). [] when nothing matches."""
    L = len(tokens)
    if k < 1 or L < n_min + 1:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        last = suffix[-1]
        # candidate end positions e (exclusive) of an earlier occurrence: tokens[e-n:e] == suffix,
        # e <= L - 1 so that at least one token follows it
        for e in range(L - 1, n - 1, -1):
            if tokens[e - 1] != last:
                continue
            if tokens[e - n:e] == suffix:
                return tokens[e:e + k]
    return []


class NgramProposer(Proposer):
    """Prompt lookup as a proposer: it keeps no state per sequence, so only `propose` does anything.
    A sequence whose guesses were all rejected pauses its lookups (`backoff`): a continuation the
    model does not follow tends to keep failing (it paraphrases instead of copying)."""

    def __init__(self, n_min: int, n_max: int, backoff: int = 0):
        self.n_min, self.n_max = n_min, n_max
        self.backoff = backoff

    def propose(self, reqs, ks: list[int]) -> list[Draft]:
        return [Draft(propose_ngram(r.all_ids, k, self.n_min, self.n_max)) for r, k in zip(reqs, ks)]

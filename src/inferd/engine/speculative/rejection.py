"""Acceptance rules for speculative tokens, as pure functions.

Greedy (temperature 0): keep draft tokens while they equal the target's argmax; the first
mismatch is replaced by the target's own choice, and if every draft survives the target's choice
after the last one comes free (the "bonus" token). Output = plain greedy decoding, token for token.

Sampling: the lossless rule of Leviathan et al. / Chen et al. A draft token x drawn from q is kept
with probability min(1, p(x) / q(x)); a rejected position is resampled from
norm(max(0, p - q)). Then P(emit y) = min(p(y), q(y)) + (1 - sum min(p, q)) * residual(y) = p(y):
exactly the target's distribution, for any q. A proposer that does not sample (prompt lookup)
is a one-hot q: keep x with probability p(x), else draw from p with x removed.
"""
from __future__ import annotations

import torch

from inferd.engine.sampler import categorical


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, list[int]]:
    """target_argmax: K+1 entries (one per verified position). -> (accepted count, emitted tokens)."""
    a = 0
    for d, t in zip(draft_tokens, target_argmax):
        if d != t:
            break
        a += 1
    return a, list(draft_tokens[:a]) + [int(target_argmax[a])]


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(categorical(probs[None], [generator])[0])


def rejection_sample(p_target: torch.Tensor, q_draft: torch.Tensor | None, draft_tokens: list[int],
                     generator: torch.Generator | None = None) -> tuple[int, list[int]]:
    """p_target: [K+1, V] target probabilities at the K+1 verified positions; q_draft: [K, V] the
    distributions the draft tokens were drawn from, or None for a deterministic proposer (one-hot).
    -> (accepted count a, emitted tokens: a drafts then one resampled or bonus token)."""
    K = len(draft_tokens)
    p_target = p_target.float()
    for i, x in enumerate(draft_tokens):
        p = p_target[i]
        px = float(p[x])
        if q_draft is None:
            qx = 1.0
        else:
            q = q_draft[i].float()
            qx = float(q[x])
        # qx == 0 cannot happen for a token actually drawn from q; accept iff p allows it
        ratio = 1.0 if qx <= 0 else min(1.0, px / qx)
        if _uniform(generator) < ratio:
            continue
        if q_draft is None:
            resid = p.clone()
            resid[x] = 0
        else:
            resid = (p - q).clamp_min(0)
        s = float(resid.sum())
        # s == 0 only when p == q (up to rounding), where rejection has probability 0 anyway
        tok = _draw(resid / s if s > 0 else p, generator)
        return i, list(draft_tokens[:i]) + [tok]
    return K, list(draft_tokens) + [_draw(p_target[K], generator)]


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Probability that one draft token drawn from q is accepted against p: sum min(p, q)."""
    return float(torch.minimum(p.float(), q.float()).sum())

"""Sampling as pure, batched functions over a [rows, vocab] logits tensor.

Filters follow Hugging Face's warpers (temperature, then top-k, then top-p) so that one seed means
the same thing here, in the reference loop and in tests. Each request draws from its own
torch.Generator, so its tokens do not depend on who else is in the batch.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature: [rows]; rows with 0 are left alone (they are sampled greedily)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits / t[:, None]


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """k: [rows] ints; <= 0 or >= vocab means off. Ties with the k-th value survive (as in HF)."""
    V = logits.shape[-1]
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)
    if bool((k == V).all()):
        return logits
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """p: [rows] in (0, 1]. Keeps the smallest set of most likely tokens whose mass reaches p
    (HF's TopPLogitsWarper: drop tokens whose ascending cumulative mass is <= 1 - p; keep >= 1)."""
    if bool((p >= 1).all()):
        return logits
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1 - p)[:, None]
    drop[:, -1] = False
    drop = drop.scatter(-1, idx, drop)
    return logits.masked_fill(drop, NEG_INF)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. Greedy rows (temperature 0) take the argmax; the rest are filtered and
    drawn with their own generator."""
    logits = logits.float()
    out = torch.argmax(logits, dim=-1)
    rand = torch.nonzero(temperature > 0).flatten()
    if rand.numel():
        sub = apply_temperature(logits[rand], temperature[rand])
        sub = apply_top_k(sub, top_k[rand])
        sub = apply_top_p(sub, top_p[rand])
        probs = sub.softmax(-1)
        for j, row in enumerate(rand.tolist()):
            out[row] = torch.multinomial(probs[j], 1, generator=generators[row])[0]
    return out

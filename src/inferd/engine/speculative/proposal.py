"""What every proposer gives the decoder (`Draft`) and what the decoder asks of it (`Proposer`).

One draft type for every method, so that the budget (budget.py) cuts any draft the same way and
the decoder verifies it without knowing where it came from; one set of hooks, each a no-op unless
the method keeps state that the request's progress moves (a draft model's KV cache, suffix
decoding's index of outputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Draft:
    """One request's guesses, and what verifying and budgeting them reads.

    `probs` and `support`: per guess, the proposer's own estimate of its acceptance (the share of the
    occurrences still agreeing that continue with it) and how many occurrences that share is of; a
    proposer with no such estimate leaves them out: each guess then counts as one occurrence's
    continuation (share 1 of 1), which is what a prompt-lookup guess is. `q`: the [k, V]
    distributions a sampling draft model drew the guesses from, for the rejection rule; None for a
    deterministic guess (a one-hot q). `score` and `follow` are suffix decoding's own (which of two
    drafts wins, and where the copy goes on next step)."""
    tokens: list[int]
    probs: list[float] | None = None
    support: list[int] | None = None
    match_len: int = 0  # the context the guesses continue, in tokens
    source: str = "request"  # "request" | "cache": the request's own tokens or other requests' outputs
    score: float = 0.0  # sum of the running products of probs: the expected accepted length
    follow: list = field(default_factory=list)  # (sequence, position after the context) still agreeing
    edit: bool = False  # the source's continuation past a token the request wrote instead of the source's
    q: torch.Tensor | None = None

    def __post_init__(self):
        if self.probs is None:
            self.probs = [1.0] * len(self.tokens)
        if self.support is None:
            self.support = [1] * len(self.tokens)

    def cut(self, n: int):
        """Keep the first n guesses (the rest could never be accepted)."""
        del self.tokens[n:], self.probs[n:], self.support[n:]
        if self.q is not None:
            self.q = self.q[:n]


class Proposer:
    """The interface SpecDecoder drives. `propose` is the method; the rest are hooks that a
    proposer without per-request state leaves as they are."""
    forwards = 0  # model forwards run for drafts (a draft model's)
    backoff = 0  # longest pause, in steps, after a draft of which nothing was kept; 0: never pause
    desc: str | None = None  # what drafts, for the start-up log (a draft model's name)

    def propose(self, reqs, ks: list[int]) -> list[Draft | None]:
        """Up to ks[i] guesses for each request; None (or no tokens) where there are none."""
        raise NotImplementedError

    def accepted(self, rid: str, valid: int):
        """The request's first `valid` tokens are final: what was drafted past them is stale."""

    def preempted(self, rid: str):
        """The request lost its blocks and waits to run again."""

    def free(self, rid: str):
        """The request is done (finished or aborted)."""

    def keep_only(self, running: set[str], alive: set[str]):
        """Whatever is kept for a request outside these goes: `running`, the sequences running now;
        `alive`, every request not yet done (running, waiting or preempted)."""

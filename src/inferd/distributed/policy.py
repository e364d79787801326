"""Where a request goes: the policies `inferd router` (over HTTP backends) and `inferd serve
--data-parallel-size` (over engine processes) share.

`round_robin`, `least_loaded`, `prefix` and `kv_events` (prefix, with each target's blocks known from
its own KV events instead of guessed: inferd.router.kv_index). For `prefix` each target keeps a `PrefixIndex` of what
it was sent. SGLang's cache-aware router keeps a radix tree over characters; this keeps instead a
chain of chunk hashes, the way the engines' own prefix caches key their KV blocks: the hash of
chunk i covers chunks 0..i, so "the first k chunks match" is k dictionary lookups, memory is one
entry a chunk (not a node a character), and LRU eviction bounds it as a KV pool is bounded. It is
approximate the same way a radix tree of text is: a match is measured in whole chunks, and a target
may have evicted what the index still remembers. The chunk is characters for the router (it needs
no backend's tokenizer) and tokens of one KV block for data parallelism.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

POLICIES = ("round_robin", "least_loaded", "prefix", "kv_events")


def chunk_hashes(seq: Sequence, chunk: int) -> list[int]:
    """Hashes of the whole chunks of `seq` (a str or a list of token ids), each covering all the
    chunks before it."""
    out, h = [], 0
    for i in range(0, len(seq) - chunk + 1, chunk):
        part = seq[i:i + chunk]
        h = hash((h, part if isinstance(part, str) else tuple(part)))
        out.append(h)
    return out


class PrefixIndex:
    """The chunk-hash chains one target was sent, most recently used last, at most `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def match(self, hashes: list[int]) -> int:
        """How many leading chunks this target has seen."""
        k = 0
        while k < len(hashes) and hashes[k] in self._seen:
            k += 1
        return k

    def insert(self, hashes: list[int]):
        seen = self._seen
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def clear(self):
        self._seen.clear()


@dataclass
class Pick:
    target: Hashable
    matched: int = 0  # leading chunks the target had seen (prefix policy)
    reason: str = ""  # "prefix", "balance" (load too uneven to follow the cache), "new" (no match), ...


class Balancer:
    """Chooses a target per request from the live ones.

    `prefix`: the target that saw the longest prefix of this request, if that is at least
    `cache_threshold` of the request's chunks; otherwise (a new prefix) the least loaded, ties going
    to the target whose index is smallest (then rotating), so new families spread evenly. The cap: when loads are
    uneven (max - min > `balance_abs` and max > `balance_rel` x min), or the cached target is
    `balance_abs` requests busier than the least loaded, the least loaded wins whatever it caches,
    so one hot prefix cannot pile every request onto one target (SGLang's router balances the
    same way)."""

    def __init__(self, targets: Sequence[Hashable], policy: str = "prefix", chunk: int = 64,
                 capacity: int = 1 << 16, cache_threshold: float = 0.5, balance_abs: float = 4,
                 balance_rel: float = 1.5, matcher=None):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} ({', '.join(POLICIES)})")
        self.targets = list(targets)
        self.policy = policy
        self.chunk = chunk
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.capacity = capacity
        self.index = {t: PrefixIndex(capacity) for t in self.targets}
        # kv_events: matcher(target, block hashes) -> leading blocks the target's pool holds, as its
        # own KV events say (inferd.router.kv_index)
        self.matcher = matcher
        if policy == "kv_events" and matcher is None:
            raise ValueError("the kv_events policy needs a matcher (the backends' KV event index)")
        self._rr = 0

    def pick(self, seq: Sequence, loads: dict, live: Sequence[Hashable] | None = None) -> Pick:
        """`seq`: the request's text (or token ids); with kv_events, (its block hashes, its text);
        `loads`: target -> requests open there."""
        cands = [t for t in self.targets if live is None or t in live]
        if not cands:
            raise LookupError("no live target")
        if self.policy == "round_robin":
            for _ in range(len(self.targets)):
                t = self.targets[self._rr % len(self.targets)]
                self._rr += 1
                if t in cands:
                    return Pick(t, reason="round_robin")
        load = {t: loads.get(t, 0) for t in cands}
        least = self._least(cands, load)
        if self.policy == "least_loaded":
            return Pick(least, reason="least_loaded")
        if self.policy == "kv_events":
            # the events say where the prefix is; where no target holds any of it, the router's own
            # memory of where it sent it (the prefix policy's guess) keeps each prefix a home
            hashes, text = seq
            seen = chunk_hashes(text, self.chunk)
            matched = {t: self.matcher(t, hashes) for t in cands}
            if not any(matched.values()):
                hashes = seen
                matched = {t: self.index[t].match(seen) for t in cands}
        else:
            hashes = seen = chunk_hashes(seq, self.chunk)
            matched = {t: self.index[t].match(hashes) for t in cands}
        lo, hi = load[least], max(load.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return self._record(Pick(least, matched[least], "balance"), seen)
        best = max(cands, key=lambda t: (matched[t], -load[t]))
        if hashes and matched[best] >= self.cache_threshold * len(hashes) and matched[best] > 0:
            if load[best] - lo > self.balance_abs:
                return self._record(Pick(least, matched[least], "balance"), seen)
            return self._record(Pick(best, matched[best], "prefix"), seen)
        return self._record(Pick(least, matched[least], "new"), seen)

    def _least(self, cands: list, load: dict):
        """The least loaded, then the one holding least; a tie left after both rotates, so that
        short prompts (no whole chunk to remember) on an idle system do not all go to the first."""
        key = {t: (load[t], len(self.index[t])) for t in cands}
        low = min(key.values())
        tied = [t for t in cands if key[t] == low]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _record(self, pick: Pick, hashes: list[int]) -> Pick:
        self.index[pick.target].insert(hashes)
        return pick

    def add_targets(self, targets: Sequence[Hashable]):
        """Targets that came up since (replicas a cluster scaled out): they start with empty indexes."""
        for t in targets:
            if t not in self.index:
                self.targets.append(t)
                self.index[t] = PrefixIndex(self.capacity)

    def forget(self, target: Hashable):
        """A target restarted (its cache is empty) or was marked down."""
        if target in self.index:
            self.index[target].clear()

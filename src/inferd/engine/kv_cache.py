"""The paged KV cache's bookkeeping: the BlockManager hands the KV pool's blocks (the storage is
inferd.worker.kv_pool) to requests, ref-counted so that a prompt's blocks can be shared, and keeps
full blocks findable by content for prefix caching.

A full block's key is (parent key's hash, its token ids): equal keys mean equal tokens at equal
positions after an equal prefix, so the K/V stored there can be reused as is. Freed blocks that
hold a key stay findable, in least-recently-freed order, until a new allocation needs them.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from inferd.engine.request import Request


def block_key(parent_hash: int | None, tokens: tuple[int, ...]) -> tuple:
    return (parent_hash, tokens)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: dict[tuple, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but findable; LRU first
        # counters (first admissions only: recompute after preemption is not reuse)
        self.queries = 0
        self.hits = 0
        self.recompute_hits = 0
        self.evictions = 0

    # -- capacity -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_table))

    # -- allocation ---------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            key = self.key_of[b]
            if self.cached.get(key) == b:
                del self.cached[key]
            self.key_of[b] = None
            self.evictions += 1
        self.ref[b] = 1
        return b

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow req's block table to hold num_computed + num_new_tokens tokens; False if short."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            req.block_table.append(self._take())
        return True

    def release_blocks(self, blocks: list[int]):
        """Drop one reference to each of these blocks (a producer's expired or confirmed lease)."""
        self._release(blocks)

    def _release(self, blocks: list[int]):
        # reverse order: a sequence's tail blocks become the first to be evicted
        for b in reversed(blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                if self.key_of[b] is not None:
                    self.evictable[b] = None  # registered: findable by its prefix until evicted
                else:
                    self.free.append(b)

    def free_request(self, req: Request):
        self._release(req.block_table)
        req.block_table = []
        req.block_hashes = []
        req.num_cached_hashed = 0

    def truncate(self, req: Request, num_tokens: int):
        """Give back the blocks wholly past the first num_tokens tokens (rejected speculative
        slots). They were allocated this step and never registered, so they go straight to free."""
        keep = -(-num_tokens // self.block_size)
        self._release(req.block_table[keep:])
        del req.block_table[keep:]
        del req.block_hashes[keep:]
        req.num_cached_hashed = min(req.num_cached_hashed, keep)

    def fork(self, parent: Request, child: Request, num_blocks: int | None = None):
        """Share parent's first num_blocks blocks (all by default) with child, for n > 1 samples of
        one prompt: their ref counts go up, and the child's computed length and prefix hashes stop
        at them, so a child recomputes (and writes) only the blocks it owns."""
        n = len(parent.block_table) if num_blocks is None else num_blocks
        for b in parent.block_table[:n]:
            self.ref[b] += 1
        child.block_table = list(parent.block_table[:n])
        child.block_hashes = list(parent.block_hashes[:n])
        child.num_cached_hashed = min(parent.num_cached_hashed, n)
        child.num_computed = parent.num_computed if num_blocks is None else n * self.block_size

    # -- prefix caching -----------------------------------------------------------------------
    def _keys(self, ids: list[int], start: int, end: int, hashes: list[int]):
        """Yield (index, key) for full blocks start..end-1, extending the hash chain as it goes."""
        bs = self.block_size
        for i in range(start, end):
            parent = hashes[i - 1] if i > 0 else None
            key = block_key(parent, tuple(ids[i * bs:(i + 1) * bs]))
            if i == len(hashes):
                hashes.append(hash(key))
            yield i, key

    def match_prefix(self, req: Request) -> int:
        """At admission of a request with no blocks: adopt cached blocks for its leading full
        blocks. At least one token is always left to compute, for its logits. Returns tokens hit."""
        assert not req.block_table and req.num_computed == 0
        if not self.caching or req.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        ids = req.all_ids
        n_full = (len(ids) - 1) // self.block_size
        hit_blocks = 0
        req.block_hashes = []
        for i, key in self._keys(ids, 0, n_full, req.block_hashes):
            b = self.cached.get(key)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
            req.block_table.append(b)
            hit_blocks += 1
        tokens = hit_blocks * self.block_size
        req.num_computed = tokens
        req.num_cached_hashed = hit_blocks
        return tokens

    def count_admission(self, req: Request, hit_tokens: int):
        """Count a successful admission's cache use. Only prompt tokens this request never
        computed itself are hits: what it recomputes or re-finds after a preemption is not reuse."""
        if req.num_preemptions == 0:
            self.queries += req.num_prompt
            self.hits += hit_tokens
            req.prefix_hit_tokens = hit_tokens
        else:
            new = max(0, min(hit_tokens, req.num_prompt) - req.max_computed)
            self.hits += new
            req.prefix_hit_tokens += new
            self.recompute_hits += hit_tokens - new
        req.max_computed = max(req.max_computed, hit_tokens)

    def register_full_blocks(self, req: Request):
        """After a step computed tokens: make req's newly filled blocks findable."""
        if not self.caching:
            return
        n_full = req.num_computed // self.block_size
        if n_full <= req.num_cached_hashed:
            return
        ids = req.all_ids
        for i, key in self._keys(ids, req.num_cached_hashed, n_full, req.block_hashes):
            b = req.block_table[i]
            if key not in self.cached and self.key_of[b] is None:
                self.cached[key] = b
                self.key_of[b] = key
        req.num_cached_hashed = n_full

    def check_invariants(self, live: list[Request]):
        """For tests: ref counts equal block-table occurrences; every block in exactly one state."""
        counts = [0] * self.num_blocks
        for r in live:
            for b in r.block_table:
                counts[b] += 1
        assert counts == self.ref, "ref counts disagree with block tables"
        free, evict = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "duplicate in free list"
        assert not (free & evict)
        for b in range(self.num_blocks):
            in_use = self.ref[b] > 0
            assert in_use + (b in free) + (b in evict) == 1, f"block {b} in {in_use, b in free, b in evict}"
            if b in free:
                assert self.key_of[b] is None
            if b in evict:
                assert self.key_of[b] is not None
        for key, b in self.cached.items():
            assert self.key_of[b] == key

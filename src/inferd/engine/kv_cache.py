"""The paged KV cache's bookkeeping: the BlockManager hands the KV pool's blocks (the storage is
inferd.worker.kv_pool) to requests, ref-counted so that a prompt's blocks can be shared, and keeps
full blocks findable by content for prefix caching.

A full block's key is (parent block's hash, its token ids): equal keys mean equal tokens at equal
positions after an equal prefix, so the K/V stored there can be reused as is. Freed blocks that
hold a key stay findable, in least-recently-freed order, until a new allocation needs them. The
hashes are inferd.distributed.kv_events.block_hash, stable across processes: the KV tier names its
files by them, and the KV events this manager logs (blocks stored, blocks removed) carry them.

KV groups (inferd.worker.kv_pool.KVLayout): a model with sliding-window layers keeps them in groups
of their own, each with a block table per request (`req.kv_tables`, beside `req.block_table` for
the full-context group). All groups draw on the one pool. A window group's blocks that no query
can see any more (wholly before the window of the next token to compute) go back as the request
advances; their table entries become NULL, a pool block that is never handed out, so tables stay
indexed by position. A prefix hit must find the window groups' blocks of its last window too.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from inferd.distributed.kv_events import EventLog, block_hash, lora_id
from inferd.engine.request import Request


def lora_seed(req: Request) -> int:
    """What a request's hash chain starts from: an adapter's K/V differ from the base model's for
    the same tokens, so its blocks are findable only by requests of that adapter."""
    return lora_id(getattr(req, "lora", None))


def first_visible_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block the next query (at position num_computed) can see through this window."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple = ()):
        """`group_windows`: the windows of KV groups 1.. (KVLayout.extra_windows; None: a group that
        keeps every block). With any, the pool holds one more block, NULL (= num_blocks)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.NULL = num_blocks  # stands for a window group's released block; never allocated
        self.ref = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks  # full-group blocks' chain hashes, for events
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: dict[tuple, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but findable; LRU first
        # counters (first admissions only: recompute after preemption is not reuse)
        self.queries = 0
        self.hits = 0
        self.recompute_hits = 0
        self.evictions = 0
        self.stored = 0  # full-group blocks made findable (BlockStored's hashes)
        self.removed = 0  # findable blocks evicted (BlockRemoved's hashes)
        self.events: EventLog | None = None  # set: log every stored / removed block (--kv-events-config)
        self.new_blocks: list | None = None  # set: newly findable blocks for the KV tier to write

    # -- capacity -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = -(-(req.num_computed + num_new_tokens) // self.block_size)
        need = max(0, total - len(req.block_table))
        for table in req.kv_tables:
            need += max(0, total - len(table))
        return need

    def held_blocks(self, req: Request) -> int:
        """Pool blocks this request's tables point at (NULL entries are none)."""
        return len(req.block_table) + sum(b != self.NULL for t in req.kv_tables for b in t)

    # -- allocation ---------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            key = self.key_of[b]
            if self.cached.get(key) == b:
                del self.cached[key]
                h = self.hash_of[b]
                if h is not None:
                    self.removed += 1
                    if self.events is not None:
                        self.events.removed(h)
            self.key_of[b] = None
            self.hash_of[b] = None
            self.evictions += 1
        self.ref[b] = 1
        return b

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow req's block tables to hold num_computed + num_new_tokens tokens; False if short.
        First gives back the window groups' blocks that no query from num_computed on can see."""
        self.slide(req)
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.num_free:
            return False
        total = -(-(req.num_computed + num_new_tokens) // self.block_size)
        for table in (req.block_table, *req.kv_tables):
            while len(table) < total:
                table.append(self._take())
        return True

    def slide(self, req: Request):
        """Release the window groups' blocks before the first one the next query can see."""
        if not self.group_windows:
            return
        if not req.kv_tables:
            req.kv_tables = [[] for _ in self.group_windows]
        for table, w in zip(req.kv_tables, self.group_windows):
            first = min(first_visible_block(req.num_computed, w, self.block_size), len(table))
            # the released entries are a prefix of NULLs: walk back only over the newly unseen blocks
            i = first
            while i > 0 and table[i - 1] != self.NULL:
                i -= 1
            if i < first:
                gone = table[i:first]
                table[i:first] = [self.NULL] * (first - i)
                self._release(gone)

    def release_blocks(self, blocks: list[int]):
        """Drop one reference to each of these blocks (a producer's expired or confirmed lease)."""
        self._release(blocks)

    def _release(self, blocks: list[int]):
        # reverse order: a sequence's tail blocks become the first to be evicted
        for b in reversed(blocks):
            if b == self.NULL:
                continue
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                if self.key_of[b] is not None:
                    self.evictable[b] = None  # registered: findable by its prefix until evicted
                else:
                    self.free.append(b)

    def free_request(self, req: Request):
        for table in req.kv_tables:
            self._release(table)
        self._release(req.block_table)
        req.block_table = []
        req.kv_tables = []
        req.block_hashes = []
        req.num_cached_hashed = 0

    def truncate(self, req: Request, num_tokens: int):
        """Give back the blocks wholly past the first num_tokens tokens (rejected speculative
        slots). They were allocated this step and never registered, so they go straight to free."""
        keep = -(-num_tokens // self.block_size)
        for table in (req.block_table, *req.kv_tables):
            self._release(table[keep:])
            del table[keep:]
        del req.block_hashes[keep:]
        req.num_cached_hashed = min(req.num_cached_hashed, keep)

    def fork(self, parent: Request, child: Request, num_blocks: int | None = None):
        """Share parent's first num_blocks blocks (all by default) with child, for n > 1 samples of
        one prompt: their ref counts go up, and the child's computed length and prefix hashes stop
        at them, so a child recomputes (and writes) only the blocks it owns."""
        n = len(parent.block_table) if num_blocks is None else num_blocks
        for table in (parent.block_table, *parent.kv_tables):
            for b in table[:n]:
                if b != self.NULL:
                    self.ref[b] += 1
        child.block_table = list(parent.block_table[:n])
        child.kv_tables = [list(t[:n]) for t in parent.kv_tables]
        child.block_hashes = list(parent.block_hashes[:n])
        child.num_cached_hashed = min(parent.num_cached_hashed, n)
        child.num_computed = parent.num_computed if num_blocks is None else n * self.block_size

    # -- prefix caching -----------------------------------------------------------------------
    def _keys(self, ids: list[int], start: int, end: int, hashes: list[int], seed: int = 0):
        """Yield (index, key) for full blocks start..end-1, extending the hash chain as it goes;
        `seed` starts the chain (lora_seed)."""
        bs = self.block_size
        for i in range(start, end):
            tokens = tuple(ids[i * bs:(i + 1) * bs])
            key = (hashes[i - 1] if i > 0 else ("seed", seed), tokens)
            if i == len(hashes):
                hashes.append(block_hash(hashes[i - 1] if i > 0 else None, tokens, seed))
            yield i, key

    def extend_hashes(self, req: Request, n: int) -> list[int]:
        """req's chain hashes of its first n full blocks (computing those it lacks)."""
        if len(req.block_hashes) < n:
            for _ in self._keys(req.all_ids, len(req.block_hashes), n, req.block_hashes, lora_seed(req)):
                pass
        return req.block_hashes

    def match_prefix(self, req: Request) -> int:
        """At admission of a request with no blocks: adopt cached blocks for its leading full
        blocks. At least one token is always left to compute, for its logits. Returns tokens hit."""
        assert not req.block_table and req.num_computed == 0
        if not self.caching or req.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        ids = req.all_ids
        n_full = (len(ids) - 1) // self.block_size
        found: list[int] = []
        req.block_hashes = []
        for i, key in self._keys(ids, 0, n_full, req.block_hashes, lora_seed(req)):
            b = self.cached.get(key)
            if b is None:
                break
            found.append(b)
        hit_blocks, groups = self._group_hits(req, found)
        req.block_table = found[:hit_blocks]
        if self.group_windows:
            req.kv_tables = groups
        for table in (req.block_table, *req.kv_tables):
            for b in table:
                if b == self.NULL:
                    continue
                if self.ref[b] == 0:
                    del self.evictable[b]
                self.ref[b] += 1
        tokens = hit_blocks * self.block_size
        req.num_computed = tokens
        req.num_cached_hashed = hit_blocks
        return tokens

    def _group_hits(self, req: Request, found: list[int]) -> tuple[int, list[list[int]]]:
        """How many of the full group's found blocks the other groups can back (a window group needs
        its blocks from the first one the next query sees; a full group, all), and their tables."""
        if not self.group_windows:
            return len(found), []
        bs = self.block_size
        cand = [[self.cached.get(("group", g, h)) for h in req.block_hashes[:len(found)]]
                for g in range(len(self.group_windows))]
        for n in range(len(found), 0, -1):
            firsts = [first_visible_block(n * bs, w, bs) for w in self.group_windows]
            if all(None not in c[f:n] for c, f in zip(cand, firsts)):
                return n, [[self.NULL] * f + c[f:n] for c, f in zip(cand, firsts)]
        return 0, [[] for _ in self.group_windows]

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
        ids, bs, seed, hashes = req.all_ids, self.block_size, lora_seed(req), req.block_hashes
        run: list[int] = []  # indexes of consecutive newly findable blocks: one BlockStored event
        for i, key in self._keys(ids, req.num_cached_hashed, n_full, hashes, seed):
            b = req.block_table[i]
            if self._register(b, key):
                self.hash_of[b] = hashes[i]
                self.stored += 1
                run.append(i)
                if self.new_blocks is not None:
                    self.new_blocks.append((b, hashes[i], hashes[i - 1] if i else None, key[1], seed))
            elif run:
                self._log_stored(run, ids, hashes, seed)
                run = []
            # a window group's block is known by the full group's chain hash at the same index
            for g, table in enumerate(req.kv_tables):
                self._register(table[i], ("group", g, hashes[i]))
        if run:
            self._log_stored(run, ids, hashes, seed)
        req.num_cached_hashed = n_full

    def _log_stored(self, run: list[int], ids, hashes, seed: int):
        if self.events is not None:
            bs, a, b = self.block_size, run[0], run[-1] + 1
            self.events.stored(hashes[a:b], hashes[a - 1] if a else None, list(ids[a * bs:b * bs]), bs, seed)

    def take_new_blocks(self) -> list:
        out, self.new_blocks = self.new_blocks, []
        return out

    def _register(self, b: int, key) -> bool:
        if b != self.NULL and key not in self.cached and self.key_of[b] is None:
            self.cached[key] = b
            self.key_of[b] = key
            return True
        return False

    def check_invariants(self, live: list[Request]):
        """For tests: ref counts equal block-table occurrences; every block in exactly one state."""
        counts = [0] * self.num_blocks
        for r in live:
            for table in (r.block_table, *r.kv_tables):
                for b in table:
                    if b != self.NULL:
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

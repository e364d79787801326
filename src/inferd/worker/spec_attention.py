"""Verify chunks through the decode kernel.

A verify step gives each sequence k+1 new tokens. Through the prefill path that means gathering
the sequence's whole K/V per layer and a masked SDPA call, which at batch 1 cost as much as the
weights' matmuls. But query j of a chunk starting at position s is exactly a decode query with
context length s + j + 1 (this layer's new K/V are written before anyone attends), so short
chunks are handed to the paged decode kernel as k+1 single-query rows sharing one block table:
K/V read in place, causality from the per-row context length, no mask. Every verify chunk the
configuration allows (k + 1 rows for k guesses) takes this path: `max_rows` is at least k + 1.

Only verify chunks: the runner says which (`verify`). A short prompt chunk (the tail after a prefix
hit, a recomputed output) stays on the prefill path, as it runs without speculation: decode rows
sum in another order than the prefill kernel, and with int8 activations a last-bit difference can
flip a rounding and a greedy token, so speculation would change outputs it must leave alone
(measured: a 16-token tail after a 224-token prefix hit parted a code-edit answer at its first token).
A draft model's catch-up chunks (no `verify` given) still take every short chunk as decode rows.
"""
from __future__ import annotations

from inferd.worker.attention import PagedAttention


class SpecPagedAttention(PagedAttention):
    max_rows_per_chunk = 16  # longer chunks (prompts) stay on the batched prefill path

    def __init__(self, *args, max_rows: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_rows is not None:
            self.max_rows_per_chunk = max(self.max_rows_per_chunk, max_rows)

    def prepare(self, block_tables, starts, lengths, kv_tables=None, verify=None):
        """verify: per sequence, whether its chunk is a known token and its guesses (None: any chunk
        of at most max_rows_per_chunk rows is taken as decode rows)."""
        if self.kernel is None:
            return super().prepare(block_tables, starts, lengths, kv_tables)
        bts, kvts, sts, lens = [], [], [], []
        for i, (bt, s, n) in enumerate(zip(block_tables, starts, lengths)):
            as_rows = 1 < n <= self.max_rows_per_chunk and (verify is None or verify[i])
            rows = n if as_rows else 1
            bts.extend([bt] * rows)
            if kv_tables is not None:
                kvts.extend([kv_tables[i]] * rows)
            sts.extend(range(s, s + n) if rows > 1 else [s])
            lens.extend([1] * n if rows > 1 else [n])
        return super().prepare(bts, sts, lens, kvts if kv_tables is not None else None)

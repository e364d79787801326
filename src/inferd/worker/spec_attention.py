"""Verify chunks through the decode kernel.

A verify step gives each sequence k+1 new tokens. Through the prefill path that means gathering
the sequence's whole K/V per layer and a masked SDPA call, which at batch 1 cost as much as the
weights' matmuls. But query j of a chunk starting at position s is exactly a decode query with
context length s + j + 1 (this layer's new K/V are written before anyone attends), so short
chunks are handed to the paged decode kernel as k+1 single-query rows sharing one block table:
K/V read in place, causality from the per-row context length, no mask. Every verify chunk the
configuration allows (k + 1 rows for k guesses) takes this path: `max_rows` is at least k + 1.
"""
from __future__ import annotations

from inferd.worker.attention import PagedAttention


class SpecPagedAttention(PagedAttention):
    max_rows_per_chunk = 16  # longer chunks (prompts) stay on the batched prefill path

    def __init__(self, *args, max_rows: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_rows is not None:
            self.max_rows_per_chunk = max(self.max_rows_per_chunk, max_rows)

    def prepare(self, block_tables, starts, lengths, kv_tables=None):
        if self.kernel is None:
            return super().prepare(block_tables, starts, lengths, kv_tables)
        bts, kvts, sts, lens = [], [], [], []
        for i, (bt, s, n) in enumerate(zip(block_tables, starts, lengths)):
            rows = n if 1 < n <= self.max_rows_per_chunk else 1
            bts.extend([bt] * rows)
            if kv_tables is not None:
                kvts.extend([kv_tables[i]] * rows)
            sts.extend(range(s, s + n) if rows > 1 else [s])
            lens.extend([1] * n if rows > 1 else [n])
        return super().prepare(bts, sts, lens, kvts if kv_tables is not None else None)

"""Attention over the paged KV cache, for one flat batch of sequences.

`PagedAttention.prepare` turns the step's block tables into index tensors once; the per-layer
call then writes the new keys/values into their slots with one `index_copy_` and attends with one
batched SDPA per group: decodes (one query each) together, prefill chunks together (queries padded
to the longest chunk). Mixing the two groups would pad every decode to the longest prompt chunk.

On CPU the cache and the attention math stay in fp32 even for a bf16 model: at these sizes small
bf16 batched matmuls were several times slower than fp32 ones (DESIGN.md, performance facts).
A CUDA/Triton kernel would replace `__call__` and keep `prepare`'s metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.engine.kv_cache import KVPool


@dataclass
class _Group:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (padded rows repeat a valid row)
    q_valid: torch.Tensor | None  # [B, Q] bool, None when every query is real (decode group)
    kv_slots: torch.Tensor  # [B, K] slots to gather
    mask: torch.Tensor  # [B, 1, Q, K] bool: may attend
    out_rows: torch.Tensor  # [N] flat rows the valid outputs go to
    out_sel: torch.Tensor | None  # [N] positions in the flattened [B*Q] output that are valid


class PagedAttention:
    def __init__(self, pool: KVPool, head_dim: int, sliding_window: int | None = None):
        self.pool = pool
        self.scale = head_dim ** -0.5
        self.window = sliding_window
        self.slot_mapping: torch.Tensor | None = None
        self.groups: list[_Group] = []

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int]):
        """One entry per sequence: its block table, first new position, number of new tokens."""
        dev = self.pool.k.device
        bs = self.pool.block_size
        B = len(block_tables)
        max_blocks = max(len(bt) for bt in block_tables)
        bt = torch.zeros(B, max_blocks, dtype=torch.long)
        for i, row in enumerate(block_tables):
            bt[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        lens_t = torch.tensor(lengths, dtype=torch.long)
        seq_of_tok = torch.repeat_interleave(torch.arange(B), lens_t)
        tok_start = torch.cumsum(lens_t, 0) - lens_t
        pos = starts_t[seq_of_tok] + (torch.arange(int(lens_t.sum())) - tok_start[seq_of_tok])
        self.slot_mapping = (bt[seq_of_tok, pos // bs] * bs + pos % bs).to(dev)
        self.positions = pos
        self.groups = []
        ctx = starts_t + lens_t
        is_dec = lens_t == 1
        for sel in (is_dec, ~is_dec):
            idx = torch.nonzero(sel).flatten()
            if idx.numel():
                self.groups.append(self._group(bt[idx], starts_t[idx], lens_t[idx], ctx[idx],
                                               tok_start[idx], dev))
        return pos

    def _group(self, bt, starts, lens, ctx, tok_start, dev) -> _Group:
        bs = self.pool.block_size
        B = bt.shape[0]
        K = int(ctx.max())
        Q = int(lens.max())
        kpos = torch.arange(K)
        slots = (bt[:, :, None] * bs + torch.arange(bs)).reshape(B, -1)[:, :K]
        qoff = torch.arange(Q)
        q_valid = qoff[None, :] < lens[:, None]  # [B, Q]
        q_index = tok_start[:, None] + torch.minimum(qoff[None, :], (lens - 1)[:, None])
        qpos = starts[:, None] + qoff[None, :]  # [B, Q]
        mask = kpos[None, None, :] <= qpos[:, :, None]
        mask &= kpos[None, None, :] < ctx[:, None, None]
        if self.window is not None:
            mask &= kpos[None, None, :] > qpos[:, :, None] - self.window
        flat_valid = q_valid.flatten()
        return _Group(
            q_index=q_index.to(dev),
            q_valid=None if Q == 1 else q_valid.to(dev),
            kv_slots=slots.to(dev),
            mask=mask.unsqueeze(1).to(dev),
            out_rows=q_index.flatten()[flat_valid].to(dev),
            out_sel=None if Q == 1 else torch.nonzero(flat_valid).flatten().to(dev),
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        cdt = kc.dtype
        kc.index_copy_(0, self.slot_mapping, k.to(cdt))
        vc.index_copy_(0, self.slot_mapping, v.to(cdt))
        T, H, D = q.shape
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        qc = q.to(cdt)
        for g in self.groups:
            B, Q = g.q_index.shape
            qg = qc[g.q_index].permute(0, 2, 1, 3)  # [B, H, Q, D]
            kg = kc[g.kv_slots].permute(0, 2, 1, 3)  # [B, Hkv, K, D]
            vg = vc[g.kv_slots].permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                                               enable_gqa=True)
            o = o.permute(0, 2, 1, 3).reshape(B * Q, H * D)
            if g.out_sel is not None:
                o = o[g.out_sel]
            out[g.out_rows] = o.to(q.dtype)
        return out

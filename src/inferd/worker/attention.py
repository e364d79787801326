"""Attention over the paged KV cache, for one flat batch of sequences.

`PagedAttention.prepare` turns the step's block tables into index tensors once; the per-layer
call then writes the new keys/values into their slots with one `index_copy_` and attends per
group: decodes (one query each) through the compiled kernel (csrc/cpu/paged_attention_impl.h) (reads K/V in
place), prefill chunks through one batched SDPA over gathered K/V (queries padded to the longest
chunk). Mixing the two groups would pad every decode to the longest prompt chunk. Without a
compiler the decode group takes the SDPA path too.

At large batch, decode attention is bound by reading the KV cache, so the cache follows the model
dtype (bf16 halves the bytes); attention maths run in fp32. A CUDA/Triton kernel would replace
`__call__` and keep `prepare`'s metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.model.layers import attend
from inferd.worker.kv_pool import KVLayout, KVPool


@dataclass
class _Group:
    q_index: torch.Tensor  # [B, Q] rows of the flat batch (padded rows repeat a valid row)
    q_valid: torch.Tensor | None  # [B, Q] bool, None when every query is real (decode group)
    kv_slots: torch.Tensor | None  # [B, K] slots to gather (None: a decode group for the kernel)
    masks: dict | None  # window (None: none) -> [B, 1, Q, K] bool: may attend
    out_rows: torch.Tensor  # [N] flat rows the valid outputs go to
    out_sel: torch.Tensor | None  # [N] positions in the flattened [B*Q] output that are valid
    block_tables: torch.Tensor | None = None  # [B, max_blocks] (decode group, for the kernel)
    ctx_lens: torch.Tensor | None = None  # [B]
    # one fresh prompt (its queries are keys 0..Q-1; a layer without a window): SDPA's is_causal, which skips
    # the blocks above the diagonal that an explicit mask makes it compute (2x a 512-token prefill)
    causal: bool = False


class PagedAttention:
    def __init__(self, pool: KVPool, head_dim: int, sliding_window: int | None | list = None,
                 use_kernel: bool = True, scale: float | None = None, layout: KVLayout | None = None,
                 softcap: float | None = None):
        """`sliding_window`: one window for every layer, or a list of one per layer (None where a layer
        sees the whole context: Gemma's global layers); model.config.attention_windows gives it.
        `scale`: the softmax scale (default head_dim ** -0.5; Gemma's query_pre_attn_scalar).
        `layout`: KV groups (inferd.worker.kv_pool): each group's layers live in the pool rows and
        blocks of that group's own tables (prepare's kv_tables); None: every layer in one table.
        `softcap`: Gemma 2's attention-logit soft-capping (model.layers.attend's explicit maths; the
        compiled kernel has none, so such a model decodes through it too)."""
        self.pool = pool
        self.softcap = softcap
        self.layout = layout if layout is not None and layout.num_groups > 1 else None
        self._states: list[tuple] = []  # per KV group: (slot_mapping, groups), made by prepare
        self.kernel = None
        # the compiled decode kernel reads fp32 or bf16 caches; any other (fp16) takes the SDPA path
        if (use_kernel and softcap is None and pool.k.device.type == "cpu"
                and pool.k.dtype in (torch.float32, torch.bfloat16)):
            from inferd.kernels import native

            self.kernel = native.ops()
        self.kernel_calls = 0  # decode groups served by the compiled kernel (tests check it ran)
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.window = sliding_window  # as given, to hand on (a draft model's attention)
        self.windows = sliding_window if isinstance(sliding_window, list) else None
        self._all_windows = set(self.windows) if self.windows is not None else {sliding_window}
        self.slot_mapping: torch.Tensor | None = None
        self.groups: list[_Group] = []

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int],
                kv_tables: list[list[list[int]]] | None = None):
        """One entry per sequence: its block table, first new position, number of new tokens (and,
        with KV groups, its tables of groups 1..)."""
        if self.layout is None:
            return self._prepare(block_tables, starts, lengths, self._all_windows)
        self._states = []
        for g, w in enumerate(self.layout.windows):
            tables = block_tables if g == 0 else [t[g - 1] for t in kv_tables]
            pos = self._prepare(tables, starts, lengths, {w})
            self._states.append((self.slot_mapping, self.groups))
        return pos

    def _prepare(self, block_tables, starts, lengths, windows: set):
        dev = self.pool.k.device
        bs = self.pool.block_size
        B = len(block_tables)
        max_blocks = max(len(bt) for bt in block_tables)
        if self.kernel is not None and all(n == 1 for n in lengths):
            return self._prepare_decode(block_tables, starts, max_blocks, dev)
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
                                               tok_start[idx], dev, windows))
        return pos

    def _prepare_decode(self, block_tables, starts, max_blocks, dev):
        """A decode-only step for the kernel: it needs the slots, block tables and context lengths, not
        the gather indices and masks of the torch path; built from Python lists in a few tensor calls
        (the general path's ~30 small torch ops cost ~0.3 ms a step, a batch-1 token is ~8 ms)."""
        bs = self.pool.block_size
        B = len(block_tables)
        self.slot_mapping = torch.tensor([bt[p // bs] * bs + p % bs for bt, p in zip(block_tables, starts)],
                                         dtype=torch.long, device=dev)
        self.positions = pos = torch.tensor(starts, dtype=torch.long)
        rows = torch.arange(B, device=dev)
        self.groups = [_Group(
            q_index=rows[:, None], q_valid=None, kv_slots=None, masks=None, out_rows=rows, out_sel=None,
            block_tables=torch.tensor([bt + [0] * (max_blocks - len(bt)) for bt in block_tables],
                                      dtype=torch.long, device=dev),
            ctx_lens=(pos + 1).to(dev))]
        return pos

    def decode_args(self):
        """What the fused decode step (inferd.model.fused_decode) needs when every row of this step
        decodes one token through the compiled kernel: (k cache, v cache, slot_mapping, block_tables,
        ctx_lens, block_size, scale, window); else None."""
        if self.kernel is None or len(self.groups) != 1 or self.groups[0].out_sel is not None:
            return None
        if self.windows is not None:  # the C++ layer loop takes one window for every layer
            return None
        g = self.groups[0]
        return (self.pool.k, self.pool.v, self.slot_mapping, g.block_tables, g.ctx_lens, self.pool.block_size,
                self.scale, self._window(0) or 0)

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows is not None else self.window

    def _with_kernel(self, layer, q, kc, vc, window) -> torch.Tensor:
        """Decodes through the compiled kernel; a prefill group (if any) through SDPA."""
        T, H, D = q.shape
        dec = self.groups[0]
        self.kernel_calls += 1
        qd = q[dec.out_rows] if len(self.groups) > 1 else q
        od = self.kernel.paged_decode(qd.float().contiguous(), kc, vc, dec.block_tables, dec.ctx_lens,
                                      self.pool.block_size, self.scale, window or 0)
        if len(self.groups) == 1:
            return od.view(T, H * D).to(q.dtype)
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        out[dec.out_rows] = od.view(-1, H * D).to(q.dtype)
        self._sdpa_group(self.groups[1], q.to(kc.dtype), kc, vc, out, window)
        return out

    def _sdpa_group(self, g: _Group, qc, kc, vc, out, window):
        B, Q = g.q_index.shape
        H, D = qc.shape[1], qc.shape[2]
        qg = qc[g.q_index].permute(0, 2, 1, 3)  # [B, H, Q, D]
        kg = kc[g.kv_slots].permute(0, 2, 1, 3)  # [B, Hkv, K, D]
        vg = vc[g.kv_slots].permute(0, 2, 1, 3)
        if g.causal and window is None:
            o = attend(qg, kg, vg, causal=True, scale=self.scale, softcap=self.softcap)
        else:
            o = attend(qg, kg, vg, mask=g.masks[window], scale=self.scale, softcap=self.softcap)
        o = o.permute(0, 2, 1, 3).reshape(B * Q, H * D)
        if g.out_sel is not None:
            o = o[g.out_sel]
        out[g.out_rows] = o.to(out.dtype)

    def _group(self, bt, starts, lens, ctx, tok_start, dev, windows: set) -> _Group:
        bs = self.pool.block_size
        Q = int(lens.max())
        # keys from the first one this chunk's first query sees: with one window for every layer of
        # the call (a KV group, or a model with one window) that skips what no query here can see
        # (a window group's released blocks among it), a 4k-token prompt's window layers gather
        # window + chunk keys, not 4k
        (w_only,) = windows if len(windows) == 1 else (None,)
        lo = (starts - w_only + 1).clamp(min=0) if w_only is not None else torch.zeros_like(starts)
        K = int((ctx - lo).max())
        kpos = lo[:, None] + torch.arange(K)[None, :]  # [B, K] positions
        kidx = torch.minimum(kpos, (ctx - 1)[:, None])  # padding reads a real slot; the mask drops it
        slots = bt.gather(1, kidx // bs) * bs + kidx % bs
        qoff = torch.arange(Q)
        q_valid = qoff[None, :] < lens[:, None]  # [B, Q]
        q_index = tok_start[:, None] + torch.minimum(qoff[None, :], (lens - 1)[:, None])
        qpos = starts[:, None] + qoff[None, :]  # [B, Q]
        mask = kpos[:, None, :] <= qpos[:, :, None]
        mask &= kpos[:, None, :] < ctx[:, None, None]
        masks = {w: (mask if w is None else mask & (kpos[:, None, :] > qpos[:, :, None] - w)).unsqueeze(1).to(dev)
                 for w in windows}
        flat_valid = q_valid.flatten()
        return _Group(
            q_index=q_index.to(dev),
            q_valid=None if Q == 1 else q_valid.to(dev),
            kv_slots=slots.to(dev),
            masks=masks,
            out_rows=q_index.flatten()[flat_valid].to(dev),
            out_sel=None if Q == 1 else torch.nonzero(flat_valid).flatten().to(dev),
            block_tables=bt.contiguous().to(dev) if Q == 1 else None,
            ctx_lens=ctx.contiguous().to(dev) if Q == 1 else None,
            causal=(bt.shape[0] == 1 and Q > 1 and int(starts[0]) == 0 and int(lens[0]) == int(ctx[0])
                    and None in windows),  # for the layers without a window
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        row = layer
        if self.layout is not None:  # this layer's group: its pool row and its tables' slots
            row = self.layout.slot_of[layer]
            self.slot_mapping, self.groups = self._states[self.layout.group_of[layer]]
        kc, vc = self.pool.k[row], self.pool.v[row]
        cdt = kc.dtype
        if self.kernel is not None and k.dtype == cdt and v.dtype == cdt:
            self.kernel.write_kv(k, v, self.slot_mapping, kc, vc)
        else:
            kc.index_copy_(0, self.slot_mapping, k.to(cdt))
            vc.index_copy_(0, self.slot_mapping, v.to(cdt))
        T, H, D = q.shape
        qc = q.to(cdt)
        window = self._window(layer)
        if self.kernel is not None and self.groups and self.groups[0].out_sel is None:
            return self._with_kernel(layer, q, kc, vc, window)
        if len(self.groups) == 1 and self.groups[0].out_sel is None:  # all decodes: rows in order
            g = self.groups[0]
            o = attend(qc.unsqueeze(2), kc[g.kv_slots].transpose(1, 2), vc[g.kv_slots].transpose(1, 2),
                       mask=g.masks[window], scale=self.scale, softcap=self.softcap)
            return o.view(T, H * D).to(q.dtype)
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        for g in self.groups:
            self._sdpa_group(g, qc, kc, vc, out, window)
        return out

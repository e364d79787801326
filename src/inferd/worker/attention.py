"""Attention over the paged KV cache, for one flat batch of sequences.

`PagedAttention.prepare` turns the step's block tables into index tensors once; the per-layer
call then writes the new keys/values into their slots (one native call; quantized to int8 rows
for an int8 cache) and attends per group, reading the cache in place:

- decodes (one query each) through a compiled decode kernel: csrc/cpu/paged_attention_impl.h for
  float32 / bf16 caches; csrc/cpu/flash_attention_impl.h's split decode for int8 caches and
  soft-capped models (each sequence's keys cut into splits run on every core, merged);
- prefill chunks (and chunks of mixed steps) through the tiled prefill kernel
  (flash_attention_impl.h): the chunk's queries walk the sequence's own blocks tile by tile with an
  online softmax; causality, windows and soft-capping per tile. No gathered copy of the context, no
  [queries x keys] mask: memory grows with the KV cache only.

Without the native kernels (INFERD_NO_NATIVE, no compiler, a head_dim not a multiple of 16, a
non-CPU device) every group takes the torch path: K/V gathered into a padded copy and SDPA with an
explicit mask. That fallback is said once in the log and counted per call (`fallback_calls`).

At large batch, decode attention is bound by reading the KV cache, so the cache follows the model
dtype (bf16 halves the bytes) or is int8 (--kv-cache-dtype int8: a little over half again);
attention maths run in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import logging

from inferd.model.layers import attend
from inferd.worker.kv_pool import INT8, KVLayout, KVPool, dequantize_rows, quantize_rows

log = logging.getLogger("inferd")

# caches the compiled kernels read (float16 takes the torch path)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, INT8)


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
    # the tiled prefill kernel's: per sequence its first position, new tokens and first row of the batch
    starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    qrows: torch.Tensor | None = None


class PagedAttention:
    def __init__(self, pool: KVPool, head_dim: int, sliding_window: int | None | list = None,
                 use_kernel: bool = True, scale: float | None = None, layout: KVLayout | None = None,
                 softcap: float | None = None):
        """`sliding_window`: one window for every layer, or a list of one per layer (None where a layer
        sees the whole context: Gemma's global layers); model.config.attention_windows gives it.
        `scale`: the softmax scale (default head_dim ** -0.5; Gemma's query_pre_attn_scalar).
        `layout`: KV groups (inferd.worker.kv_pool): each group's layers live in the pool rows and
        blocks of that group's own tables (prepare's kv_tables); None: every layer in one table.
        `softcap`: Gemma 2's attention-logit soft-capping (the tiled and split kernels compute it per
        tile; the float32/bf16 decode kernel has none, so such a model decodes through the split one).
        `use_kernel=False`: the torch path on purpose (tests hold the kernels to it)."""
        self.pool = pool
        self.head_dim = head_dim
        self.softcap = softcap
        self.quantized = pool.k.dtype == INT8
        self.layout = layout if layout is not None and layout.num_groups > 1 else None
        self._states: list[tuple] = []  # per KV group: (slot_mapping, groups), made by prepare
        self.kernel = None
        self.fallback_why = self._kernel_refusal(use_kernel)
        if self.fallback_why is None:
            from inferd.kernels import native

            self.kernel = native.ops()
            if self.kernel is None:
                self.fallback_why = f"native kernels unavailable ({native.build_error() or 'INFERD_NO_NATIVE'})"
        if self.fallback_why is not None and use_kernel:
            log.warning("paged attention: the torch fallback (K/V gathered, an explicit mask): %s", self.fallback_why)
        # decodes of a float32/bf16 cache without soft-capping take the older kernel; the rest the split one
        self.split_decode = self.quantized or softcap is not None
        self.kernel_calls = 0  # decode groups served by a compiled decode kernel (tests check it ran)
        self.split_decode_calls = 0  # of them, through the split decode kernel
        self.prefill_kernel_calls = 0  # prefill groups through the tiled kernel
        self.fallback_calls = 0  # layer calls the torch path served (0 wherever the kernels run)
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.window = sliding_window  # as given, to hand on (a draft model's attention)
        self.windows = sliding_window if isinstance(sliding_window, list) else None
        self._all_windows = set(self.windows) if self.windows is not None else {sliding_window}
        self.slot_mapping: torch.Tensor | None = None
        self.groups: list[_Group] = []

    def _kernel_refusal(self, use_kernel: bool) -> str | None:
        """Why this attention cannot run the compiled kernels, or None where it can."""
        if not use_kernel:
            return "use_kernel=False"
        if self.pool.k.device.type != "cpu":
            return f"the KV cache is on {self.pool.k.device.type}"
        if self.pool.k.dtype not in KERNEL_DTYPES:
            return f"a {str(self.pool.k.dtype).replace('torch.', '')} KV cache"
        if self.head_dim % 16:
            return f"head_dim {self.head_dim} is not a multiple of 16"
        return None

    def prepare(self, block_tables: list[list[int]], starts: list[int], lengths: list[int],
                kv_tables: list[list[list[int]]] | None = None, verify: list[bool] | None = None):
        """One entry per sequence: its block table, first new position, number of new tokens (and,
        with KV groups, its tables of groups 1..). `verify` (which chunks are a token and its guesses)
        matters to SpecPagedAttention only."""
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
            if not idx.numel():
                continue
            if self.kernel is not None:
                self.groups.append(self._kernel_group(bt[idx], starts_t[idx], lens_t[idx], ctx[idx], tok_start[idx],
                                                      dev))
            else:
                self.groups.append(self._group(bt[idx], starts_t[idx], lens_t[idx], ctx[idx], tok_start[idx], dev,
                                               windows))
        return pos

    def _kernel_group(self, bt, starts, lens, ctx, tok_start, dev) -> _Group:
        """What the kernels need of a group: block tables and lengths, never gather indices or masks."""
        Q = int(lens.max())
        if Q == 1:  # decodes: their rows, each one query
            return _Group(q_index=tok_start[:, None].to(dev), q_valid=None, kv_slots=None, masks=None,
                          out_rows=tok_start.to(dev), out_sel=None, block_tables=bt.contiguous().to(dev),
                          ctx_lens=ctx.contiguous().to(dev))
        rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(tok_start, lens)])
        return _Group(q_index=rows[:, None].to(dev), q_valid=None, kv_slots=None, masks=None, out_rows=rows.to(dev),
                      out_sel=rows.to(dev), block_tables=bt.contiguous().to(dev), starts=starts.contiguous().to(dev),
                      lens=lens.contiguous().to(dev), qrows=tok_start.contiguous().to(dev))

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
        if self.windows is not None or self.softcap is not None:  # the C++ layer loop: one window, no cap
            return None
        g = self.groups[0]
        return (self.pool.k, self.pool.v, self.slot_mapping, g.block_tables, g.ctx_lens, self.pool.block_size,
                self.scale, self._window(0) or 0)

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows is not None else self.window

    def _decode(self, g: _Group, q, kc, vc, window) -> torch.Tensor:
        """[rows, H, D] float32 of a decode group through a compiled kernel."""
        self.kernel_calls += 1
        qd = q if g.out_sel is None and q.shape[0] == g.out_rows.shape[0] else q[g.out_rows]
        qd = qd.float().contiguous()
        if self.split_decode:
            self.split_decode_calls += 1
            return self.kernel.paged_decode_split(qd, kc, vc, g.block_tables, g.ctx_lens, self.pool.block_size,
                                                  self.scale, window or 0, self.softcap or 0.0)
        return self.kernel.paged_decode(qd, kc, vc, g.block_tables, g.ctx_lens, self.pool.block_size, self.scale,
                                        window or 0)

    def _with_kernel(self, layer, q, kc, vc, window) -> torch.Tensor:
        """Every group through the compiled kernels, each reading the cache in place."""
        T, H, D = q.shape
        if len(self.groups) == 1 and self.groups[0].starts is None:  # decodes only, rows in order
            return self._decode(self.groups[0], q, kc, vc, window).view(T, H * D).to(q.dtype)
        out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
        qf = q if q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == D else q.float().contiguous()
        for g in self.groups:
            if g.starts is None:
                out[g.out_rows] = self._decode(g, q, kc, vc, window)
            else:
                self.prefill_kernel_calls += 1
                self.kernel.paged_prefill(qf, kc, vc, g.block_tables, g.starts, g.lens, g.qrows,
                                          self.pool.block_size, self.scale, window or 0, self.softcap or 0.0, out)
        out = out.view(T, H * D)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _gather(self, c: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The torch path's K or V rows at `slots`, in a dtype SDPA takes (an int8 cache dequantized)."""
        rows = c[slots]
        return dequantize_rows(rows, self.head_dim) if self.quantized else rows

    def _sdpa_group(self, g: _Group, qc, kc, vc, out, window):
        B, Q = g.q_index.shape
        H, D = qc.shape[1], qc.shape[2]
        qg = qc[g.q_index].permute(0, 2, 1, 3)  # [B, H, Q, D]
        kg = self._gather(kc, g.kv_slots).permute(0, 2, 1, 3)  # [B, Hkv, K, D]
        vg = self._gather(vc, g.kv_slots).permute(0, 2, 1, 3)
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
        if self.kernel is not None and self.quantized:
            self.kernel.write_kv_q8(k, v, self.slot_mapping, kc, vc)
        elif self.kernel is not None and k.dtype == cdt and v.dtype == cdt:
            self.kernel.write_kv(k, v, self.slot_mapping, kc, vc)
        elif self.quantized:
            kc.index_copy_(0, self.slot_mapping, quantize_rows(k))
            vc.index_copy_(0, self.slot_mapping, quantize_rows(v))
        else:
            kc.index_copy_(0, self.slot_mapping, k.to(cdt))
            vc.index_copy_(0, self.slot_mapping, v.to(cdt))
        if self.kernel is not None and self.groups:
            return self._with_kernel(layer, q, kc, vc, self._window(layer))
        self.fallback_calls += 1
        T, H, D = q.shape
        qc = q.float() if self.quantized else q.to(cdt)
        window = self._window(layer)
        if len(self.groups) == 1 and self.groups[0].out_sel is None:  # all decodes: rows in order
            g = self.groups[0]
            o = attend(qc.unsqueeze(2), self._gather(kc, g.kv_slots).transpose(1, 2),
                       self._gather(vc, g.kv_slots).transpose(1, 2), mask=g.masks[window], scale=self.scale,
                       softcap=self.softcap)
            return o.view(T, H * D).to(q.dtype)
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        for g in self.groups:
            self._sdpa_group(g, qc, kc, vc, out, window)
        return out

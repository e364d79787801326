"""The pooling step of an embedding model: per-sequence vectors from the last layer's hidden states
of a flat token batch, and the attention a pooling forward uses (no KV cache).

A pooling batch is one flat run of tokens with its sequences' lengths, never a padded grid: the
linear layers (most of the work) compute exactly the real tokens, and only attention needs the
sequence boundaries, which `SequenceAttention` keeps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.model.layers import fused_ops

POOLING_MODES = ("mean", "cls", "last")


@dataclass(frozen=True)
class PoolingConfig:
    """How one model's vectors are made: `mode` over each sequence's tokens, then (with `normalize`)
    scaled to unit length. `max_seq_length`: the longest input the model takes (sentence-transformers'
    own limit, which may be shorter than the position table)."""
    mode: str = "last"
    normalize: bool = True
    max_seq_length: int | None = None


def pool(hidden: torch.Tensor, lengths: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """hidden [T, H] of sequences laid end to end, `lengths` each -> [len(lengths), H] in fp32."""
    if mode == "mean":
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        out = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
        out.index_add_(0, seg, hidden.float())
        out /= torch.tensor(lengths, dtype=torch.float32).unsqueeze(1)
    elif mode in ("cls", "last"):
        ends = torch.tensor(lengths).cumsum(0)
        rows = ends - torch.tensor(lengths) if mode == "cls" else ends - 1
        out = hidden[rows].float()
    else:
        raise ValueError(f"unknown pooling mode {mode!r}")
    # sentence-transformers' Normalize: x / max(|x|, 1e-12)
    return F.normalize(out, p=2.0, dim=1) if normalize else out


def length_buckets(lengths: list[int], slack: float = 1.25, pad: int = 8) -> list[list[int]]:
    """Sequence indices grouped by length, shortest first: a group's longest is within `slack` times
    (plus `pad` tokens) of its shortest, so padding a group to its longest wastes little."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= slack * lengths[groups[-1][0]] + pad:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _one_buffer(q, k, v) -> tuple[torch.Tensor, list[int]] | None:
    """(buffer, column offsets) when q, k, v are column slices of one contiguous [T, W] buffer (a fused
    q/k/v projection's output, viewed per head), else None. Gathering whole rows of it is one
    memcpy-like copy per row; gathering each strided head view is three element-wise ones (measured
    ~4x slower here). Found by storage and strides: inference mode keeps no view's base."""
    w = q.stride(0)
    starts = [x.storage_offset() for x in (q, k, v)]
    first = min(starts)
    if any(x.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() or x.stride(0) != w
           or x.stride(-1) != 1 or x.stride(1) != x.shape[2] or x.shape[0] != q.shape[0] for x in (k, v)):
        return None
    cols = [s - first for s in starts]
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2] or any(c + x.shape[1] * x.shape[2] > w
                                                                for c, x in zip(cols, (q, k, v))):
        return None
    return q.as_strided((q.shape[0], w), (w, 1), first), cols


class SequenceAttention:
    """Attention over a flat batch where each sequence sees only itself: bidirectionally (encoders)
    or causally (a decoder run as a pooling model). `attn(layer, q, k, v)` with q [T, Hq, D] and
    k, v [T, Hkv, D] -> [T, Hq * D], as the decoders' backends answer.

    Only attention sees sequences: the linear layers compute the flat batch's real tokens. Three
    ways, measured by benchmarks/embeddings.py:
    - `kernel` (the default where the native kernels load, CPU fp32/bf16): one C++ call a layer
      (csrc/cpu/varlen_attention_impl.h) reading q/k/v in place from the fused projection and
      writing each output row once: no padding, no copies.
    - `bucket` (the torch fallback): sequences of similar length gathered into one padded SDPA call
      per group (a key mask where lengths differ; causal needs none, its padding sits after every
      real query). torch's CPU flash kernel pays a fixed cost per call that 64 small calls feel.
    - `loop`: one SDPA call per sequence, no padding at all.
    The block-diagonal alternative (one T x T mask) costs the square of the whole batch."""

    def __init__(self, lengths: list[int], scale: float, causal: bool, strategy: str = "kernel"):
        self.lengths = lengths
        self.scale = scale
        self.causal = causal
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self.total = self.starts[-1]
        self.padded_tokens = 0  # attention rows computed past a sequence's end (bucket padding)
        self.strategy = strategy
        self.groups = length_buckets(lengths) if strategy == "bucket" and len(lengths) > 1 else None
        self._plans: list | None = None
        self._starts: torch.Tensor | None = None
        self.kernel_calls = 0

    def _plan(self, device):
        """Per group, built once a forward: the flat rows it reads (past a sequence's end: rows its mask
        hides), which of its padded rows are real and the flat rows they go back to, its key mask."""
        plans = []
        for g in self.groups:
            lens = [self.lengths[i] for i in g]
            top = max(lens)
            rows = torch.cat([torch.arange(self.starts[i], self.starts[i] + top) for i in g]).clamp_(max=self.total - 1)
            real = torch.cat([torch.arange(j * top, j * top + n) for j, n in enumerate(lens)])
            back = torch.cat([torch.arange(self.starts[i], self.starts[i] + n) for i, n in zip(g, lens)])
            mask = None
            if not self.causal and min(lens) != top:
                mask = (torch.arange(top)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].to(device)
            plans.append((len(g), top, rows.to(device), real.to(device), back.to(device), mask))
            self.padded_tokens += len(g) * top - sum(lens)
        return plans

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, hq, d = q.shape
        gqa = k.shape[1] != hq
        if self.strategy == "kernel":
            ops = fused_ops(q)
            if ops is not None and q.stride(1) == d and k.stride(1) == d and v.stride(1) == d:
                if self._starts is None:
                    self._starts = torch.tensor(self.starts, dtype=torch.long)
                self.kernel_calls += 1
                return ops.varlen_attention(q, k, v, self._starts, self.scale, self.causal)
        if self.groups is None:
            if self.strategy != "loop" and len(self.lengths) > 1:  # the kernel declined: buckets
                self.groups = length_buckets(self.lengths)
                return self(layer, q, k, v)
            return self._loop(q, k, v, gqa)
        if self._plans is None:
            self._plans = self._plan(q.device)
        out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
        shared = _one_buffer(q, k, v)
        for b, top, rows, real, back, mask in self._plans:
            if shared is not None:  # one gather of whole rows (memcpy-sized), then the q/k/v columns as views
                base, cols = shared
                g = base.index_select(0, rows).view(b, top, base.shape[1])
                qg, kg, vg = (g[..., c:c + x.shape[1] * d].view(b, top, x.shape[1], d).transpose(1, 2)
                              for c, x in zip(cols, (q, k, v)))
            else:
                qg, kg, vg = (x.index_select(0, rows).view(b, top, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=self.causal, scale=self.scale,
                                               enable_gqa=gqa)
            # one gather of the real rows and one scatter back, whatever the group's size
            out.index_copy_(0, back, o.transpose(1, 2).reshape(b * top, hq * d).index_select(0, real))
        return out

    def _loop(self, q, k, v, gqa: bool) -> torch.Tensor:
        t, hq, d = q.shape
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        for s, e in zip(self.starts, self.starts[1:]):
            # 4-d: torch's CPU flash kernel takes [B, H, L, D] only (3-d inputs go the unfused math way)
            o = F.scaled_dot_product_attention(q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2),
                                               v[None, s:e].transpose(1, 2), is_causal=self.causal,
                                               scale=self.scale, enable_gqa=gqa)
            out[s:e] = o[0].transpose(0, 1)
        return out.view(t, hq * d)

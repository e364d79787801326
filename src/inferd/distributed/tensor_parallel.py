"""Tensor parallelism as one model rewrite: `apply_tp(model, shard, comm)` cuts a loaded model down to
one rank's share (Megatron's split, as gpt-fast's `apply_tp` does it).

- q/k/v and gate/up are column-parallel: a rank keeps the output rows of its heads and of its slice
  of the MLP, and computes them with no communication.
- o and down are row-parallel: a rank keeps the matching input columns and produces a partial sum;
  one all-reduce each per layer makes the full residual update on every rank.
- The embedding and lm_head are vocab-parallel: a rank holds the rows of its vocabulary slice. The
  embedding zeroes the ids it does not own and all-reduces (one more all-reduce a step, as vLLM's
  VocabParallelEmbedding); the lm_head's logits are gathered to rank 0 by the runner, which samples.

Attention splits by KV group, so a query head stays with the key/value head it reads: with fewer KV
heads than ranks each KV head is replicated over world / n_kv ranks (vLLM's rule) and its group's
query heads are divided among them. Groups and the vocabulary split unevenly where they must (the
default model's 3 KV groups on 2 ranks: 2 + 1), stated by `plan` and logged.

The rewrite slices whatever layer it finds by shape, so the quantized layers (inferd's int4/int8
codes, before they are handed to a kernel) shard the same way; a cut through a quantization group is
a clear error. Pure functions below compute the split; `apply_tp` only moves tensors.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferd.errors import InferdError


def split_evenly(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, end) of each part of range(n), sizes differing by at most `align` (the first parts
    larger); with align > 1 every boundary is a multiple of it (n must be)."""
    if n % align:
        align = 1
    units = n // align
    base, extra = divmod(units, parts)
    out, a = [], 0
    for r in range(parts):
        b = a + (base + (r < extra)) * align
        out.append((a, b))
        a = b
    return out


@dataclass(frozen=True)
class Shard:
    """What one rank holds (global indices)."""
    rank: int
    world: int
    kv_heads: tuple[int, ...]
    q_heads: tuple[int, ...]
    ff: tuple[int, int]
    vocab: tuple[int, int]

    def describe(self) -> str:
        return (f"rank {self.rank}: {len(self.q_heads)} query heads {_span(self.q_heads)}, "
                f"{len(self.kv_heads)} KV heads {_span(self.kv_heads)}, MLP {self.ff[0]}:{self.ff[1]}, "
                f"vocab {self.vocab[0]}:{self.vocab[1]}")


def _span(ix: tuple[int, ...]) -> str:
    return f"{ix[0]}-{ix[-1]}" if len(ix) > 1 else str(ix[0])


def plan(n_heads: int, n_kv: int, intermediate: int, vocab: int, world: int, align: int = 32) -> list[Shard]:
    """Every rank's share of a Llama-family model on `world` ranks."""
    if world < 1:
        raise InferdError("tensor_parallel_size must be >= 1")
    if n_heads % n_kv:
        raise InferdError(f"{n_heads} query heads do not form groups over {n_kv} KV heads")
    group = n_heads // n_kv
    heads: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if n_kv >= world:
        for a, b in split_evenly(n_kv, world):
            heads.append((tuple(range(a, b)), tuple(range(a * group, b * group))))
    else:
        if world % n_kv:
            raise InferdError(f"tensor_parallel_size {world} cannot share {n_kv} KV heads: with fewer KV heads than "
                              f"ranks, the ranks must be a multiple of the KV heads (each KV head replicated)")
        reps = world // n_kv
        if group < reps:
            raise InferdError(f"tensor_parallel_size {world} leaves a rank without a query head "
                              f"({n_heads} query heads)")
        for r in range(world):
            kv = r // reps
            a, b = split_evenly(group, reps)[r % reps]
            heads.append(((kv,), tuple(range(kv * group + a, kv * group + b))))
    ffs = split_evenly(intermediate, world, align)
    vocabs = split_evenly(vocab, world)
    for (a, b) in ffs:
        if a == b:
            raise InferdError(f"tensor_parallel_size {world} leaves a rank no MLP columns ({intermediate})")
    return [Shard(r, world, heads[r][0], heads[r][1], ffs[r], vocabs[r]) for r in range(world)]


def plan_of(cfg, world: int) -> list[Shard]:
    """`plan` for a ModelConfig."""
    return plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size, world)


def shard_of(cfg, rank: int, world: int) -> Shard:
    return plan_of(cfg, world)[rank]


# -- slicing a linear of any kind by shape ---------------------------------------------------------

def _tensors(m: nn.Module):
    for d in (m._parameters, m._buffers):
        for name, t in list(d.items()):
            if t is not None:
                yield d, name, t


def _put(d: dict, name: str, old, new: torch.Tensor):
    d[name] = nn.Parameter(new, requires_grad=False) if isinstance(old, nn.Parameter) else new


def take_rows(m: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The layer computing only output features `rows` (column parallelism): every tensor indexed by
    output feature keeps those rows; the codes' layout within a row is untouched."""
    if hasattr(m, "take_rows"):  # a layer of parts (quant.gguf_layer.FusedParts) cuts each part
        return m.take_rows(rows, take_rows)
    n = m.out_features
    out = copy.copy(m)
    out._parameters, out._buffers = dict(m._parameters), dict(m._buffers)
    for d, name, t in _tensors(out):
        if t.dim() >= 1 and t.shape[0] == n:
            _put(d, name, t, t.index_select(0, rows).contiguous())
    out.out_features = int(rows.numel())
    return out


def take_cols(m: nn.Module, a: int, b: int) -> nn.Module:
    """The layer reading only input features [a, b) (row parallelism). Per-row tensors with a second
    axis proportional to the input (weights, packed codes, group scales) are cut in proportion; a
    cut inside a quantization group (or a 32-code nibble block) is an error."""
    if hasattr(m, "take_cols"):
        return m.take_cols(a, b, take_cols)
    n, k = m.out_features, m.in_features
    if hasattr(m, "qweight") and (a % 32 or b % 32):
        raise InferdError(f"tensor parallelism would cut the int4 layer [{n}, {k}] at column {a if a % 32 else b}, "
                          "inside a 32-code block")
    out = copy.copy(m)
    out._parameters, out._buffers = dict(m._parameters), dict(m._buffers)
    for d, name, t in _tensors(out):
        if t.dim() == 2 and t.shape[0] == n:
            w = t.shape[1]
            if (a * w) % k or (b * w) % k:
                raise InferdError(f"tensor parallelism would cut the layer [{n}, {k}] at column "
                                  f"{a if (a * w) % k else b}, inside a quantization group of {k // w}")
            _put(d, name, t, t[:, a * w // k: b * w // k].contiguous())
    out.in_features = b - a
    return out


def _rows(ranges) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)


# -- the modules that talk ------------------------------------------------------------------------

class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over ranks in place. The bias, if
    any, is added by rank 0 only."""

    def __init__(self, inner: nn.Module, comm, rank: int):
        super().__init__()
        if rank != 0 and getattr(inner, "bias", None) is not None:
            inner.bias = None
        self.inner = inner
        self.comm = comm
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).contiguous()
        self.comm.all_reduce_(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; ids outside them give zeros, and the all-reduce fills
    each row from the one rank that owns it (a sum with zeros: exact). The rows are a float table's
    slice, or read from a table kept in the file (model.gguf_embedding.GGUFEmbedding: `table`), which
    costs a rank no memory at all."""

    def __init__(self, weight: torch.Tensor | None, start: int, comm, dtype: torch.dtype | None = None,
                 table: nn.Module | None = None, end: int | None = None):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=False)
        self.table = table
        self.start, self.comm = start, comm
        self.n = weight.shape[0] if weight is not None else end - start
        # a 16-bit table (a GGUF's F16 one) widens its rows to this
        self.dtype = dtype or (weight.dtype if weight is not None else table.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        n = self.n
        own = (local >= 0) & (local < n)
        local = local.clamp(0, max(n - 1, 0))
        if self.table is not None:
            x = self.table(local + self.start).to(self.dtype)
        else:
            x = F.embedding(local, self.weight).to(self.dtype)
        x = x.masked_fill(~own.unsqueeze(-1), 0).contiguous()
        self.comm.all_reduce_(x)
        return x


def split_experts(experts: nn.ModuleList, rank: int, world: int, comm):
    """A mixture of experts across the ranks whole: rank r keeps experts r, r + world, ...; each rank
    runs its own experts over the tokens routed to them and one all-reduce sums the ranks' outputs
    (one a layer, as the dense MLP's down projection). Whole experts rather than a slice of every
    expert: each expert's matmul stays as wide as on one rank, and the router needs no change."""
    experts.owned = frozenset(range(rank, len(experts), world))
    experts.comm = comm
    for e in range(len(experts)):
        if e not in experts.owned:
            experts[e] = nn.Module()  # its weights freed on this rank


def apply_tp(model: nn.Module, shard: Shard, comm) -> nn.Module:
    """Rewrite a loaded LlamaModel in place to `shard`'s share; `comm` all-reduces (`all_reduce_(x)`)."""
    cfg = model.cfg
    D, nq, nk, ff = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    q0, q1 = shard.q_heads[0], shard.q_heads[-1] + 1
    k0, k1 = shard.kv_heads[0], shard.kv_heads[-1] + 1
    qkv_rows = _rows([(q0 * D, q1 * D), ((nq + k0) * D, (nq + k1) * D), ((nq + nk + k0) * D, (nq + nk + k1) * D)])
    a, b = shard.ff
    gu_rows = _rows([(a, b), (ff + a, ff + b)])
    for layer in model.layers:
        layer.qkv_proj = take_rows(layer.qkv_proj, qkv_rows)
        layer.o_proj = RowParallel(take_cols(layer.o_proj, q0 * D, q1 * D), comm, shard.rank)
        layer.n_heads, layer.n_kv = q1 - q0, k1 - k0
        if not layer.dense_mlp:
            split_experts(layer.experts, shard.rank, shard.world, comm)
            continue
        layer.gate_up_proj = take_rows(layer.gate_up_proj, gu_rows)
        layer.down_proj = RowParallel(take_cols(layer.down_proj, a, b), comm, shard.rank)
        layer.ff = b - a
    v0, v1 = shard.vocab
    tied = model.lm_head.weight is getattr(model.embed_tokens, "weight", None) if hasattr(model.lm_head, "weight") else False
    emb = model.embed_tokens
    if getattr(emb, "in_place", False):  # a table kept in the file's type, read in place (model.gguf_embedding)
        model.embed_tokens = VocabParallelEmbedding(None, v0, comm, emb.dtype, table=emb, end=v1)
    elif isinstance(emb, nn.Embedding) or getattr(emb, "float16_weights", False):
        model.embed_tokens = VocabParallelEmbedding(emb.weight[v0:v1].contiguous(), v0, comm,
                                                    getattr(emb, "dtype", None))
    else:
        raise InferdError(f"tensor parallelism needs a float embedding table, not {type(emb).__name__}")
    if tied:
        head = copy.copy(model.lm_head)
        head._parameters, head._buffers = dict(model.lm_head._parameters), dict(model.lm_head._buffers)
        # a float head's weight is a parameter, a 16-bit one's (quant.half.HalfLinear) a buffer
        (head._parameters if "weight" in head._parameters else head._buffers)["weight"] = model.embed_tokens.weight
        head.out_features = v1 - v0
        model.lm_head = head
    else:
        model.lm_head = take_rows(model.lm_head, torch.arange(v0, v1))
    # every rank's slice of the vocabulary: what the runner's logits gather needs
    model.tp_vocab_widths = [s.vocab[1] - s.vocab[0] for s in plan_of(cfg, shard.world)]
    return model


def shard_lora(weights: dict, shard: Shard, cfg) -> dict:
    """A LoRA adapter's {(layer, projection): (A [r, in], B [out, r])} cut to `shard`'s share, as its
    base layer is cut: a column-parallel projection (q, k, v, gate, up) keeps B's rows of its output
    slice and all of A; a row-parallel one (o, down) keeps A's columns of its input slice and all of
    B, so its delta is a partial sum that the layer's all-reduce completes."""
    D = cfg.head_dim
    q0, q1 = shard.q_heads[0] * D, (shard.q_heads[-1] + 1) * D
    k0, k1 = shard.kv_heads[0] * D, (shard.kv_heads[-1] + 1) * D
    f0, f1 = shard.ff
    rows = {"q_proj": (q0, q1), "k_proj": (k0, k1), "v_proj": (k0, k1), "gate_proj": (f0, f1), "up_proj": (f0, f1)}
    cols = {"o_proj": (q0, q1), "down_proj": (f0, f1)}
    out = {}
    for (layer, proj), (a, b) in weights.items():
        if proj in rows:
            lo, hi = rows[proj]
            out[(layer, proj)] = (a, b[lo:hi].contiguous())
        else:
            lo, hi = cols[proj]
            out[(layer, proj)] = (a[:, lo:hi].contiguous(), b)
    return out

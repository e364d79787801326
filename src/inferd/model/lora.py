"""LoRA adapters served side by side: rows of different adapters (and of none) in one step.

`apply_lora(model, max_loras, max_rank)` wraps each projection of every layer (q, k, v, o, gate,
up, down; q/k/v and gate/up are fused modules here, so a module has one "part" per projection) in a
`WithLoRA` holding `max_loras` slots of adapter weights, rank padded to R:

    lora_a [slots, parts, R, in]    lora_b [slots, R, out] (part p's B as [R, n_p] at R * off_p)
    lora_ranks [slots, parts]       (0 where a slot's adapter leaves that projection alone)

B carries the adapter's scaling. A step's rows name their slot (-1: none) on the shared
`LoRAState`; per projection one call, `inferd::lora_add_` (csrc/cpu/lora_impl.h), adds each row's
B_s (A_s x) to the base layer's output: Punica's BGMV, each row gathering its own adapter's
weights, so the cost is the rows' own ranks, not slots x rows, and there is no pass per adapter.
The fused C++ decode step calls the same op after the same layers (model/fused_decode.py), so a
decode step with adapter rows stays one C++ call and equals the eager forward. Steps without
adapter rows skip all of it.

The base layer can be anything with the Linear interface (dense, int8/int4, GGUF blocks, W4A8):
the delta is added to its output in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.model.layers import fused_ops

# our fused module -> the projections it holds, in its output order (PEFT's target names)
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PROJECTIONS = tuple(p for parts in PARTS.values() for p in parts)


class LoRAState:
    """What every WithLoRA of a model reads in a step: each row's slot."""

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows: torch.Tensor | None = None  # [T] int64 slot per row (-1: none); None: no adapter row
        self.applies = 0  # LoRA products computed in the last step (one per projection per layer)

    def set_rows(self, slots_per_row: torch.Tensor | None):
        """slots_per_row: [T] int, -1 for a row without adapter; None: no adapter in the step."""
        self.applies = 0
        if slots_per_row is None or not bool((slots_per_row >= 0).any()):
            self.rows = None
            return
        self.rows = slots_per_row.to(torch.int64).contiguous()

    def clear(self):
        self.rows = None


class WithLoRA(nn.Module):
    """base(x) + each row's adapter delta; see the module docstring."""

    def __init__(self, base: nn.Module, state: LoRAState, part_outs: list[int]):
        super().__init__()
        self.lora_base = base
        self.state = state
        self.part_outs = list(part_outs)
        self.in_features = base.in_features
        self.out_features = base.out_features
        n, r, p = state.max_loras, state.max_rank, len(part_outs)
        self.register_buffer("lora_a", torch.zeros(n, p, r, self.in_features), persistent=False)
        self.register_buffer("lora_b", torch.zeros(n, r, self.out_features), persistent=False)
        self.register_buffer("lora_ranks", torch.zeros(n, p, dtype=torch.int64), persistent=False)

    def set_slot(self, slot: int, a: list[torch.Tensor | None], b: list[torch.Tensor | None]):
        """Write one adapter into `slot`: per part its A [r, in] and B [out_p, r] (scaling folded in),
        or None where the adapter leaves that projection alone. In place: the fused step holds these."""
        r_max = self.state.max_rank
        self.lora_a[slot] = 0
        self.lora_b[slot] = 0
        off = 0
        for j, (aj, bj, n) in enumerate(zip(a, b, self.part_outs)):
            k = 0 if aj is None else aj.shape[0]
            if k:
                self.lora_a[slot, j, :k] = aj.to(self.lora_a.dtype)
                block = self.lora_b[slot].view(-1)[r_max * off: r_max * (off + n)].view(r_max, n)
                block[:k] = bj.t().to(self.lora_b.dtype)
            self.lora_ranks[slot, j] = k
            off += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lora_base(x)
        rows = self.state.rows
        if rows is None:
            return y
        self.state.applies += len(self.part_outs)
        yf = y if y.dtype == torch.float32 and y.is_contiguous() else y.float().contiguous()
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        ops = fused_ops(xf)
        if ops is not None and xf.shape[1] % 16 == 0:
            ops.lora_add_(yf, xf, self.lora_a, self.lora_b, rows, self.lora_ranks, self.part_outs)
        else:
            self._add_torch(yf, xf, rows)
        return yf if yf.dtype == y.dtype else yf.to(y.dtype)

    def _add_torch(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor):
        """The same sums without the native kernels (another device, no build): rows gathered."""
        sel = (rows >= 0).nonzero().squeeze(1)
        s = rows[sel]
        r = self.state.max_rank
        off = 0
        for j, n in enumerate(self.part_outs):
            a = self.lora_a[s, j]  # [t, R, in]
            b = self.lora_b[s].reshape(len(s), -1)[:, r * off: r * (off + n)].reshape(len(s), r, n)
            v = torch.einsum("tri,ti->tr", a, x[sel])
            y[sel, off:off + n] += torch.einsum("tr,trn->tn", v, b)
            off += n

    def fused_operands(self):
        """What the fused decode step needs to call the same op after this layer."""
        return self.lora_a, self.lora_b, self.lora_ranks, self.part_outs


def part_outs(layer, name: str) -> list[int]:
    """Output widths of a fused module's projections (this rank's share under tensor parallelism)."""
    lin = getattr(layer, name)
    if name == "qkv_proj":
        nq, nk, hd = layer.n_heads, layer.n_kv, layer.head_dim
        return [nq * hd, nk * hd, nk * hd]
    if name == "gate_up_proj":
        return [lin.out_features // 2] * 2
    return [getattr(lin, "inner", lin).out_features]


def apply_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRAState:
    """Wrap every layer's projections in WithLoRA (all slots empty); returns the shared state."""
    if getattr(model, "lora", None) is not None:
        return model.lora
    state = LoRAState(max_loras, max_rank)
    for layer in model.layers:
        for name in PARTS:
            base = getattr(layer, name, None)
            if base is None:
                if name in ("gate_up_proj", "down_proj"):  # routed experts (model/moe.py): not adapted
                    continue
                raise ValueError(f"layer has no {name}")
            if hasattr(base, "inner"):
                # row-parallel (tensor parallelism): the delta of this rank's input slice joins the
                # partial product before the all-reduce sums both
                base.inner = WithLoRA(base.inner, state, part_outs(layer, name))
                continue
            setattr(layer, name, WithLoRA(base, state, part_outs(layer, name)))
    model.lora = state
    return state

"""LoRA adapters served side by side: rows of different adapters (and of none) in one step.

`apply_lora(model, max_loras, max_rank)` wraps each projection of every layer (q, k, v, o, gate,
up, down; q/k/v and gate/up are fused modules here, so a module has one "part" per projection) in a
`WithLoRA` holding `max_loras` slots of zero-padded adapter weights stacked along the rank:

    A: [parts, slots * R, in]     B: [parts, out_p, slots * R]  (scaling folded into B)

A step's rows name their slot (or none) through one mask [T, slots * R], 1 over the row's slot's
R columns and 0 elsewhere, set on the shared `LoRAState` before the forward. Per projection that
is one shrink x @ A^T, the mask, one expand @ B^T: two matmuls whatever the number of adapters in
the batch, each row picking up its own adapter's product (Punica's BGMV, written as masked dense
matmuls: on the CPU a gather of per-row A and B would move more memory than it saves). A masked
column adds exact zeros, so a row's delta is its adapter's own up to the order of the sums. Only
the slots up to the highest one in use are multiplied. Steps without adapter rows skip all of it.

The base layer can be anything with the Linear interface (dense, int8/int4, GGUF blocks, W4A8):
the delta is added to its output in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

# our fused module -> the projections it holds, in its output order (PEFT's target names)
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PROJECTIONS = tuple(p for parts in PARTS.values() for p in parts)


class LoRAState:
    """What every WithLoRA of a model reads in a step: the row mask, and how many slots it spans."""

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.mask: torch.Tensor | None = None  # [T, used * R] or None: no adapter row in this step
        self.used = 0  # slots 0 .. used-1 are multiplied
        self.applies = 0  # LoRA products computed in the last step (one per projection per layer)

    def set_rows(self, slots_per_row: torch.Tensor | None):
        """slots_per_row: [T] int, -1 for a row without adapter; None: no adapter in the step."""
        self.applies = 0
        if slots_per_row is None or not bool((slots_per_row >= 0).any()):
            self.mask, self.used = None, 0
            return
        used = int(slots_per_row.max()) + 1
        r = self.max_rank
        cols = torch.arange(used * r) // r  # the slot each column belongs to
        self.mask = (cols[None, :] == slots_per_row[:, None]).to(torch.float32)
        self.used = used

    def clear(self):
        self.mask, self.used = None, 0


class WithLoRA(nn.Module):
    """base(x) + each row's adapter delta; see the module docstring."""

    def __init__(self, base: nn.Module, state: LoRAState, part_outs: list[int]):
        super().__init__()
        self.lora_base = base
        self.state = state
        self.part_outs = list(part_outs)
        self.in_features = base.in_features
        self.out_features = base.out_features
        n, r = state.max_loras, state.max_rank
        p = len(part_outs)
        self.register_buffer("lora_a", torch.zeros(p, n * r, self.in_features), persistent=False)
        self.register_buffer("lora_b", torch.zeros(sum(part_outs), n * r), persistent=False)

    def set_slot(self, slot: int, a: list[torch.Tensor | None], b: list[torch.Tensor | None]):
        """Write one adapter into `slot`: per part its A [r, in] and B [out_p, r] (scaling folded in),
        or None where the adapter leaves that projection alone."""
        r = self.state.max_rank
        cols = slice(slot * r, (slot + 1) * r)
        self.lora_a[:, cols] = 0
        self.lora_b[:, cols] = 0
        off = 0
        for j, (aj, bj, n) in enumerate(zip(a, b, self.part_outs)):
            if aj is not None:
                k = aj.shape[0]
                self.lora_a[j, slot * r: slot * r + k] = aj.to(self.lora_a.dtype)
                self.lora_b[off:off + n, slot * r: slot * r + k] = bj.to(self.lora_b.dtype)
            off += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lora_base(x)
        st = self.state
        if st.mask is None:
            return y
        w = st.used * st.max_rank
        xf = x.float()
        s = torch.matmul(xf, self.lora_a[:, :w].transpose(1, 2))  # [parts, T, w]: every part's shrink at once
        s = s * st.mask
        st.applies += len(self.part_outs)
        delta = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        off = 0
        for j, n in enumerate(self.part_outs):
            torch.matmul(s[j], self.lora_b[off:off + n, :w].t(), out=delta[:, off:off + n])
            off += n
        return (y.float() + delta).to(y.dtype)


def part_outs(layer, name: str) -> list[int]:
    """Output widths of a fused module's projections (this rank's share under tensor parallelism)."""
    lin = getattr(layer, name)
    if name == "qkv_proj":
        nq, nk, hd = layer.n_heads, layer.n_kv, layer.head_dim
        return [nq * hd, nk * hd, nk * hd]
    if name == "gate_up_proj":
        return [lin.out_features // 2] * 2
    return [lin.out_features]


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
            setattr(layer, name, WithLoRA(base, state, part_outs(layer, name)))
    model.lora = state
    return state

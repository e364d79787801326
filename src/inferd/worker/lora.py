"""A rank's LoRA adapters (vLLM's --enable-lora): which are loaded, which sit in the model's
`max_loras` slots (inferd.model.lora), and each step's rows -> slots.

Under tensor parallelism every rank holds every adapter, cut to its share by the `shard` function it
is handed (inferd.distributed.tensor_parallel.shard_lora); rank 0 decides the slots and its step
plans carry the slot writes, which the other ranks repeat (`apply_writes`).

Adapters live in this process's memory once loaded (any number); a step can hold rows of at most
`max_loras` of them, which the scheduler enforces at admission. An adapter needed by a step and not
in a slot is written into a free slot, else into the least recently used slot whose adapter no
running request uses (there is always one: the scheduler admitted the step).
"""
from __future__ import annotations

import logging

import torch

from inferd.errors import InferdError
from inferd.loading.lora import Adapter, load_adapter
from inferd.model.lora import PARTS, WithLoRA, apply_lora

log = logging.getLogger("inferd")


class LoRAManager:
    def __init__(self, model, model_config, max_loras: int, max_rank: int, shard=None):
        if max_loras < 1:
            raise InferdError("--max-loras must be at least 1")
        if max_rank < 1:
            raise InferdError("--max-lora-rank must be at least 1")
        self.model, self.config = model, model_config
        self.shard = shard  # adapter weights -> this rank's share (tensor parallelism), or None
        self.writes: list[tuple[int, str]] = []  # slot writes since the last plan took them
        self.max_loras, self.max_rank = max_loras, max_rank
        self.state = apply_lora(model, max_loras, max_rank)
        self.adapters: dict[str, Adapter] = {}
        self.slots: list[str | None] = [None] * max_loras
        self.last_used = [0] * max_loras
        self.clock = 0
        self.slot_writes = 0  # adapters written into a slot (a swap costs one)
        self.multi_adapter_steps = 0  # steps whose rows used two or more adapters
        self.lora_steps = 0  # steps with at least one adapter row
        self.applies_last = 0  # LoRA products in the last adapter step (projections x layers)

    # -- adapters ------------------------------------------------------------------------------------
    def add(self, name: str, path: str) -> Adapter:
        if not name or name in self.adapters:
            raise InferdError(f"LoRA adapter {name!r} is already loaded" if name else "a LoRA adapter needs a name")
        ad = load_adapter(name, path, self.config, self.max_rank)
        if self.shard is not None:
            ad.weights = self.shard(ad.weights)
        self.adapters[name] = ad
        log.info("LoRA adapter %s: rank %d, %d projections, %.1f MiB (%s)", name, ad.rank, len(ad.weights),
                 ad.nbytes() / 2**20, path)
        return ad

    def remove(self, name: str):
        """The caller checked that no live request uses it."""
        if name not in self.adapters:
            raise InferdError(f"no LoRA adapter {name!r} is loaded")
        del self.adapters[name]
        for s, held in enumerate(self.slots):
            if held == name:
                self.slots[s] = None

    def check(self, name: str):
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InferdError(f"unknown LoRA adapter {name!r} (loaded: {known})")

    # -- slots ---------------------------------------------------------------------------------------
    def _slot(self, name: str, keep: set[str]) -> int:
        self.clock += 1
        if name in self.slots:
            s = self.slots.index(name)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None]
            if free:
                s = free[0]
            else:
                movable = [s for s, held in enumerate(self.slots) if held not in keep]
                if not movable:
                    raise RuntimeError("more adapters in one step than --max-loras slots")
                s = min(movable, key=lambda i: self.last_used[i])
            self._write(s, self.adapters[name])
        self.last_used[s] = self.clock
        return s

    def _write(self, slot: int, ad: Adapter):
        for i, layer in enumerate(self.model.layers):
            for mod_name, projs in PARTS.items():
                mod = getattr(layer, mod_name, None)
                mod = getattr(mod, "inner", mod)  # a row-parallel layer holds the wrapped one
                if not isinstance(mod, WithLoRA):
                    continue
                got = [ad.weights.get((i, p)) for p in projs]
                mod.set_slot(slot, [g[0] if g else None for g in got], [g[1] if g else None for g in got])
        self.slots[slot] = ad.name
        self.slot_writes += 1
        self.writes.append((slot, ad.name))

    def take_writes(self) -> list[tuple[int, str]]:
        out, self.writes = self.writes, []
        return out

    def apply_writes(self, writes: list[tuple[int, str]]):
        """Repeat rank 0's slot writes (a no-op where they were made)."""
        for slot, name in writes:
            if self.slots[slot] != name:
                self._write(slot, self.adapters[name])
        self.writes.clear()

    def slots_for(self, requests: list) -> list[int] | None:
        """Per request its slot (-1: the base model), writing adapters in as needed; None when no
        request of the step has an adapter."""
        names = {r.lora for r in requests if r.lora is not None}
        if not names:
            return None
        return [-1 if r.lora is None else self._slot(r.lora, names) for r in requests]

    def set_step(self, slots: list[int] | None, num_new: list[int]):
        if slots is None:
            self.state.clear()
            return
        rows = torch.repeat_interleave(torch.tensor(slots), torch.tensor(num_new))
        self.state.set_rows(rows)
        self.lora_steps += 1
        if len({s for s in slots if s >= 0}) >= 2:
            self.multi_adapter_steps += 1

    def end_step(self):
        if self.state.rows is not None:
            self.applies_last = self.state.applies
        self.state.clear()

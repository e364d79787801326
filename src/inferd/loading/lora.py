"""A PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) -> per layer and
projection the A [r, in] and B [out, r] an engine slots in (inferd.model.lora), B scaled by
lora_alpha / r (rsLoRA: / sqrt(r)), every shape checked against the base model's before use.

What PEFT can express that this does not serve is refused by name, not ignored: DoRA, adapters on
the embedding or the output layer, extra trained modules (`modules_to_save`), GPT-2 style
fan_in_fan_out weights, and pickled `adapter_model.bin` files (never unpickled: convert them to
safetensors). The rules that need no tensor (the config, the names and shapes) are
`inferd.loading.peft`'s, which the API process shares.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from inferd.errors import InferdError
from inferd.loading.peft import ADAPTER_KEY, misfit, read_adapter_config, tensor_shapes, weights_file
from inferd.model.config import ModelConfig


@dataclass
class Adapter:
    name: str
    path: str
    rank: int  # the largest r of its projections
    weights: dict = field(default_factory=dict)  # (layer, projection) -> (A [r, in], B [out, r] scaled), fp32

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _pattern(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first pattern that matches the key's end."""
    for pat, v in (patterns or {}).items():
        if re.search(rf"(^|\.){pat}$", key) or key.endswith(pat):
            return v
    return default


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> Adapter:
    where = f"LoRA adapter {name!r} ({path})"
    conf = read_adapter_config(where, path)
    weights_path = weights_file(where, path)
    why = misfit(where, tensor_shapes(weights_path), cfg)  # every name and shape, before any tensor is read
    if why is not None:
        raise InferdError(why)
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors, whatever their class
        raise InferdError(f"{where}: unreadable adapter_model.safetensors ({e})") from None
    r_default, alpha_default = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    rslora = bool(conf.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = ADAPTER_KEY.match(key)
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    out = Adapter(name, path, 0)
    for (layer, proj), ab in sorted(halves.items()):
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if r > max_rank:
            raise InferdError(f"{where}: rank {r} is over --max-lora-rank {max_rank}")
        suffix = f"layers.{layer}.{proj}"
        alpha = float(_pattern(conf.get("alpha_pattern"), suffix, alpha_default))
        r_conf = int(_pattern(conf.get("rank_pattern"), suffix, r_default))
        if r_conf != r:
            raise InferdError(f"{where}: layer {layer} {proj} has rank {r}, its config says {r_conf}")
        scale = alpha / (math.sqrt(r) if rslora else r)
        out.weights[(layer, proj)] = (a.float().contiguous(), (b.float() * scale).contiguous())
        out.rank = max(out.rank, r)
    return out

"""A PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) -> per layer and
projection the A [r, in] and B [out, r] an engine slots in (inferd.model.lora), B scaled by
lora_alpha / r (rsLoRA: / sqrt(r)), every shape checked against the base model's before use.

What PEFT can express that this does not serve is refused by name, not ignored: DoRA, adapters on
the embedding or the output layer, extra trained modules (`modules_to_save`), GPT-2 style
fan_in_fan_out weights, and pickled `adapter_model.bin` files (never unpickled: convert them to
safetensors).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from inferd.errors import InferdError
from inferd.loading.checks import check_safetensors
from inferd.model.config import ModelConfig
from inferd.model.lora import PROJECTIONS

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class Adapter:
    name: str
    path: str
    rank: int  # the largest r of its projections
    weights: dict = field(default_factory=dict)  # (layer, projection) -> (A [r, in], B [out, r] scaled), fp32

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable projection of the base model."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}


def _pattern(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first pattern that matches the key's end."""
    for pat, v in (patterns or {}).items():
        if re.search(rf"(^|\.){pat}$", key) or key.endswith(pat):
            return v
    return default


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> Adapter:
    where = f"LoRA adapter {name!r} ({path})"
    conf_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(conf_path):
        raise InferdError(f"{where}: no adapter_config.json (a PEFT LoRA folder is expected)")
    try:
        with open(conf_path) as f:
            conf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InferdError(f"{where}: unreadable adapter_config.json ({e})") from None
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise InferdError(f"{where}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if conf.get(key):
            raise InferdError(f"{where}: {why} is not supported")
    if conf.get("modules_to_save"):
        raise InferdError(f"{where}: modules_to_save ({conf['modules_to_save']}) is not supported: only the "
                          f"projections {', '.join(PROJECTIONS)} can be adapted")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        extra = " (adapter_model.bin is a pickle, never loaded: save it as safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise InferdError(f"{where}: no adapter_model.safetensors{extra}")
    from safetensors.torch import load_file

    check_safetensors(weights_path)  # an untrusted file's header, bounded before anything is read
    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors, whatever their class
        raise InferdError(f"{where}: unreadable adapter_model.safetensors ({e})") from None
    r_default, alpha_default = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
    rslora = bool(conf.get("use_rslora", False))
    shapes = projection_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise InferdError(f"{where}: tensor {key!r} is not a LoRA A/B of a layer projection (supported: "
                              f"{', '.join(PROJECTIONS)})")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if proj not in shapes:
            raise InferdError(f"{where}: {proj} cannot be adapted (supported: {', '.join(PROJECTIONS)})")
        if layer >= cfg.num_hidden_layers:
            raise InferdError(f"{where}: layer {layer} is past the model's {cfg.num_hidden_layers} layers")
        halves.setdefault((layer, proj), {})[ab] = t
    if not halves:
        raise InferdError(f"{where}: no LoRA weights in adapter_model.safetensors")
    out = Adapter(name, path, 0)
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise InferdError(f"{where}: layer {layer} {proj} has lora_{'A' if 'A' in ab else 'B'} alone")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
            raise InferdError(f"{where}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                              f"model needs A [r, {n_in}] and B [{n_out}, r]: an adapter of another base model?")
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

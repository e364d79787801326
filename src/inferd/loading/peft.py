"""A PEFT LoRA folder read without torch: its `adapter_config.json`, the names and shapes of its
tensors (the safetensors header), and whether they fit a base model's projections.

`inferd.loading.lora` loads an adapter's weights under these rules; the API process, which never
imports torch, uses them to find which of several served models an adapter fits before any engine
starts (`inferd.engine.adapters`), from the models' headers alone (GGUF metadata, config.json).
"""
from __future__ import annotations

import json
import os
import re
import struct

from inferd.errors import InferdError
from inferd.loading.checks import check_safetensors, read_config_json
from inferd.loading.source import resolve_model
from inferd.model.config import ModelConfig, builtin_config, config_from_hf

ADAPTER_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable projection of the base model."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's names


def read_adapter_config(where: str, path: str) -> dict:
    """adapter_config.json, with what PEFT can express that inferd does not serve refused by name."""
    conf_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(conf_path):
        raise InferdError(f"{where}: no adapter_config.json (a PEFT LoRA folder is expected)")
    try:
        with open(conf_path) as f:
            conf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InferdError(f"{where}: unreadable adapter_config.json ({e})") from None
    if not isinstance(conf, dict):
        raise InferdError(f"{where}: adapter_config.json is not a JSON object")
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise InferdError(f"{where}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if conf.get(key):
            raise InferdError(f"{where}: {why} is not supported")
    if conf.get("modules_to_save"):
        raise InferdError(f"{where}: modules_to_save ({conf['modules_to_save']}) is not supported: only the "
                          f"projections {', '.join(PROJECTIONS)} can be adapted")
    return conf


def weights_file(where: str, path: str) -> str:
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        extra = " (adapter_model.bin is a pickle, never loaded: save it as safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise InferdError(f"{where}: no adapter_model.safetensors{extra}")
    check_safetensors(weights_path)  # an untrusted file's header, bounded before anything is read
    return weights_path


def tensor_shapes(weights_path: str) -> dict[str, list[int]]:
    """Each tensor's shape, from the header alone (checked by weights_file)."""
    with open(weights_path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def misfit(where: str, shapes: dict[str, list[int]], cfg: ModelConfig) -> str | None:
    """Why tensors of these shapes are not a LoRA adapter of `cfg`'s projections (None: they are)."""
    proj_shapes = projection_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        m = ADAPTER_KEY.match(key)
        if m is None:
            return (f"{where}: tensor {key!r} is not a LoRA A/B of a layer projection (supported: "
                    f"{', '.join(PROJECTIONS)})")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if proj not in proj_shapes:
            return f"{where}: {proj} cannot be adapted (supported: {', '.join(PROJECTIONS)})"
        if layer >= cfg.num_hidden_layers:
            return f"{where}: layer {layer} is past the model's {cfg.num_hidden_layers} layers"
        halves.setdefault((layer, proj), {})[ab] = list(shape)
    if not halves:
        return f"{where}: no LoRA weights in adapter_model.safetensors"
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            return f"{where}: layer {layer} {proj} has lora_{'A' if 'A' in ab else 'B'} alone"
        a, b = ab["A"], ab["B"]
        n_in, n_out = proj_shapes[proj]
        if len(a) != 2 or len(b) != 2 or a[1] != n_in or b[0] != n_out or a[0] != b[1]:
            return (f"{where}: layer {layer} {proj} has A {tuple(a)} and B {tuple(b)}; this model needs "
                    f"A [r, {n_in}] and B [{n_out}, r]: an adapter of another base model?")
    return None


def base_config(model: str | None, load_format: str = "auto") -> ModelConfig | None:
    """A served model's shapes from its files' headers (a built-in config's, for dummy weights)."""
    src = resolve_model(model, load_format)
    if src.kind == "builtin":
        return builtin_config(src.name)
    if src.kind == "hf":
        return config_from_hf(read_config_json(os.path.join(src.path, "config.json")))
    from inferd.gguf_file import read_gguf_metadata

    meta = read_gguf_metadata(src.path)
    arch = meta.get("general.architecture")

    def g(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    try:
        heads, hidden = int(g("attention.head_count")), int(g("embedding_length"))
        return ModelConfig(hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
                           num_hidden_layers=int(g("block_count")), num_attention_heads=heads,
                           num_key_value_heads=int(g("attention.head_count_kv", heads)),
                           head_dim=int(g("attention.key_length", hidden // heads)))
    except (TypeError, ValueError, ZeroDivisionError):
        raise InferdError(f"{src.path}: the GGUF metadata lacks the layer shapes an adapter is matched on") from None

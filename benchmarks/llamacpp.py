"""llama.cpp as a benchmark competitor: one build of the llama.cpp sources vendored in the
llama-cpp-python sdist gives both `llama-server` and the `libllama.so` that the llama_cpp
Python bindings load in-process.

Usage:
  .venv/bin/python benchmarks/llamacpp.py --build      # build (or reuse) llama-server + libllama.so
  .venv/bin/python benchmarks/llamacpp.py --bindings   # also make `import llama_cpp` work

An optional benchmark dependency: nothing here is imported by inferd itself or by the tests.
The cache lives in $INFERD_BENCH_CACHE (default ~/.cache/inferd-bench); a finished build is
reused, so every call after the first is cheap.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
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
BUILD_DIR = CACHE / f"llama.cpp-build-{LLAMA_CPP_PYTHON_VERSION}"


# ggml built with OpenMP syncs its threads with `omp barrier` between graph nodes (~1,000 per
# decoded token here), and libgomp spins at a barrier before it sleeps. Which wait policy is best
# depends on the machine's load, so llama.cpp gets the better one for the conditions it runs in:
# - oversubscribed (load average >= cores): a preempted thread leaves its partner spinning a whole
#   time slice at every barrier; batch-1 decode at 2 threads measured 2.7 tok/s spinning vs 21.4
#   passive at load ~11 on 2 cores;
# - quiet: spinning wins, 116 vs 36.5 tok/s passive (the 2-core AVX2 machine, load ~1).
# An explicit OMP_WAIT_POLICY in the environment still wins.
def omp_env() -> dict:
    busy = os.getloadavg()[0] >= (os.cpu_count() or 1)
    return {"OMP_WAIT_POLICY": "passive" if busy else "active"}



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


def _find_built(name: str) -> Path | None:
    hits = sorted(p for p in BUILD_DIR.glob(f"**/{name}") if p.is_file())
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


def _cpu_options() -> list[str]:
    """ISA options for ggml-cpu: this CPU's features, but never AMX.

    Not GGML_NATIVE: -march=native turns AMX on wherever CPUID lists it, and on the Firecracker VMs
    we benchmark on CPUID lists amx_int8 while the first AMX tile load in ggml's Q4_1 matmul kills
    the process with SIGILL. Explicit flags (as ggml's own non-native build does) keep everything
    else native. Off x86 (or without /proc/cpuinfo) native is fine.
    """
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return ["-DGGML_NATIVE=ON"]
    if "avx" not in flags:
        return ["-DGGML_NATIVE=ON"]
    have = set(flags)
    opts = ["-DGGML_NATIVE=OFF"]
    for flag, opt in _X86_ISA:
        on = flag in have and (opt != "GGML_AVX512" or {"avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= have)
        opts.append(f"-D{opt}={'ON' if on else 'OFF'}")
    return opts + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def configure_args(src: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(BUILD_DIR),
            "-DCMAKE_BUILD_TYPE=Release",
            # Shared libs so the same build serves llama-server and the Python bindings.
            "-DBUILD_SHARED_LIBS=ON",
            *_cpu_options(),
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            # No network at build time: the web UI would come from Hugging Face or npm.
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_OPENSSL=OFF"]


# cmake target -> the file it produces
TARGETS = {"llama-server": "llama-server", "llama": "libllama.so", "llama-bench": "llama-bench"}


def build(targets: tuple[str, ...] = ("llama-server", "llama"), jobs: int = 2) -> dict[str, Path]:
    """Configure and build the targets (libllama.so brings the libggml*.so it needs). Idempotent."""
    with _build_lock():
        src = SRC_ROOT / "vendor" / "llama.cpp"
        args = configure_args(src)
        stamp = BUILD_DIR / ".inferd-configure-args"
        # A tree configured with other options is rebuilt (cmake recompiles only what they touch).
        configured = stamp.exists() and stamp.read_text() == "\n".join(args)
        found = {t: _find_built(TARGETS[t]) for t in targets}
        if configured and all(found.values()):
            return found
        ensure_sources()
        t0 = time.monotonic()
        if not configured:
            _run(args)
            stamp.write_text("\n".join(args))
        _run(_nice() + ["cmake", "--build", str(BUILD_DIR), "--config", "Release",
                        "-j", str(jobs), "--target", *targets])
        found = {t: _find_built(TARGETS[t]) for t in targets}
        missing = [TARGETS[t] for t, p in found.items() if p is None]
        if missing:
            raise RuntimeError(f"build finished but {missing} not found under {BUILD_DIR}")
        _log(f"built {', '.join(targets)} in {time.monotonic() - t0:.0f} s")
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
    ap.add_argument("--build", action="store_true", help="build (or reuse) llama-server and libllama.so")
    ap.add_argument("--bindings", action="store_true", help="make `import llama_cpp` work in this venv")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    if not (args.build or args.bindings):
        ap.error("nothing to do: pass --build and/or --bindings")
    built = build(jobs=args.jobs)
    print(f"llama-server: {built['llama-server']}\nlibllama:     {built['llama']}")
    if args.bindings:
        mod = ensure_llama_cpp_python(args.jobs)
        print(f"llama_cpp {mod.__version__} from {mod.__file__}, LLAMA_CPP_LIB_PATH={os.environ['LLAMA_CPP_LIB_PATH']}")


if __name__ == "__main__":
    main()

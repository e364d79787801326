"""Helpers the benchmark scripts share."""
from __future__ import annotations

# the CPU features that decide which kernels are fast here (a table is only comparable within one kind)
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_features() -> str:
    """'AMD EPYC ...: avx2 fma avx512f ... (no avx512_bf16, amx_bf16)' from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "CPU features unknown"
    flags = set()
    model = "CPU"
    for line in info.splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name") and model == "CPU":
            model = line.split(":", 1)[1].strip()
    have = [f for f in FEATURES if f in flags]
    missing = [f for f in FEATURES if f not in flags]
    return f"{model}: {' '.join(have)}" + (f" (no {', '.join(missing)})" if missing else "")

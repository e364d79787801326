"""Helpers the benchmark scripts share."""
from __future__ import annotations

import time

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


def hf_decode_rate(hf, prompt: list[int], n: int) -> float:
    """Hugging Face transformers' batch-1 greedy decode tok/s, prefill excluded: a 1-token generate
    is timed and subtracted from an n-token one (after a warm-up)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        dt = time.perf_counter() - t0 - t_prefill
    return (n - 1) / dt

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


def last_level_cache_bytes() -> int:
    """The largest CPU cache this Linux reports (sysfs), or 32 MiB when it says nothing."""
    import glob

    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            txt = open(path).read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        best = max(best, int(txt.rstrip("KMG")) * mult)
    return best or 32 << 20


def read_bandwidth_gbs(threads: int, reps: int = 5) -> float:
    """Read-only streaming bandwidth at `threads` threads: the best of `reps` sums over a float32
    buffer of at least 4x the last-level cache (and 512 MiB), so it comes from DRAM, not cache."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = max(4 * last_level_cache_bytes(), 512 << 20) // 4
        buf = torch.ones(n, dtype=torch.float32)
        buf.sum()  # fault the pages in
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        return n * 4 / best / 1e9
    finally:
        torch.set_num_threads(prev)


def bytes_per_decode_token(model, context: int) -> int:
    """What one batch-1 decode step reads: the nbytes of every tensor the layers and the lm_head
    really hold (packed codes, scales, minimums, biases, norms; a tied lm_head is the embedding
    matrix), one embedding row, and the KV cache at `context` tokens plus the position written."""
    import torch

    cfg = model.cfg
    parts = [model.layers, model.norm, model.lm_head]
    seen, total = set(), 0
    for part in parts:
        for t in list(part.parameters()) + [b for b in part.buffers() if b is not None]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    emb = getattr(model.embed_tokens, "weight", None)  # a PackedEmbedding reads int8 codes instead
    total += cfg.hidden_size * (emb.element_size() if emb is not None else 1)
    kv_elem = 4 if model.dtype == torch.float32 else 2
    total += (context + 1) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_elem
    return total


def int8_peak_gops(threads: int) -> tuple[str, float]:
    """(isa, GOP/s): the int8 dot-product instruction's peak at `threads` threads, no memory traffic
    (csrc/bench/int8_peak.c, built with the system C compiler into the benchmark cache on first use).
    The roofline for the integer GEMMs where no library GEMM is a ceiling (oneDNN's int8 GEMM runs
    at a few GOP/s on an AVX2-only CPU); ("none", 0.0) without a compiler."""
    import hashlib
    import os
    import shutil
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "csrc" / "bench" / "int8_peak.c"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "none", 0.0
    cache = Path(os.environ.get("INFERD_BENCH_CACHE", Path.home() / ".cache" / "inferd-bench"))
    exe = cache / f"int8_peak-{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([cc, "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
    isa, gops, _ = subprocess.run([str(exe), str(threads)], check=True, capture_output=True,
                                  text=True).stdout.split()
    return isa, float(gops)

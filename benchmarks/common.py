"""Helpers the benchmark scripts share.

What every script reports, and how (issue #41, "headlines a skeptic can rerun"):
  - the CPU line, the exact setup (threads, lengths, concurrency and number of requests, rounds) and,
    per contender, the record of the paths that actually ran (`report_header`);
  - each headline number is the median over interleaved rounds (A B C, A B C, ...: `interleaved`),
    printed with its min-max spread (`spread`, `fmt_spread`), never the best round;
  - every row label is checked against its contender's record (`check_rows`: a label that claims a
    path which did not run is refused, inferd.engine.paths.check_label);
  - `--json PATH` writes {"cpu", "setup", "rows", "paths", ...} (`write_json`).
A contender's record: an in-process inferd engine's `inferd.engine.paths.engine_paths`; a served
one's from GET /v1/engine/state after its run (`served_paths`); transformers' `hf_paths`; llama.cpp's
build (`llamacpp.build_info`).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from inferd.engine.paths import check_label, module_paths  # noqa: E402  (torch-free)

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


def read_bandwidth_gbs(threads: int, reps: int = 5, size: int | None = None) -> float:
    """Read-only streaming bandwidth at `threads` threads: the best of `reps` sums over a float32
    buffer of at least 4x the last-level cache (and 512 MiB), so it comes from DRAM, not cache.
    `size` (bytes) replaces that: a smoke run's (--tiny) number, which measures the cache."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (size or max(4 * last_level_cache_bytes(), 512 << 20)) // 4
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


def median_seconds(fn, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of one call of fn over `reps` timed calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def c_bench(name: str):
    """csrc/bench/`name`.c built with the system C compiler (-O2 -fopenmp) into the benchmark cache
    on first use (one binary per source's hash); None without a compiler."""
    import hashlib
    import os
    import shutil
    import subprocess
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "csrc" / "bench" / f"{name}.c"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cache = Path(os.environ.get("INFERD_BENCH_CACHE", Path.home() / ".cache" / "inferd-bench"))
    exe = cache / f"{name}-{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([cc, "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
    return exe


def int8_peak_gops(threads: int, seconds: float = 0.5) -> tuple[str, float]:
    """(isa, GOP/s): the int8 dot-product instruction's peak at `threads` threads, no memory traffic
    (csrc/bench/int8_peak.c). The roofline for the integer GEMMs where no library GEMM is a ceiling
    (oneDNN's int8 GEMM runs at a few GOP/s on an AVX2-only CPU); ("none", 0.0) without a compiler."""
    import subprocess

    exe = c_bench("int8_peak")
    if exe is None:
        return "none", 0.0
    isa, gops, _ = subprocess.run([str(exe), str(threads), str(seconds)], check=True, capture_output=True,
                                  text=True).stdout.split()
    return isa, float(gops)


def stream_bandwidth_gbs(threads: int, size: int | None = None, reps: int = 7) -> float:
    """Read bandwidth at `threads` threads as a weight-streaming kernel sees it: each thread its own
    contiguous share, vector loads with one add each (csrc/bench/read_bw.c), the best of `reps`, over
    at least 4x the last-level cache and 1 GiB (`size` bytes instead: a smoke run's cache number).
    Falls back to read_bandwidth_gbs (torch's sum, which reads slower) without a C compiler."""
    import subprocess

    exe = c_bench("read_bw")
    if exe is None:
        return read_bandwidth_gbs(threads, size=size)
    n = size or max(4 * last_level_cache_bytes(), 1 << 30)
    return float(subprocess.run([str(exe), str(threads), str(n), str(reps)], check=True, capture_output=True,
                                text=True).stdout.strip())


# -- what ran, and how it was measured --------------------------------------------------------------

def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of the whole machine so far, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


# the busiest share each quiet_machine() call left the machine at: a report can say what it started on
QUIET_SEEN: list[float] = []


def quiet_machine(limit: float = 0.1, window: float = 0.2, timeout: float = 10.0) -> float:
    """Wait until the whole machine is idle (busy share of all cores <= limit over `window` s), at
    most `timeout` s; returns the last share seen. A contender timed while another process spins
    (an OpenMP worker of the benchmark's own process, a server the previous one left) runs on part
    of the machine: measured, llama-bench's tg128 halved beside an idle Python whose libgomp worker
    spun. Called before every run of interleaved()."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    t_end = time.monotonic() + timeout
    share = 1.0
    while True:
        b0, a0 = _cpu_ticks()
        time.sleep(window)
        b1, a1 = _cpu_ticks()
        share = (b1 - b0) / max(1, a1 - a0)
        if share <= limit or time.monotonic() >= t_end:
            break
    if share > limit:
        print(f"[quiet_machine] still {100 * share:.0f}% busy after {timeout:.0f} s: the next run shares the CPUs",
              file=sys.stderr, flush=True)
    QUIET_SEEN.append(share)
    return share


def interleaved(runners: dict, rounds: int, log: bool = True, into: dict | None = None) -> dict[str, list]:
    """{label: [one value per round]}: every contender once a round, in the same order each round
    (A B C, A B C, ...), so that a shared machine's drift falls on all of them alike; each run starts
    on an idle machine (quiet_machine). `into`: the dict to fill, for a runner that reads the rounds
    so far."""
    runs: dict[str, list] = into if into is not None else {}
    for k in runners:
        runs.setdefault(k, [])
    for r in range(rounds):
        for k, fn in runners.items():
            quiet_machine()
            runs[k].append(fn())
        if log:
            print(f"[round {r + 1}/{rounds}] " + ", ".join(
                f"{k if isinstance(k, str) else ' '.join(map(str, k))} {v[-1]:.1f}"
                for k, v in runs.items() if v and isinstance(v[-1], (int, float))),
                file=sys.stderr, flush=True)
    return runs


def spread(runs: list[float]) -> dict:
    """What a row reports of its rounds: the median, the min and max, every round's value."""
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": list(runs)}


def fmt_spread(runs: list[float], spec: str = "{:.1f}") -> str:
    """"189.8 (185.1-192.3)": the median, then the min-max over the rounds (one round: the value)."""
    med = spec.format(statistics.median(runs))
    return med if len(runs) < 2 else f"{med} ({spec.format(min(runs))}-{spec.format(max(runs))})"


# counters of a record that add up over runs (each run may be its own engine)
COUNTERS = ("fused_steps", "eager_decode_steps", "steps", "prefill_tokens", "decode_tokens")


def merge_paths(acc: dict | None, new: dict) -> dict:
    """One contender's record over several runs: the latest run's record, its counters summed."""
    if not acc:
        return dict(new)
    out = dict(new)
    for k in COUNTERS:
        if isinstance(acc.get(k), int) and isinstance(new.get(k), int):
            out[k] = acc[k] + new[k]
    return out


def paths_line(p: dict) -> str:
    """One line of a record, for the header: what a reader checks a row's label against."""
    if p.get("engine") == "llama.cpp":
        return f"{p['isa']} ({p.get('version')})"
    bits = []
    if p.get("engine") == "transformers":
        bits.append(f"transformers {p.get('version')}, attention {p.get('attn_implementation')}")
    if "kernel_variant" in p:
        bits.append(f"inferd kernels {p['kernel_variant']}, torch {p.get('cpu_capability')}")
    bits.append(f"activations {p.get('dtype')}" + (f" (int8 {p['activation_quant']})" if p.get("activation_quant") else ""))
    bits.append("weights " + ", ".join(f"{n} {k}" for k, n in (p.get("weight_formats") or {}).items())
                + (f" (the dense ones {'/'.join(p['dense_weight_dtypes'])})" if p.get("dense_weight_dtypes") else "")
                + (f", lm_head {p['lm_head']}" if p.get("lm_head") else ""))
    if "kv_dtype" in p:
        bits.append(f"KV {p['kv_dtype']}")
    if p.get("runner") == "pooling":
        bits.append(f"pooling runner ({p.get('pooling')}): attention {p.get('attention')}, {p.get('kernel_forwards')} of "
                    f"{p.get('forwards')} forwards native; {p.get('tokens')} tokens computed for {p.get('real_tokens')} "
                    f"real ({p.get('padded_tokens')} padded)")
    if "fused_steps" in p:
        bits.append(f"fused decode {'built' if p.get('fused_built') else 'not built'}, "
                    f"{p.get('fused_steps')} fused of {p.get('steps')} steps"
                    + (f", {p['eager_decode_steps']} decode-only steps eager" if p.get("eager_decode_steps") else ""))
    if p.get("tensor_parallel_size", 1) != 1:
        bits.append(f"TP={p['tensor_parallel_size']}")
    if p.get("speculative_method"):
        draft = p.get("draft") or {}
        bits.append(f"speculative {p['speculative_method']}"
                    + (f" (draft: {draft.get('desc')}, weights {draft.get('weight_formats')})" if draft else ""))
    if p.get("lora"):
        lo = p["lora"]
        bits.append(f"LoRA: {lo['adapters']} adapters, {lo['max_loras']} slots, {lo['lora_steps']} steps with adapter "
                    f"rows ({lo['multi_adapter_steps']} with several), {lo['products_per_step']} LoRA products a step")
    if p.get("engines", 1) != 1:
        bits.append(f"{p['engines']} engines")
    return "; ".join(bits)


def report_header(title: str, setup: dict, paths: dict[str, dict]) -> None:
    """The CPU line, the title, every setting, and each contender's record of what ran."""
    print(f"\n{cpu_features()}")
    print(title)
    for k, v in setup.items():
        print(f"  {k}: {v}")
    if QUIET_SEEN:
        print(f"  machine before each timed run: at most {100 * max(QUIET_SEEN):.0f}% busy "
              f"({len(QUIET_SEEN)} runs; each waited for <= 10%)")
    print("paths that ran:")
    for label, p in paths.items():
        print(f"  {label}: {paths_line(p)}")


def check_rows(paths: dict[str, dict], labels: dict[str, str] | None = None) -> None:
    """Refuse (ValueError) a row label that claims a path its contender did not run. `labels` maps a
    row label to its contender's key in `paths` where they differ; every contender's own key is a
    label too."""
    for label, p in paths.items():
        check_label(label, p)
    for label, key in (labels or {}).items():
        check_label(label, paths[key])


def tiny_skips(*what: str) -> str:
    """The line a --tiny run prints for each competitor it leaves out (those that need llama.cpp
    built): a smoke run of the script's every own path, not a measurement."""
    line = "--tiny: skipped " + "; ".join(what) + " (it needs llama.cpp built; run without --tiny to include it)"
    print(line, flush=True)
    return line


def write_json(path: str | None, setup: dict, rows: list[dict], paths: dict[str, dict], **extra) -> None:
    """The run as JSON: {"cpu", "setup", "rows", "paths", **extra}. Nothing without a path."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"cpu": cpu_features(), "setup": setup, "rows": rows, "paths": paths, **extra}, f, indent=2,
                  default=str)


def served_paths(base_url: str, timeout: float = 30) -> dict:
    """A served inferd's record, read from GET /v1/engine/state after its run (so its counters are
    the served engines'). Several engines (data parallel, a router's backends): the first one's
    record, counters summed over all, and "engines": how many."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/engine/state?steps=0", timeout=timeout) as r:
        doc = json.load(r)
    records = [e["paths"] for e in doc.get("engines", []) if isinstance(e.get("paths"), dict)]
    if not records:
        raise RuntimeError(f"{base_url}/v1/engine/state has no paths record (an inferd from before #41?)")
    out = None
    for p in records:
        out = merge_paths(out, p)
    out["engines"] = len(records)
    return out


def hf_paths(model) -> dict:
    """A transformers model's record: its version, attention and the inferd.engine.paths fields."""
    import transformers

    return {"engine": "transformers", "version": transformers.__version__,
            "attn_implementation": getattr(model.config, "_attn_implementation", None), **module_paths(model)}

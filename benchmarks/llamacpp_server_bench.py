"""Head-to-head with llama.cpp's own `llama-server`: both servers on the default GGUF, both driven
by `inferd bench` with the same seeded prompts (128 tokens) and exact output lengths (128 tokens,
max_tokens + ignore_eos, counted from each server's own `usage`), at concurrency 1, 8 and 32.

llama-server: built from the llama.cpp sources vendored in the llama-cpp-python sdist (see
benchmarks/llamacpp.py), 2 threads, 32 slots (-np 32), prompt caching off (--no-cache-prompt,
--cache-ram 0), OMP_WAIT_POLICY passive on a busy machine and active on a quiet one unless set (see
llamacpp.omp_env: the wrong one costs llama.cpp 3-8x). inferd serve: 2 threads, --max-num-seqs 32, prefix caching off to match, once per --config
LABEL=FLAGS given (any `inferd serve` flags), else once per --quantization given (default: `gguf`, the file's own Q4_1 blocks, and `none`, dequantized
weights in the default dtype), since neither wins at every batch size.

Usage: nice -n 10 .venv/bin/python benchmarks/llamacpp_server_bench.py [--quantization gguf,none]
       [--config 'w4a8=--quantization gguf --quantize-lm-head --quantize-activations' --config ...]
An optional benchmark (not part of CI): ~10-15 minutes on a 2-core machine, plus a one-time
llama.cpp build.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from common import cpu_features  # noqa: E402
from llamacpp import ensure_llama_server, llamacpp_env  # noqa: E402
from serving import METRICS, fmt, free_port, inferd_env, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402

# Concurrency -> number of prompts: enough requests to fill every slot a few times over, few
# enough that the whole comparison stays around ten minutes on two cores.
DEFAULT_LEVELS = "1:8,8:32,32:64"


def llama_server_cmd(binary: str, gguf: str, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads),
            "-np", str(slots),
            # Total context split evenly across the slots (the KV is per slot unless unified).
            "-c", str(slots * ctx_per_slot),
            # Prompt caching off: random prompts share nothing anyway, but the cache's bookkeeping
            # (and the host-RAM prompt cache) should not be part of what is measured.
            "--no-cache-prompt", "--cache-ram", "0",
            "--no-webui"]


def inferd_configs(quantization: str, configs: list[str]) -> dict[str, list[str]]:
    """The inferd servers to run, label -> extra `inferd serve` flags: one per --config LABEL=FLAGS
    (any flag set, e.g. "w4a8=--quantization gguf --quantize-lm-head --quantize-activations"), and
    one per --quantization entry ("--quantization Q") where no --config is given."""
    import shlex

    out = {}
    for c in configs:
        label, sep, flags = c.partition("=")
        if not sep or not label:
            raise SystemExit(f"--config wants LABEL=FLAGS, got {c!r}")
        out[label] = shlex.split(flags)
    if not configs:
        out = {q: ["--quantization", q] for q in quantization.split(",") if q}
    return out


def main() -> None:
    from inferd.loading.loader import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="default: inferd's default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np and inferd --max-num-seqs")
    ap.add_argument("--ctx-per-slot", type=int, default=512)
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help="CONCURRENCY:NUM_PROMPTS,...")
    ap.add_argument("--quantization", default="gguf,none",
                    help="inferd configs to run, comma-separated (ignored where --config is given)")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=FLAGS",
                    help="an inferd server with these `inferd serve` flags (repeatable), e.g. "
                         "'w4a8=--quantization gguf --quantize-lm-head --quantize-activations'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-llamacpp", action="store_true")
    a = ap.parse_args()
    gguf = a.gguf or default_model_path()
    levels = [tuple(int(x) for x in lv.split(":")) for lv in a.levels.split(",")]

    def bench_all(url: str) -> dict[int, dict]:
        out = {}
        for conc, n in levels:
            out[conc] = run_bench(
                url, "--endpoint", "/v1/completions", "--dataset", "random", "--tokenizer", gguf,
                "--num-prompts", str(n), "--input-len", a.input_len, "--output-len", a.output_len,
                "--request-rate", "inf", "--max-concurrency", str(conc), "--seed", str(a.seed),
                # One-off first-request costs (thread pools, kernel loads) belong to neither server.
                "--warmup", "2", "--timeout", "3600")
        return out

    results: dict[str, dict[int, dict]] = {}
    if not a.skip_llamacpp:
        binary = str(ensure_llama_server())
        cmd = llama_server_cmd(binary, gguf, free_port(), a.threads, a.slots, a.ctx_per_slot)
        with server(cmd, "llama-server", env=llamacpp_env()) as url:
            results["llama.cpp"] = bench_all(url)
    for label, flags in inferd_configs(a.quantization, a.config).items():
        cmd = inferd_serve_cmd("--model", gguf, "--threads", str(a.threads), "--max-num-seqs", str(a.slots),
                               "--no-prefix-caching", *flags, port=free_port())
        with server(cmd, f"inferd-{label}", env=inferd_env()) as url:
            results[f"inferd {label}"] = bench_all(url)

    names = list(results)
    base = "llama.cpp" if "llama.cpp" in results else None
    print(f"\n{cpu_features()}; {a.threads} threads\n")
    for conc, n in levels:
        header = ["metric", *names]
        if base:
            header += [f"{nm} / llama.cpp" for nm in names if nm != base]
        rows = []
        for label, key, spec in METRICS:
            vals = [results[nm][conc].get(key) for nm in names]
            row = [label, *(fmt(v, spec) for v in vals)]
            if base:
                b = results[base][conc].get(key)
                row += [fmt(results[nm][conc].get(key) / b if b and results[nm][conc].get(key) else None, "{:.2f}x")
                        for nm in names if nm != base]
            rows.append(row)
        done = ", ".join(f"{nm} {results[nm][conc]['completed']}/{n} ok, "
                         f"{results[nm][conc].get('total_input_tokens_server')} prompt tokens by its usage"
                         for nm in names)
        print_table(f"concurrency {conc}, {n} requests, input {a.input_len}, output {a.output_len} ({done})",
                    header, rows)
        print()
    print("ratios are inferd / llama.cpp: above 1 is better for inferd in tok/s and req/s, worse in TTFT/TPOT")


if __name__ == "__main__":
    main()

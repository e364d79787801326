"""Head-to-head with llama.cpp's own `llama-server`: both servers on the default GGUF, both driven
by `inferd bench` with the same seeded prompts (128 tokens) and exact output lengths (128 tokens,
max_tokens + ignore_eos, counted from each server's own `usage`), at each --levels entry
CONCURRENCY:REQUESTS (default 1:8, 8:32, 32:64: e.g. 64 requests sent at once, at most 32 in
flight), every table titled "concurrency C, N requests".

Runs interleave: llama-server, then each inferd config, then again, --rounds times (default 3), a
fresh server each run; every cell is the median over the rounds, never the best, and the output
tok/s of every run is printed beside it. The header states the setup and what ran: llama.cpp's
build ISA and AMX state (benchmarks/llamacpp.py; a SIGILL on an AMX build is retried once without
AMX and the row says so), and each inferd server's paths record, read from its
GET /v1/engine/state after its run (kernel variant, weight formats, activation and KV dtypes, fused
decode steps); each row label is checked against it. --json F writes {"cpu", "setup", "rows", "paths"}.

llama-server: built from the llama.cpp sources vendored in the llama-cpp-python sdist (see
benchmarks/llamacpp.py), 2 threads, 32 slots (-np 32), prompt caching off (--no-cache-prompt,
--cache-ram 0), OMP_WAIT_POLICY passive on a busy machine and active on a quiet one unless set (see
llamacpp.omp_env: the wrong one costs llama.cpp 3-8x). inferd serve: 2 threads, --max-num-seqs 32, prefix caching off to match, once per --config
LABEL=FLAGS given (any `inferd serve` flags), else once per --quantization given (default: `auto`,
what a bare `inferd serve` runs: the file's own blocks with int8 activations; `none` adds the
dequantized weights).

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): every
level cut to at most 2 requests of 16 in / 8 out tokens at concurrency at most 2, 2 slots, 1 round;
llama-server is left out (it needs llama.cpp built), and the output says so.

Usage: nice -n 10 .venv/bin/python benchmarks/llamacpp_server_bench.py [--quantization auto,none]
       [--config 'w4a8=--quantization gguf --quantize-lm-head --quantize-activations' --config ...]
       [--levels 1:8,8:32,32:64] [--rounds 3] [--json F]
An optional benchmark (not part of CI): ~10-15 minutes a round on a 2-core machine, plus a one-time
llama.cpp build.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from common import (check_rows, fmt_spread, interleaved, merge_paths, report_header, served_paths, spread,  # noqa: E402
                    tiny_skips, write_json)
from llamacpp import ensure_llama_server, llamacpp_env  # noqa: E402
from serving import (METRICS, ServerDied, ensure_alive, fmt, free_port, inferd_env, inferd_serve_cmd,  # noqa: E402
                     print_table, run_bench, server)

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


def level_name(conc: int, n: int) -> str:
    return f"concurrency {conc}, {n} requests"


def main() -> None:
    from inferd.loading.loader import default_model_path
    from llamacpp import TileFault, build_info, faulted, row_name, run_llamacpp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="default: inferd's default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np and inferd --max-num-seqs")
    ap.add_argument("--ctx-per-slot", type=int, default=512)
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--levels", default=DEFAULT_LEVELS,
                    help="CONCURRENCY:NUM_REQUESTS,... (e.g. 32:64 = 64 requests, at most 32 in flight)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved runs (llama-server, then each inferd config, again); every cell is their median")
    ap.add_argument("--quantization", default="auto",
                    help="inferd configs to run, comma-separated (ignored where --config is given)")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=FLAGS",
                    help="an inferd server with these `inferd serve` flags (repeatable), e.g. "
                         "'w4a8=--quantization gguf --quantize-lm-head --quantize-activations'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): each level at most 2 in flight "
                         "and 2 requests, 16 in / 8 out, 2 slots, 1 round, no llama-server")
    a = ap.parse_args()
    gguf = a.gguf or default_model_path()
    levels = [tuple(int(x) for x in lv.split(":")) for lv in a.levels.split(",")]
    if a.tiny:
        levels = list(dict.fromkeys((min(c, 2), min(n, 2)) for c, n in levels))
        a.input_len, a.output_len, a.slots, a.ctx_per_slot, a.rounds = "16", "8", 2, 64, 1
        a.skip_llamacpp = a.skip_llamacpp or bool(tiny_skips("llama-server"))

    def bench_all(url: str) -> dict[int, dict]:
        out = {}
        for conc, n in levels:
            out[conc] = run_bench(
                url, "--endpoint", "/v1/completions", "--dataset", "random", "--tokenizer", gguf,
                "--num-prompts", str(n), "--input-len", a.input_len, "--output-len", a.output_len,
                "--request-rate", "inf", "--max-concurrency", str(conc), "--seed", str(a.seed),
                # One-off first-request costs (thread pools, kernel loads) belong to neither server.
                "--warmup", "2", "--timeout", "3600")
            ensure_alive(url)  # a server that died part-way gives no row
        return out

    def llama_round() -> dict[int, dict]:
        """One run of every level against a fresh llama-server; a SIGILL is a TileFault (run_llamacpp
        retries once on a build without AMX)."""
        try:
            cmd = llama_server_cmd(str(ensure_llama_server()), gguf, free_port(), a.threads, a.slots, a.ctx_per_slot)
            env = llamacpp_env()
            omp.append(env.get("OMP_WAIT_POLICY"))
            with server(cmd, "llama-server", env=env) as url:
                return bench_all(url)
        except ServerDied as e:
            if faulted(e.returncode):
                raise TileFault(str(e)) from e
            raise

    configs = inferd_configs(a.quantization, a.config)
    paths: dict[str, dict] = {}
    omp: list[str] = []  # llama-server's OpenMP wait policy, run by run (it follows the machine's load)

    def inferd_round(label: str, flags: list[str]):
        def run() -> dict[int, dict]:
            tiny = ["--kv-cache-memory", "64MiB"] if a.tiny else []
            cmd = inferd_serve_cmd("--model", gguf, "--threads", str(a.threads), "--max-num-seqs", str(a.slots),
                                   "--no-prefix-caching", *tiny, *flags, port=free_port())
            with server(cmd, f"inferd-{label}", env=inferd_env()) as url:
                out = bench_all(url)
                # what this server's engine ran, its counters those of this round's requests
                paths[f"inferd {label}"] = merge_paths(paths.get(f"inferd {label}"), served_paths(url))
                return out
        return run

    runners = {} if a.skip_llamacpp else {"llama.cpp": lambda: run_llamacpp(llama_round)}
    runners.update({f"inferd {label}": inferd_round(label, flags) for label, flags in configs.items()})
    runs = interleaved(runners, a.rounds, log=False)  # {contender: [{conc: bench result} per round]}
    if "llama.cpp" in runs:
        info = build_info()  # after the run: a tile fault switches AMX off part-way
        name = row_name(info)
        runs = {(name if k == "llama.cpp" else k): v for k, v in runs.items()}
        paths = {name: info, **paths}
    check_rows(paths)

    names = list(runs)
    base = names[0] if names[0].startswith("llama.cpp") else None

    def values(nm: str, conc: int, key: str) -> list[float]:
        return [r[conc][key] for r in runs[nm] if r[conc].get(key) is not None]

    def med(nm: str, conc: int, key: str) -> float | None:
        vs = values(nm, conc, key)
        return statistics.median(vs) if vs else None

    setup = {"model": os.path.basename(gguf), "threads": f"{a.threads} (llama-server -t/-tb, inferd --threads)",
             "levels": "; ".join(level_name(c, n) for c, n in levels)
                       + " (requests all sent at once, at most `concurrency` in flight)",
             "lengths": f"input {a.input_len}, output {a.output_len} tokens (max_tokens + ignore_eos; seeded random prompts)",
             "slots": f"{a.slots} (llama-server -np, inferd --max-num-seqs); prompt/prefix caching off on both",
             "rounds": f"{a.rounds}, interleaved ({', '.join(runners)}, again), a fresh server each run; every "
                       "cell is the median over the rounds (never the best), with the min-max of output tok/s",
             **{f"inferd {label}": "inferd serve " + " ".join(flags) for label, flags in configs.items()}}
    if base:
        setup["llama-server"] = (f"{paths[base]['isa']}; -c {a.slots * a.ctx_per_slot}, --no-cache-prompt, "
                                 f"OMP_WAIT_POLICY by run: {', '.join(omp)}")
    report_header("inferd serve vs llama-server, both driven by `inferd bench`", setup, paths)
    rows = []
    for conc, n in levels:
        header = ["metric", *names]
        if base:
            header += [f"{nm} / llama.cpp" for nm in names if nm != base]
        table = []
        for label, key, spec in METRICS:
            row = [label, *(fmt(med(nm, conc, key), spec) for nm in names)]
            if base:
                b = med(base, conc, key)
                row += [fmt(med(nm, conc, key) / b if b and med(nm, conc, key) else None, "{:.2f}x")
                        for nm in names if nm != base]
            table.append(row)
            rows += [{"label": f"{nm}, {level_name(conc, n)}", "metric": key, **spread(values(nm, conc, key))}
                     for nm in names if values(nm, conc, key)]
        done = ", ".join(f"{nm} {sum(r[conc]['completed'] for r in runs[nm])}/{n * a.rounds} ok" for nm in names)
        print()
        print_table(f"{level_name(conc, n)}, input {a.input_len}, output {a.output_len}: medians of {a.rounds} "
                    f"interleaved runs ({done})", header, table)
        print("out tok/s per run (min-max): " + "; ".join(
            f"{nm} {fmt_spread(values(nm, conc, 'output_throughput'))}" for nm in names))
    print("\nratios are inferd / llama.cpp of the medians: above 1 is better for inferd in tok/s and req/s, "
          "worse in TTFT/TPOT")
    write_json(a.json, setup, rows, paths, levels=[{"concurrency": c, "requests": n} for c, n in levels])


if __name__ == "__main__":
    main()

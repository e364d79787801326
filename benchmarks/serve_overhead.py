"""What serving costs the engine: `inferd serve` (engine core in its own process, and the old
in-process thread for comparison) against the same engine offline, in one run.

Per model configuration (--configs: dense, `--quantization gguf`, and w4a8: `--quantization gguf
--quantize-lm-head --quantize-activations`, the recommended CPU configuration; or any --config
LABEL=FLAGS, the offline engine loading the model with the same options):
  - concurrency 1: the served mean TPOT (`inferd bench`, 128 in / 128 out) beside the offline
    engine's per-token time on a 128-token prompt (engine.rate.decode_rate, prefill excluded);
  - concurrency 8 and 32: served output tok/s beside the offline engine's on the same number of
    128-in / 128-out requests with --max-num-seqs equal to the concurrency (output tokens over the
    wall time from the first add to the last finish, prefill included, as `inferd bench` counts).
The offline prompts are random token ids of the bench's lengths (speed does not depend on which
tokens). Both sides sample as the server does for a request that names no sampling parameters
(temperature 1, every filter off): the bench sends none, and random sampling costs more per step
than greedy (it is part of what is compared, not of what serving adds). Ratios near 1.0 mean serving costs nothing; the bar is within 10 %.

A shared 2-core machine drifts by 10-20 % between minutes, more than the effect measured, so each
cell is the median of --rounds runs, and the rounds interleave: offline, served (process), served
(thread), then again, each server staying up across its rounds. Every cell is printed with the
min-max over its runs. The header gives the setup and what each mode ran (the offline engine's
paths record; each server's read from its GET /v1/engine/state after the rounds), each row label is
checked against it, and --json F writes {"cpu", "setup", "rows", "paths", "results"}.

Each configuration names its --quantization, and both sides get the same options explicitly (the
server the flags load_options reads back, the offline engine the same load options), so that a
default that differs between `inferd serve` (auto) and the Python API cannot split them.

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): 16 in /
8 out tokens, concurrency 1 and 2, 1 round, a 64 MiB KV cache, and the in-process (thread) server for
the first config only (the same code for every config; each server start costs seconds).

Usage: .venv/bin/python benchmarks/serve_overhead.py [--model F.gguf] [--threads 2] [--rounds 3]
       [--configs gguf,dense,w4a8] [--config 'LABEL=SERVE FLAGS' ...] [--concurrency 1,8,32] [--no-thread]
       [--json F] [--tiny]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import (check_rows, fmt_spread, interleaved, merge_paths, report_header, served_paths,  # noqa: E402
                    spread, write_json)
from serving import free_port, inferd_env, inferd_serve_cmd, run_bench, server  # noqa: E402

# the run's sizes (main sets smaller ones for --tiny)
IN_LEN, OUT_LEN, KV_MEMORY = 128, 128, "1GiB"
SERVER_TEMPERATURE = 1.0  # the server's default (OpenAI's)
# label -> `inferd serve` flags; the offline engine loads the model with the same options (load_options)
CONFIGS = {"dense (auto dtype)": ["--quantization", "none"], "gguf": ["--quantization", "gguf"],
           # the recommended CPU configuration: the file's 4-bit blocks, int8 activations, fused decode
           "gguf W4A8 +lm_head": ["--quantization", "gguf", "--quantize-lm-head", "--quantize-activations"]}
CONFIG_KEYS = {"dense": "dense (auto dtype)", "gguf": "gguf", "w4a8": "gguf W4A8 +lm_head"}


def load_options(flags: list[str]) -> dict:
    """The load_model options of `inferd serve` flags, so that offline and served load the same
    model; a flag the offline side cannot mirror is refused rather than silently dropped, and so is
    a config without --quantization (the server's default and the offline loader's differ)."""
    ap = argparse.ArgumentParser(prog="serve flags", add_help=False, exit_on_error=False)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--quant-group-size", type=int, default=32)
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--quantize-activations", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ns, rest = ap.parse_known_args(flags)
    if rest:
        raise SystemExit(f"serve_overhead: the offline engine cannot mirror {rest}: give only --quantization, "
                         "--quant-group-size, --quantize-lm-head, --quantize-activations, --dtype")
    if ns.quantization is None:
        raise SystemExit(f"serve_overhead: {shlex.join(flags) or '(no flags)'} names no --quantization: give it, "
                         "so that the server and the offline engine load the same model")
    return {"quantization": ns.quantization, "quant_group_size": ns.quant_group_size,
            "quantize_lm_head": ns.quantize_lm_head, "quantize_activations": ns.quantize_activations,
            "dtype": ns.dtype}


def serve_flags(opts: dict) -> list[str]:
    """`inferd serve` flags for load_options' result: every option spelled out, defaults included."""
    flags = ["--quantization", opts["quantization"], "--quant-group-size", str(opts["quant_group_size"]),
             "--dtype", opts["dtype"]]
    flags += ["--quantize-lm-head"] if opts["quantize_lm_head"] else []
    return flags + (["--quantize-activations"] if opts["quantize_activations"] else [])


def offline_engine(model: str | None, extra: list[str], threads: int):
    import torch

    from inferd.loading.loader import load_model

    torch.set_num_threads(threads)
    return load_model(model, **load_options(extra))


def offline(lm, c: int, seed: int, record: dict) -> float:
    """ms per token at c == 1, else output tok/s, of the engine without a server; what ran is merged
    into record["paths"]."""
    from inferd.engine.engine import LLMEngine
    from inferd.engine.paths import engine_paths
    from inferd.engine.rate import decode_rate
    from inferd.engine.request import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 20000) for _ in range(IN_LEN)]
    if c == 1:
        got: dict = {}
        v = 1000 / decode_rate(lm, prompt, OUT_LEN, warmup=True, temperature=SERVER_TEMPERATURE, paths=got)
        record["paths"] = merge_paths(record.get("paths"), got)
        return v
    eng = LLMEngine(loaded=lm, kv_cache_memory=KV_MEMORY, max_num_seqs=c)
    eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    while eng.has_unfinished():
        eng.step()
    n = 2 * c
    t0 = time.monotonic()
    for _ in range(n):
        eng.add_request([rng.randrange(1000, 20000) for _ in range(IN_LEN)],
                        SamplingParams(max_tokens=OUT_LEN, temperature=SERVER_TEMPERATURE, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    v = n * OUT_LEN / (time.monotonic() - t0)
    record["paths"] = merge_paths(record.get("paths"), engine_paths(eng))
    return v


def served_cmd(model: str | None, extra: list[str], in_process: bool, threads: int, concs: list[int],
               port: int) -> list[str]:
    flags = [*(["--model", model] if model else []), *serve_flags(load_options(extra)), "--threads", str(threads),
             "--max-num-seqs", str(max(concs)), "--kv-cache-memory", KV_MEMORY]
    if in_process:
        flags.append("--engine-in-process")
    return inferd_serve_cmd(*flags, port=port)


def api_process(url: str):
    """The server's own process (the API side; its engine core is a child of it)."""
    import psutil

    port = url.rsplit(":", 1)[1]
    for p in psutil.Process().children(recursive=True):
        cmd = p.cmdline()
        if "serve" in cmd and port in cmd:
            return p
    raise RuntimeError(f"no server process for {url}")


def cpu_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def served(url: str, c: int, seed: int, api_cpu: list | None = None) -> float:
    """Mean TPOT (ms) at c == 1, else output tok/s, of `inferd bench` against the server at url.
    Appends the API process's CPU ms per output token to api_cpu: unlike wall time it does not
    drift with the machine, and it is what serving takes from the engine's cores."""
    api = api_process(url) if api_cpu is not None else None
    before = cpu_s(api) if api else 0.0
    res = run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
                    "--num-prompts", str(requests_for(c)), "--max-concurrency", str(c),
                    "--seed", str(seed), "--no-server-metrics")
    if api is not None:
        api_cpu.append(1000 * (cpu_s(api) - before) / max(res["total_output_tokens"], 1))
    return res["mean_tpot_ms"] if c == 1 else res["output_throughput"]


def warm(url: str):
    run_bench(url, "--dataset", "random", "--input-len", str(IN_LEN), "--output-len", "8", "--num-prompts", "2",
              "--max-concurrency", "1", "--no-server-metrics")


def measure(model: str | None, label: str, extra: list[str], threads: int, concs: list[int], rounds: int,
            with_thread: bool, paths: dict) -> dict:
    """{mode: {c: [value per round]}} for mode in offline, process (, thread), interleaved per
    concurrency (offline, process, thread at c, then the next c, then the next round); paths[ROW]:
    what each mode ran (the served ones read from the server after the rounds)."""
    import itertools

    lm = offline_engine(model, extra, threads)
    modes = ["offline", "process"] + (["thread"] if with_thread else [])
    api_cpu: dict = {c: [] for c in concs}
    offline_record: dict = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for m in modes[1:]:
            urls[m] = stack.enter_context(server(served_cmd(model, extra, m == "thread", threads, concs, free_port()),
                                                 f"inferd-{m}", env=inferd_env()))
            warm(urls[m])
        runners = {}
        for c in concs:  # the seed of each run: 100 x its round + c, the same for every mode
            for m in modes:
                n = itertools.count()
                if m == "offline":
                    runners[(m, c)] = lambda c=c, n=n: offline(lm, c, 100 * next(n) + c, offline_record)
                else:
                    runners[(m, c)] = lambda c=c, n=n, m=m: served(urls[m], c, 100 * next(n) + c,
                                                                   api_cpu[c] if m == "process" else None)
        runs = interleaved(runners, rounds)
        for m in modes[1:]:
            paths[row_name(label, m)] = served_paths(urls[m])
    paths[row_name(label, "offline")] = offline_record["paths"]
    vals = {m: {c: runs[(m, c)] for c in concs} for m in modes}
    vals["api_cpu_ms_per_token"] = api_cpu
    return vals


def row_name(label: str, mode: str) -> str:
    return f"{label}, {'offline' if mode == 'offline' else f'served ({mode})'}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; every cell is their median")
    ap.add_argument("--configs", default="gguf,dense",
                    help="built-in configs, comma-separated: dense, gguf, w4a8 (gguf --quantize-lm-head "
                         "--quantize-activations, the recommended CPU configuration)")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=FLAGS",
                    help="a config of `inferd serve` flags (repeatable; replaces --configs), the offline engine "
                         "loading the same model, e.g. 'w4a8=--quantization gguf --quantize-lm-head "
                         "--quantize-activations'")
    ap.add_argument("--no-thread", action="store_true", help="leave out the in-process (thread) server")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): 16 in / 8 out, concurrency 1 "
                         "and 2, 1 round, a 64 MiB KV cache, the thread server for the first config only")
    a = ap.parse_args()
    if a.tiny:
        global IN_LEN, OUT_LEN, KV_MEMORY
        IN_LEN, OUT_LEN, KV_MEMORY = 16, 8, "64MiB"
        a.concurrency, a.rounds = "1,2", 1
    concs = [int(x) for x in a.concurrency.split(",")]
    if a.config:
        configs = {}
        for c in a.config:
            label, sep, flags = c.partition("=")
            if not sep or not label:
                raise SystemExit(f"--config wants LABEL=FLAGS, got {c!r}")
            configs[label] = shlex.split(flags)
    else:
        unknown = [k for k in a.configs.split(",") if k not in CONFIG_KEYS]
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown} (choose {', '.join(CONFIG_KEYS)})")
        configs = {CONFIG_KEYS[k]: CONFIGS[CONFIG_KEYS[k]] for k in a.configs.split(",")}
    for flags in configs.values():
        load_options(flags)  # refuse a config the offline side cannot mirror before anything runs
    rows, table, results, paths = [], [], {}, {}
    for i, (label, extra) in enumerate(configs.items()):
        with_thread = not a.no_thread and not (a.tiny and i > 0)
        vals = measure(a.model, label, extra, a.threads, concs, a.rounds, with_thread, paths)
        check_rows(paths)  # a label this config's paths do not back stops the run here, not after the last config
        results[label] = vals
        for c in concs:
            o = statistics.median(vals["offline"][c])
            p = statistics.median(vals["process"][c])
            t = statistics.median(vals["thread"][c]) if "thread" in vals else None
            cpu = f"{statistics.median(vals['api_cpu_ms_per_token'][c]):.2f}"
            metric = "TPOT ms" if c == 1 else "out tok/s"
            # c == 1: a time, offline over served; else a rate, served over offline
            r_p, r_t = (o / p, o / t if t else None) if c == 1 else (p / o, t / o if t else None)
            table.append((label, str(c), metric, fmt_spread(vals["offline"][c]), fmt_spread(vals["process"][c]),
                          fmt_spread(vals["thread"][c]) if t else "-", f"{r_p:.2f}x", f"{r_t:.2f}x" if t else "-", cpu))
            for m in ("offline", "process", "thread"):
                if m in vals:
                    rows.append({"label": row_name(label, m), "concurrency": c, "requests": requests_for(c),
                                 "metric": metric, **spread(vals[m][c])})
            rows.append({"label": f"{label}, served (process) / offline", "concurrency": c, "metric": "ratio",
                         "median": r_p})
    check_rows(paths)
    setup = {"threads": a.threads, "lengths": f"{IN_LEN} in / {OUT_LEN} out tokens (random prompts, ignore_eos, "
                                              f"temperature {SERVER_TEMPERATURE} as the server samples by default)",
             "concurrency": ", ".join(f"{c} ({requests_for(c)} requests"
                                      f"{'; TPOT' if c == 1 else '; out tok/s'})" for c in concs),
             "offline": "the same engine without a server: engine.rate.decode_rate at c=1, else one LLMEngine "
                        "with max_num_seqs=c",
             "served": f"inferd serve --max-num-seqs {max(concs)} --kv-cache-memory {KV_MEMORY}, driven by "
                       "inferd bench "
                       "(--max-concurrency c); process = engine core in its own process, thread = --engine-in-process",
             "rounds": f"{a.rounds}, interleaved (offline, served process, served thread at each concurrency, "
                       "then again), servers up across rounds; every cell is the median, with the min-max",
             **{label: "inferd serve " + shlex.join(serve_flags(load_options(flags))) + "; offline: the same options"
                for label, flags in configs.items()}}
    report_header("what serving costs the engine: inferd serve vs the same engine offline", setup, paths)
    head = ("config", "conc", "metric", "offline (min-max)", "served (process)", "served (thread)", "process/offline",
            "thread/offline", "API CPU ms/token")
    print("ratio 1.00x = serving costs nothing")
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    write_json(a.json, setup, rows, paths, results=results)


def requests_for(c: int) -> int:
    """Requests a run sends at concurrency c (bench and offline alike)."""
    return 4 if c == 1 else 2 * c


if __name__ == "__main__":
    main()

"""Several models behind one server: what a request for a cold model waits, beside the model's own
load time.

One `inferd serve` with the two embedded models (SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M, the
default --quantization auto) and --max-loaded-models 1, so that every switch of model unloads the
other first. Requests alternate between the models; for each, the client's time to first token
(streaming, 16 prompt tokens, 8 out) is taken: a cold one (the model was unloaded: the request
waits for the evictee's engine to stop and its own to load) and a warm one (sent again right after).
Beside them, the server's own load time of that model (`load_seconds` in GET /v1/models: its engine
process from start to ready). Medians of --rounds, with the min-max.

Usage: .venv/bin/python benchmarks/model_swap.py [--rounds 3] [--threads 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import fmt_spread, report_header, served_paths, spread, write_json  # noqa: E402
from serving import free_port, inferd_env, inferd_serve_cmd, server  # noqa: E402

MODELS = {"smollm2": "default", "gemma3": "gemma3-270m"}
PROMPT = "Write one sentence about the sea."


def ttft(base: str, model: str) -> float:
    """Seconds from sending a streaming completion to its first content chunk."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first


def cards(base: str) -> dict:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return {c["id"]: c for c in json.load(r)["data"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    flags = [a for name, path in MODELS.items() for a in ("--model", f"{name}={path}")]
    flags += ["--max-loaded-models", "1"] + (["--threads", str(args.threads)] if args.threads else [])
    cmd = inferd_serve_cmd(*flags, port=free_port())
    res = {m: {"cold": [], "warm": [], "load": []} for m in MODELS}
    paths = {}
    with server(cmd, "inferd-models", env=inferd_env()) as base:
        for r in range(args.rounds):
            for m in MODELS:
                res[m]["cold"].append(ttft(base, m))
                res[m]["load"].append(cards(base)[m]["load_seconds"])
                res[m]["warm"].append(ttft(base, m))
                paths[m] = served_paths(base)
            print(f"[round {r + 1}/{args.rounds}] " + ", ".join(
                f"{m} cold {v['cold'][-1]:.2f} s (load {v['load'][-1]:.2f} s), warm {v['warm'][-1]:.3f} s"
                for m, v in res.items()), file=sys.stderr, flush=True)
    setup = {"server": " ".join(flags), "request": f"streaming completion, {PROMPT!r}, 8 tokens out",
             "rounds": args.rounds, "measure": "client time to first token; load: the server's load_seconds"}
    report_header("Several models behind one server: a cold model's first token vs its load time", setup,
                  {f"{m} (served)": p for m, p in paths.items()})
    print(f"\n{'model':<10}{'load time, s':>22}{'cold TTFT, s':>22}{'cold - load, s':>20}{'warm TTFT, s':>22}")
    rows = []
    for m, v in res.items():
        extra = [c - lo for c, lo in zip(v["cold"], v["load"])]
        print(f"{m:<10}{fmt_spread(v['load'], '{:.2f}'):>22}{fmt_spread(v['cold'], '{:.2f}'):>22}"
              f"{fmt_spread(extra, '{:.2f}'):>20}{fmt_spread(v['warm'], '{:.3f}'):>22}")
        rows.append({"model": m, "load_s": spread(v["load"]), "cold_ttft_s": spread(v["cold"]),
                     "warm_ttft_s": spread(v["warm"])})
    print("\ncold - load: the evictee's shutdown, the API process's tokenizer load and the first prefill")
    write_json(args.json, setup, rows, paths)


if __name__ == "__main__":
    main()

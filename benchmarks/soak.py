"""A long run at saturation with everything a server meets, and what it leaves behind.

`inferd serve` (engine process, n-gram speculation on, so every sequence also goes through the
speculative path) is driven by --concurrency clients for --minutes, each request drawn from:
streaming, non-streaming, n = 2, and aborted (the client closes its stream after a random number
of events). Reported: 5xx count (must be 0), KV blocks and running/waiting requests at the end
(must be 0), the RSS of the API and engine processes after warm-up and at the end (growth <= 5 %),
and output tok/s of the first and last 5 minutes (within 10 %).

The header and the report give the setup and the server's paths record (GET /v1/engine/state at
the end).

Usage: .venv/bin/python benchmarks/soak.py [--minutes 31] [--warmup 1] [--concurrency 16] [--json F]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import httpx  # noqa: E402
import psutil  # noqa: E402

from common import check_rows, cpu_features, report_header, served_paths  # noqa: E402
from serving import free_port, inferd_env, inferd_serve_cmd, server  # noqa: E402

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colours:",
           "In the beginning", "The quick brown fox", "Water boils at", "My favourite book is"]


def rss_mb(url: str) -> dict:
    port = url.rsplit(":", 1)[1]
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd and port in cmd:
            out["api"] = p.memory_info().rss / 2**20
            for c in p.children():
                out["engine"] = c.memory_info().rss / 2**20
    return out


async def client(c: httpx.AsyncClient, rng: random.Random, stop_at: float, log: list, stats: dict):
    while time.monotonic() < stop_at:
        kind = rng.choice(["stream", "plain", "n2", "abort"])
        body = {"prompt": rng.choice(PROMPTS) + " " * rng.randrange(3), "max_tokens": rng.randrange(16, 96),
                "temperature": rng.choice([0, 0.8])}
        if kind == "n2":
            body.update(n=2, temperature=0.8)
        try:
            if kind in ("stream", "abort"):
                cut = rng.randrange(1, 20) if kind == "abort" else None
                async with c.stream("POST", "/v1/completions",
                                    json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                    if r.status_code >= 500:
                        stats["5xx"] += 1
                    seen = seen_tokens = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if ev.get("usage"):  # the closing usage chunk: the tokens the events did not count
                            log.append((time.monotonic(), ev["usage"]["completion_tokens"] - seen_tokens))
                            continue
                        if "error" in ev:
                            stats["errors"] += 1
                            continue
                        for ch in ev.get("choices", []):
                            if ch.get("text"):  # an event may carry several (speculated) tokens: usage settles it
                                log.append((time.monotonic(), 1))
                                seen_tokens += 1
                        seen += 1
                        if cut is not None and seen >= cut:
                            stats["aborted"] += 1
                            break
            else:
                r = await c.post("/v1/completions", json=body)
                if r.status_code >= 500:
                    stats["5xx"] += 1
                elif r.status_code == 200:
                    log.append((time.monotonic(), r.json()["usage"]["completion_tokens"]))
            stats[kind] += 1
        except httpx.HTTPError as e:
            stats["transport_errors"] += 1
            stats.setdefault("last_transport_error", repr(e))


def gauges(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(("inferd:kv_cache_usage_perc", "inferd:num_requests_running",
                                "inferd:num_requests_waiting"))}


async def drive(url: str, minutes: float, conc: int, samples: list):
    stop_at = time.monotonic() + minutes * 60
    log: list = []
    stats = {k: 0 for k in ("stream", "plain", "n2", "abort", "aborted", "5xx", "errors", "transport_errors")}
    limits = httpx.Limits(max_connections=conc + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def sampler():
            while time.monotonic() < stop_at:
                await asyncio.sleep(30)
                samples.append((time.monotonic(), rss_mb(url)))
        tasks = [asyncio.create_task(client(c, random.Random(i), stop_at, log, stats)) for i in range(conc)]
        tasks.append(asyncio.create_task(sampler()))
        await asyncio.gather(*tasks)
    return log, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=31)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--window", type=float, default=5, help="minutes of the first and last throughput windows")
    ap.add_argument("--warmup", type=float, default=1,
                    help="minutes before the first throughput window and the RSS baseline (first requests page "
                         "weights in and fill the allocator's pools)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    flags = ["--quantization", "gguf", "--speculative-method", "ngram", "--max-num-seqs", str(a.concurrency)]
    with server(inferd_serve_cmd(*flags, port=free_port()), "inferd-soak", env=inferd_env()) as url:
        samples: list = []
        t0 = time.monotonic()
        log, stats = asyncio.run(drive(url, a.minutes, a.concurrency, samples))
        time.sleep(1)
        end = gauges(url)
        rss_end = rss_mb(url)
        paths = {"inferd serve " + " ".join(flags): served_paths(url)}
    check_rows(paths)
    w, warm_s = a.window * 60, a.warmup * 60
    first = sum(n for t, n in log if warm_s <= t - t0 < warm_s + w) / w
    last_start = max(t for t, _ in log) - w
    last = sum(n for t, n in log if t >= last_start) / w
    warm = next((s for t, s in samples if t - t0 >= warm_s), samples[0][1] if samples else rss_end)
    growth = {k: (rss_end[k] - warm[k]) / warm[k] for k in rss_end if k in warm}
    setup = {"server": "inferd serve " + " ".join(flags), "minutes": a.minutes, "warm-up minutes": a.warmup,
             "concurrency": f"{a.concurrency} clients, each sending requests back to back (stream, plain, n=2, "
                            "aborted) until the end: the number of requests is what they completed",
             "windows": f"first and last {a.window:g} minutes", "rounds": "1 (a soak is one long run)"}
    report_header("soak at saturation", setup, paths)
    report = {"cpu": cpu_features(), "setup": setup, "paths": paths, "minutes": a.minutes,
              "concurrency": a.concurrency, "requests": stats,
              "end_gauges": end, "rss_mb_after_warmup": warm, "rss_mb_end": rss_end, "rss_growth": growth,
              "tok_s_first_window": first, "tok_s_last_window": last, "last_over_first": last / first if first else None}
    print(json.dumps(report, indent=2))
    ok = (stats["5xx"] == 0 and all(v == 0 for v in end.values()) and all(g <= 0.05 for g in growth.values())
          and first and abs(last / first - 1) <= 0.10)
    print(f"\n{cpu_features()}: {'PASS' if ok else 'FAIL'}: 5xx {stats['5xx']}, end gauges {end}, RSS growth "
          + ", ".join(f"{k} {100 * v:+.1f} %" for k, v in growth.items())
          + f", tok/s first {a.window:g} min {first:.1f} / last {last:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

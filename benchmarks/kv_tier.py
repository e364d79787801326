"""KV beyond one pool (issue #46), in one run: what the second KV tier buys when long shared prefixes
overflow the pool, how fast it loads against the disk and against recomputing, and what routing on
the backends' own KV events buys over the router's guess.

Parts (--parts, all by default):

  ttft       `inferd bench --dataset prefix-families` (FAMILIES system prompts of INPUT tokens, each
             request one of them plus a question; one request at a time) against one server whose
             pool (--num-kv-blocks) holds fewer families than there are, three ways: no tier (every
             prefix the pool evicted is recomputed), a disk tier (a fresh directory under --disk-dir),
             a shared-memory tier (a fresh directory on /dev/shm). TTFT p50/p99 per setup and the
             ratio to recompute; from the server's counters, prompt tokens computed, found in the
             pool and loaded from the tier; the outputs of every setup compared (greedy, the same
             prompts: equal texts expected, a difference printed).
  bandwidth  from the same runs: the tier's load bandwidth (bytes loaded / load time, its
             histogram), the disk's own read bandwidth (the tier's files read cold after
             posix_fadvise(DONTNEED), then warm), and recompute expressed the same way: prompt
             tokens a second of prefill times the KV bytes a token holds.
  router     two servers with --kv-events-config and the same small pools behind `inferd router`,
             once with --policy prefix (its guess) and once with --policy kv_events (the backends'
             events), the same prefix-families workload at --concurrency; each run on fresh
             servers. Behind one router, then behind two (a highly available router tier: the
             prompts dealt over both, one `inferd bench` each, at once), where each guessing
             router knows only what it sent itself while the events are the same for both. The
             prefix-cache hit rate the backends count, every row printed.

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): 3
families of 64 tokens, 6 requests, a pool of about 2 families, concurrency 2.

Usage: .venv/bin/python benchmarks/kv_tier.py [--model F.gguf] [--parts ttft,bandwidth,router] [--input-len 1024]
       [--families 8] [--num-prompts 40] [--pool-families 3] [--concurrency 4] [--disk-dir /var/tmp]
       [--json out.json] [--tiny]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

from common import report_header, served_paths, write_json  # noqa: E402
from serving import free_port, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402

BLOCK = 16


def counters(base: str) -> dict[str, float]:
    """Sums of every sample of each series at base/metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("inferd:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def bench_args(a, concurrency: int) -> list[str]:
    return ["--dataset", "prefix-families", "--input-len", str(a.input_len), "--prefix-families", str(a.families),
            "--question-len", "32", "--output-len", "16", "--num-prompts", str(a.num_prompts),
            "--max-concurrency", str(concurrency), "--seed", "0", "--extra-body", '{"temperature": 0}']


def model_flags(a) -> list[str]:
    return ["--model", a.model] if a.model else []


def pool_blocks(a) -> int:
    return a.pool_families * (a.input_len // BLOCK + 4)


def probe_prompts(a) -> list[str]:
    """One prompt of each family, as the bench builds them (the same seed): the outputs compared."""
    seen, out = set(), []
    for p in _bench_prompts(a):
        head = p.prompt[:200]
        if head not in seen:
            seen.add(head)
            out.append(p.prompt)
    return out


def outputs(base: str, prompts: list[str]) -> list[str]:
    """Each prompt's greedy text, sent twice in a row and the second kept: a prefix hit in every setup
    (the pool's, or the tier's). With int8 activations (W4A8, --quantization auto) a hit's last
    prompt token goes through the fused decode step, a miss's through the prefill, and the two
    round differently: hits are compared with hits. Exactness against a miss in fp32 is the
    suite's (tests/test_kv_tier.py)."""
    out = []
    for p in prompts:
        for _ in range(2):
            r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0},
                           timeout=300).json()
        out.append(r["choices"][0]["text"])
    return out


def run_ttft(a) -> tuple[list, dict]:
    setups = [("recompute", None), ("disk tier", "disk"), ("shm tier", "shm")]
    rows, runs, paths = [], {}, {}
    probes = probe_prompts(a)
    for label, kind in setups:
        d = None
        extra = []
        if kind == "disk":
            d = tempfile.mkdtemp(prefix="inferd-kv-tier-", dir=a.disk_dir)
        elif kind == "shm":
            d = tempfile.mkdtemp(prefix="inferd-kv-tier-", dir="/dev/shm")
        if d:
            extra = ["--kv-tier", d]
        port = free_port()
        cmd = inferd_serve_cmd(*model_flags(a), "--quantization", "auto", "--num-kv-blocks", str(pool_blocks(a)),
                               *extra, port=port)
        try:
            with server(cmd, label.replace(" ", "-")) as base:
                res = run_bench(base, *bench_args(a, 1))
                c = counters(base)  # before the probes
                texts = outputs(base, probes)
                paths[label] = served_paths(base)
        finally:
            tier_files = []
            if d:
                for root, _, files in os.walk(d):
                    tier_files += [os.path.join(root, f) for f in files if f.endswith(".kv")]
        runs[label] = {"res": res, "c": c, "dir": d, "files": tier_files, "texts": texts}
    base_p50 = runs["recompute"]["res"]["median_ttft_ms"]
    for label, _ in setups:
        r, c = runs[label]["res"], runs[label]["c"]
        rows.append({"setup": label, "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
                     "speedup_p50": base_p50 / r["median_ttft_ms"],
                     "prompt_tokens": c.get("inferd:prompt_tokens_total", 0),
                     "computed": c.get("inferd:prompt_tokens_computed_total", 0),
                     "pool_hits": c.get("inferd:prefix_cache_hits_total", 0),
                     "tier_loaded": c.get("inferd:kv_tier_loaded_tokens_total", 0),
                     "failed": r.get("failed", 0)})
    print_table("prefix-families TTFT at one pool size (one request at a time)",
                ["setup", "TTFT p50 ms", "TTFT p99 ms", "p50 vs recompute", "prompt tok", "computed", "pool hits",
                 "tier loaded"],
                [[x["setup"], f"{x['ttft_p50_ms']:.0f}", f"{x['ttft_p99_ms']:.0f}", f"{x['speedup_p50']:.2f}x",
                  f"{x['prompt_tokens']:.0f}", f"{x['computed']:.0f}", f"{x['pool_hits']:.0f}",
                  f"{x['tier_loaded']:.0f}"] for x in rows])
    want = runs["recompute"]["texts"]
    for label, _ in setups[1:]:
        got = runs[label]["texts"]
        same = sum(g == w for g, w in zip(got, want))
        print(f"greedy outputs of one prompt per family (prefix hits), {label} vs recompute: {same}/{len(want)} equal")
        for g, w in zip(got, want):
            if g != w:
                print(f"  differs: {g!r} vs {w!r}")
        next(x for x in rows if x["setup"] == label)["outputs_equal"] = f"{same}/{len(want)}"
    return rows, {"runs": runs, "paths": paths}


def read_bandwidth(files: list[str], cold: bool) -> float:
    """GB/s reading these files whole (cold: their pages dropped from the cache first)."""
    total = 0
    if cold:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            total += len(f.read())
    return total / (time.perf_counter() - t0) / 1e9


def run_bandwidth(a, ttft: dict) -> list:
    rows = []
    runs = ttft["runs"]
    rec = runs["recompute"]
    # recompute as a bandwidth: prompt tokens a second of prefill x KV bytes a token (from a tier file)
    any_files = runs["disk tier"]["files"] or runs["shm tier"]["files"]
    block_bytes = os.path.getsize(any_files[0]) if any_files else 0
    per_token = block_bytes / BLOCK
    ttft_s = rec["res"]["median_ttft_ms"] / 1e3
    prefill_tps = (a.input_len + 32) / ttft_s  # a recomputed prompt's TTFT is its prefill
    for label in ("disk tier", "shm tier"):
        c, files = runs[label]["c"], runs[label]["files"]
        secs = c.get("inferd:kv_tier_load_seconds_sum", 0)
        loaded = c.get("inferd:kv_tier_loaded_bytes_total", 0)
        rows.append({"what": f"{label}: load into the pool", "gbs": loaded / secs / 1e9 if secs else 0.0})
        if files:
            rows.append({"what": f"{label}: files read cold", "gbs": read_bandwidth(files, cold=True)})
            rows.append({"what": f"{label}: files read warm", "gbs": read_bandwidth(files, cold=False)})
    rows.append({"what": f"recompute ({prefill_tps:.0f} prompt tok/s x {per_token / 1024:.1f} KiB/token)",
                 "gbs": prefill_tps * per_token / 1e9})
    print_table("KV tier bandwidth", ["what", "GB/s"], [[r["what"], f"{r['gbs']:.3f}"] for r in rows])
    return rows


def bench_split(routers: list[str], a, prompts: list[str]) -> list[dict]:
    """The prompts dealt round-robin over the routers, one `inferd bench` each, all at once (a router
    tier of replicas behind one address, as a highly available deployment runs it)."""
    import json
    import subprocess

    from serving import inferd_env

    procs, outs = [], []
    with tempfile.TemporaryDirectory(prefix="inferd-kv-tier-") as d:
        for i, r in enumerate(routers):
            part = prompts[i::len(routers)]
            path = os.path.join(d, f"p{i}.jsonl")
            with open(path, "w") as f:
                for p in part:
                    f.write(json.dumps({"prompt": p}) + "\n")
            out = os.path.join(d, f"r{i}.json")
            cmd = [sys.executable, "-m", "inferd", "bench", "--base-url", r, "--result-json", out, "--dataset", "jsonl",
                   "--dataset-path", path, "--num-prompts", str(len(part)), "--output-len", "16", "--seed", "0",
                   "--max-concurrency", str(max(1, a.concurrency // len(routers))), "--extra-body", '{"temperature": 0}']
            procs.append(subprocess.Popen(cmd, env=inferd_env(), stdout=subprocess.DEVNULL))
            outs.append(out)
        for p in procs:
            p.wait(1800)
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
    return results


def run_router(a) -> list:
    rows = []
    all_prompts = [p.prompt for p in _bench_prompts(a)]
    for n_routers in (1, 2):
        for policy in ("prefix", "kv_events"):
            ports = [(free_port(), free_port()) for _ in range(2)]
            with contextlib.ExitStack() as st:
                bases = []
                for i, (p, q) in enumerate(ports):
                    cmd = inferd_serve_cmd(*model_flags(a), "--quantization", "auto", "--num-kv-blocks",
                                           str(pool_blocks(a)),
                                           "--threads", "1", "--kv-events-config",
                                           f'{{"endpoint": "tcp://127.0.0.1:{p}", "replay_endpoint": "tcp://127.0.0.1:{q}"}}',
                                           port=free_port())
                    bases.append(st.enter_context(server(cmd, f"backend{i}")))
                routers = []
                for k in range(n_routers):
                    rcmd = [sys.executable, "-m", "inferd", "router", "--port", str(free_port()), "--policy", policy,
                            *[x for b in bases for x in ("--backend", b)]]
                    if policy == "kv_events":
                        rcmd += [x for p, q in ports for x in ("--kv-events-endpoint",
                                                               f"tcp://127.0.0.1:{p},tcp://127.0.0.1:{q}")]
                    routers.append(st.enter_context(server(rcmd, f"router{k}-{policy}")))
                if n_routers == 1:
                    res = [run_bench(routers[0], *bench_args(a, a.concurrency))]
                else:
                    res = bench_split(routers, a, all_prompts)
                hits = sum(counters(b).get("inferd:prefix_cache_hits_total", 0) for b in bases)
                queries = sum(counters(b).get("inferd:prefix_cache_queries_total", 0) for b in bases)
                rows.append({"routers": n_routers, "policy": policy, "hit_rate": hits / queries if queries else 0.0,
                             "ttft_p50_ms": statistics.median(r["median_ttft_ms"] for r in res),
                             "failed": sum(r.get("failed", 0) for r in res)})
    print_table(f"router policies, prefix-families at total concurrency {a.concurrency}, two backends",
                ["routers", "policy", "prefix hit rate", "TTFT p50 ms", "failed"],
                [[str(r["routers"]), r["policy"], f"{100 * r['hit_rate']:.1f} %", f"{r['ttft_p50_ms']:.0f}",
                  str(r["failed"])] for r in rows])
    return rows


def _bench_prompts(a):
    from inferd.bench.datasets import build_prompts
    from inferd.bench.tokenizer import default_tokenizer_path, load_local

    prompts, _ = build_prompts("prefix-families", a.num_prompts, load_local(default_tokenizer_path()),
                               str(a.input_len), "16", 0, None, a.families, "32")
    return prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default)")
    ap.add_argument("--parts", default="ttft,bandwidth,router")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--pool-families", type=int, default=3, help="the pool holds about this many families")
    ap.add_argument("--concurrency", type=int, default=4, help="router part")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the disk tier's directory goes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): 3 families of 64 tokens, 6 "
                         "requests, a pool of about 2 families, concurrency 2")
    a = ap.parse_args()
    if a.tiny:
        a.input_len, a.families, a.num_prompts, a.pool_families, a.concurrency = 64, 3, 6, 2, 2
    parts = a.parts.split(",")
    setup = {"model": (os.path.basename(a.model) if a.model else "the embedded default (SmolLM2-135M Q4_1)")
             + ", --quantization auto",
             "workload": f"prefix-families: {a.families} prefixes of {a.input_len} tokens + 32-token questions, "
                         f"16 output tokens, {a.num_prompts} requests",
             "pool": f"--num-kv-blocks {pool_blocks(a)} (about {a.pool_families} families)",
             "disk tier directory": a.disk_dir}
    out: dict = {}
    ttft = None
    if "ttft" in parts or "bandwidth" in parts:
        out["ttft"], ttft = run_ttft(a)
    if "bandwidth" in parts:
        out["bandwidth"] = run_bandwidth(a, ttft)
    for run in (ttft or {}).get("runs", {}).values():  # the tiers' directories (run_bandwidth read them)
        if run["dir"]:
            shutil.rmtree(run["dir"], ignore_errors=True)
    if "router" in parts:
        out["router"] = run_router(a)
    report_header("inferd KV tier and KV events", setup, ttft["paths"] if ttft else {})
    if a.json:
        write_json(a.json, setup, [r for v in out.values() for r in v], ttft["paths"] if ttft else {}, **out)


if __name__ == "__main__":
    main()

"""Disaggregated prefill/decode against colocated serving on one box, in one run (issue #22).

Three setups, started one at a time on the same cores, each driven by the same `inferd bench`
sweep (`--dataset mixed`: a short interactive class and a long-prompt class, Poisson arrivals at
each --rates value, SLO attainment under `--goodput ttft:T tpot:P`):

  A   colocated, no chunked prefill: one `inferd serve --threads 2`, token budget
      (--max-num-batched-tokens) = the longest prompt + --max-num-seqs, so that any prompt runs in
      one step beside a full batch of decodes, which then wait for it
  B   colocated with chunked prefill: the same server at each --budgets token budget (prompts
      longer than the step's budget are split over several steps; decodes go first in every step)
  C   1P1D: a prefill worker (KV producer) pinned to the first core with --threads 1, a decode
      worker (KV consumer) pinned to the second with --threads 1, KV handed over by the
      SharedMemoryConnector (or --connector zmq), `inferd router --prefill P --decode D` in front,
      pinned to the decode worker's core

Reported per setup and rate: the short class's (the first --mix class) TPOT and ITL p50/p99, TTFT
p50/p99 of the short and the long class, and SLO attainment (DistServe's: the fraction of requests
meeting both the TTFT and the TPOT SLO); per setup its goodput, DistServe's: the highest swept rate
with attainment >= 90 %; the best B budget by that goodput. After C, the KV counters of both
workers and the router: transfers, bytes moved, bytes per token (checked against layers x 2 x KV
heads x head dim x KV dtype size), failures, recomputes (must be 0), lease expiries, fallbacks.
Prefix caching is off on every server (--prefix-caching turns it on): each sweep point sends the
same prompts, which later points would otherwise find cached.

Written to DIR/disaggregated.json (every number; each setup's full sweep document beside it as
DIR/sweep-*.json) and DIR/disaggregated.html (SLO attainment vs rate, one line per setup, with a
dashed 90 % line; p99 TPOT and TTFT vs rate; the tables). Exit status 1 when the 1P1D hand-over
was not clean (a recompute, a failed pull, an expired lease, a fallback, no bytes moved).

A is "no chunking" as far as this scheduler allows: its budget fits any one prompt with a full
batch of decodes, but a second prompt admitted into the same step still gets only what is left of
the budget (the scheduler fills every step), so it can be split; vLLM without chunked prefill
would hold it back instead.

The defaults (6 setups x 4 rates x 40 requests, Poisson) send for about 15 min in all; with the
server starts (the default model loads in some seconds per server, 7 servers), a warmup and
the baseline, and the tails of overloaded points, expect about 20-25 min on a 2-core box.

What a 2-core box cannot show. Disaggregation pays when prefill and decode each get hardware of
their own, sized for their phase; here C splits the same two cores one-one, so its decode
worker has half the compute A and B use for every decode step, and its prefill worker half for
every prompt. The two workers still share the memory bandwidth and the last-level cache (decode
is bandwidth-bound, so a prefill burst on core 0 slows decode on core 1 even without sharing a
core). The router runs on the decode core and costs it CPU on every token it relays; the bench
client is not pinned and takes CPU from whichever setup it drives (the same in all three). What
this run can show: the interference that chunked prefill trades against TTFT (A vs B), and that
on equal cores 1P1D isolates TPOT from long prompts at the price of each phase running on one
core, plus the exact cost and correctness of the KV hand-over.

The header (and the JSON's "setup") says what ran: every server's paths record, read from its GET
/v1/engine/state after its sweep (the prefill and decode workers' apart), checked against the setup
names; the JSON also holds "paths" and one row per setup and rate ("rows").

Usage: .venv/bin/python benchmarks/disaggregated.py [--setups A,B,C] [--mix chat:0.8:128:64,rag:0.2:1024:16]
       [--rates 0.5,1,2,3] [--num-prompts 40] [--budgets 64,128,256,512] [--slo-ttft-ms 2000]
       [--slo-tpot-ms 100] [--model M] [--quantization gguf] [--dtype auto] [--connector shm|zmq]
       [--out out/disaggregated]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import httpx  # noqa: E402

from common import check_rows, cpu_features, paths_line, served_paths  # noqa: E402
from serving import SRC, fmt, free_port, inferd_env, inferd_serve_cmd, print_table, server  # noqa: E402

sys.path.insert(0, SRC)

SERVED_NAME = "disagg-bench"
SLO_TARGET = 0.9  # DistServe's attainment target for goodput (the bench's sweep uses the same)
CONNECTORS = {"shm": "SharedMemoryConnector", "zmq": "ZmqConnector"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_MIX_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.-]*\s*:)")  # the bench's own rule: a comma in normal:M,S is followed by a digit


# -- the workload ------------------------------------------------------------------------------------
def max_len(spec: str) -> int:
    """Upper end of a bench length spec: N, MIN-MAX, normal:MEAN,STD (mean + 4 std)."""
    s = spec.strip()
    if s.startswith("normal:"):
        m, sd = (float(x) for x in s[7:].split(","))
        return int(math.ceil(m + 4 * sd))
    if "-" in s:
        return int(s.split("-", 1)[1])
    return int(s)


def mix_classes(spec: str) -> list[tuple[str, int]]:
    """[(class name, longest input length)] in --mix order (validated by the bench's own parser first)."""
    from inferd.bench.datasets import parse_mix

    parse_mix(spec)
    out = []
    for part in _MIX_SPLIT.split(spec.strip()):
        f = [x.strip() for x in part.split(":")]
        inp = ":".join(f[2:4]) if f[2] == "normal" else f[2]
        out.append((f[0], max_len(inp)))
    return out


# -- processes ---------------------------------------------------------------------------------------
def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pinned(cpus: list[int], cmd: list[str]) -> list[str]:
    taskset = shutil.which("taskset")
    return [taskset, "-c", ",".join(map(str, cpus)), *cmd] if taskset else cmd


def serve_args(a, *extra: str) -> list[str]:
    out = ["--quantization", a.quantization, "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs),
           "--served-model-name", SERVED_NAME, "--enable-prompt-tokens-details"]
    if not a.prefix_caching:  # every sweep point sends the same prompts: later points would hit the cache
        out.append("--no-prefix-caching")
    if a.kv_cache_memory:
        out += ["--kv-cache-memory", a.kv_cache_memory]
    if a.model:
        out += ["--model", a.model]
    return out + list(extra)


@contextlib.contextmanager
def colocated(a, budget: int, name: str):
    cpus = cores()[:2]
    cmd = pinned(cpus, inferd_serve_cmd(*serve_args(a, "--threads", str(len(cpus)), "--max-num-batched-tokens",
                                                    str(budget)), port=free_port()))
    with server(cmd, name, env=inferd_env()) as url:
        yield url, {"server": url}, [" ".join(cmd)]


@contextlib.contextmanager
def one_p_one_d(a, prefill_budget: int):
    cs = cores()
    p_core, d_core = cs[0], cs[1 % len(cs)]
    conn = CONNECTORS[a.connector]

    def kv(role: str) -> str:
        return json.dumps({"kv_connector": conn, "kv_role": role,
                           "kv_connector_extra_config": {"lease_timeout_s": a.lease_timeout_s}})

    # the prefill worker has no decodes to protect: it takes whole prompts (no chunking)
    pcmd = pinned([p_core], inferd_serve_cmd(*serve_args(a, "--threads", "1", "--max-num-batched-tokens",
                                                         str(prefill_budget), "--kv-transfer-config",
                                                         kv("kv_producer")), port=free_port()))
    dcmd = pinned([d_core], inferd_serve_cmd(*serve_args(a, "--threads", "1", "--kv-transfer-config",
                                                         kv("kv_consumer")), port=free_port()))
    with contextlib.ExitStack() as st:
        p = st.enter_context(server(pcmd, "prefill", env=inferd_env()))
        d = st.enter_context(server(dcmd, "decode", env=inferd_env()))
        rcmd = pinned([d_core], [sys.executable, "-m", "inferd", "router", "--host", "127.0.0.1", "--port",
                                 str(free_port()), "--prefill", p, "--decode", d, "--health-interval", "1",
                                 "--require-all-backends", "--log-level", "warning"])
        r = st.enter_context(server(rcmd, "router", env=inferd_env()))
        yield r, {"producer": p, "consumer": d, "router": r}, [" ".join(c) for c in (pcmd, dcmd, rcmd)]


# -- the bench ---------------------------------------------------------------------------------------
def bench_common(a) -> list[str]:
    out = ["--dataset", "mixed", "--mix", a.mix, "--model", SERVED_NAME, "--no-server-metrics"]
    if a.model:
        out += ["--tokenizer", a.model]  # the bench's default tokenizer is the default model's
    return out


def run_bench(url: str, args: list[str], out_json: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "inferd", "bench", "--base-url", url, "--result-json", out_json, *args]
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=inferd_env(), timeout=timeout, stdout=subprocess.PIPE, text=True)
    if proc.returncode not in (0, 3):  # 3: an SLA missed (none is set here, but it is no crash)
        raise RuntimeError(f"inferd bench exited with {proc.returncode}:\n{proc.stdout[-3000:]}")
    with open(out_json) as f:
        return json.load(f)


def baseline(url: str, a, where: str) -> dict:
    """Requests one at a time: the latencies with no queueing and no interference."""
    path = os.path.join(a.out, "baseline.json")
    res = run_bench(url, bench_common(a) + ["--num-prompts", str(a.baseline_prompts), "--max-concurrency", "1",
                                            "--warmup", "1", "--seed", str(a.seed + 1000)], path, 600)
    classes = res.get("classes") or {}
    out = {"setup": where, "classes": {k: {m: v.get(m) for m in ("median_ttft_ms", "median_tpot_ms", "num_prompts")}
                                       for k, v in classes.items()}}
    parts = [f"{k} TTFT {fmt(v['median_ttft_ms'], '{:.0f}')} ms, TPOT {fmt(v['median_tpot_ms'], '{:.1f}')} ms"
             for k, v in out["classes"].items()]
    print(f"[baseline] one request at a time on {where} (p50 of {a.baseline_prompts}): " + "; ".join(parts)
          + f" -- SLOs: TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms", file=sys.stderr, flush=True)
    return out


def sweep(url: str, a, tag: str) -> dict:
    path = os.path.join(a.out, f"sweep-{tag}.json")
    rates = ",".join(f"{r:g}" for r in a.rate_list)
    per_point = max(a.num_prompts / r for r in a.rate_list)
    doc = run_bench(url, bench_common(a) + [
        "--num-prompts", str(a.num_prompts), "--seed", str(a.seed), "--warmup", str(a.warmup),
        "--goodput", f"ttft:{a.slo_ttft_ms:g}", f"tpot:{a.slo_tpot_ms:g}", "--sweep", f"rate:{rates}"],
        path, timeout=600 + len(a.rate_list) * (per_point + 600))
    for p in doc.get("points") or []:
        r = p["result"]
        if r.get("failed"):
            print(f"[bench] WARNING: {tag} {p['label']}: {r['failed']} requests failed: {r.get('failure_reasons')} "
                  f"{(r.get('errors') or [])[:3]}", file=sys.stderr, flush=True)
        for w in r.get("warnings") or ():
            print(f"[bench] {tag} {p['label']}: warning: {w}", file=sys.stderr, flush=True)
    return doc


CLASS_KEYS = ("num_prompts", "completed", "failed", "slo_attainment", "median_ttft_ms", "p99_ttft_ms",
              "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
POINT_KEYS = ("completed", "failed", "duration", "request_throughput", "request_goodput", "slo_attainment",
              "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "median_itl_ms", "p99_itl_ms", "client_cpu_util", "warnings")


def points_of(doc: dict) -> list[dict]:
    out = []
    for p in sorted(doc.get("points") or [], key=lambda p: p["value"]):
        r = p["result"]
        out.append({"rate": p["value"], **{k: r.get(k) for k in POINT_KEYS},
                    "classes": {c: {k: v.get(k) for k in CLASS_KEYS} for c, v in (r.get("classes") or {}).items()}})
    return out


# -- /metrics ----------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)")


def scrape(url: str) -> list[tuple[str, dict, float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def total(samples, name: str, **match) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in match.items()))


def expected_bytes_per_token(model: str | None, kv_dtype: str | None) -> tuple[int | None, str]:
    """layers x 2 (K, V) x KV heads x head dim x element size, from the model file's header."""
    size = DTYPE_BYTES.get(kv_dtype or "")
    try:
        if model and os.path.isdir(model):
            from inferd.loading.checks import read_config_json

            c = read_config_json(os.path.join(model, "config.json"))
            layers, kvh = c["num_hidden_layers"], c.get("num_key_value_heads", c["num_attention_heads"])
            hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        else:
            from inferd.gguf_file import default_model_path, read_gguf_metadata

            kv = read_gguf_metadata(model or default_model_path())
            arch = kv["general.architecture"]
            layers = kv[f"{arch}.block_count"]
            heads = kv[f"{arch}.attention.head_count"]
            kvh = kv.get(f"{arch}.attention.head_count_kv", heads)
            hd = kv.get(f"{arch}.attention.key_length") or kv[f"{arch}.embedding_length"] // heads
    except Exception as e:  # an unusual model file: the measured number is still printed
        return None, f"model shape unreadable ({type(e).__name__}: {e})"
    how = f"{layers} layers x 2 x {kvh} KV heads x {hd} head dim x {size or '?'} B ({kv_dtype or 'dtype unknown'})"
    return (layers * 2 * kvh * hd * size if size else None), how


def kv_report(a, urls: dict) -> dict:
    # an idle engine reports freed leases within 0.5 s (its poll interval): the last confirmation must show
    time.sleep(1.5)
    cons, prod, rout = scrape(urls["consumer"]), scrape(urls["producer"]), scrape(urls["router"])
    dtype = next((lab.get("cache_dtype") for n, lab, _ in cons if n == "inferd:cache_config_info"), None)
    rep = {
        "connector": CONNECTORS[a.connector],
        "transfers": total(cons, "inferd:kv_transfers_total"),
        "bytes": total(cons, "inferd:kv_transfer_bytes_total"),
        "tokens": total(cons, "inferd:kv_transfer_tokens_total"),
        "failures": total(cons, "inferd:kv_transfer_failures_total"),
        "recomputes": total(cons, "inferd:kv_transfer_recomputes_total"),
        "seconds_sum": total(cons, "inferd:kv_transfer_seconds_sum"),
        "seconds_count": total(cons, "inferd:kv_transfer_seconds_count"),
        "consumer_prompt_tokens": total(cons, "inferd:prompt_tokens_total"),
        "consumer_prompt_tokens_computed": total(cons, "inferd:prompt_tokens_computed_total"),
        "producer_prompt_tokens_computed": total(prod, "inferd:prompt_tokens_computed_total"),
        "producer_bytes_sent": total(prod, "inferd:kv_transfer_bytes_sent_total"),
        "leases": total(prod, "inferd:kv_leases_total"),
        "lease_confirmed": total(prod, "inferd:kv_lease_confirmed_total"),
        "lease_expiries": total(prod, "inferd:kv_lease_expiries_total"),
        "router_disagg": total(rout, "inferd:router_disagg_requests_total", path="disagg"),
        "router_fallback": total(rout, "inferd:router_disagg_requests_total", path="fallback"),
        "router_prefill_failures": total(rout, "inferd:router_prefill_failures_total"),
        "router_failed": total(rout, "inferd:router_failed_total"),
        "kv_dtype": dtype,
    }
    rep["bytes_per_token"] = rep["bytes"] / rep["tokens"] if rep["tokens"] else None
    rep["expected_bytes_per_token"], rep["expected_how"] = expected_bytes_per_token(a.model, dtype)
    rep["mean_transfer_ms"] = 1e3 * rep["seconds_sum"] / rep["seconds_count"] if rep["seconds_count"] else None
    problems = []
    if rep["recomputes"]:
        problems.append(f"{rep['recomputes']:.0f} prompts RECOMPUTED on the decode worker (KV not pulled)")
    if rep["failures"]:
        problems.append(f"{rep['failures']:.0f} KV pulls failed")
    if rep["lease_expiries"]:
        problems.append(f"{rep['lease_expiries']:.0f} leases expired unpulled")
    if rep["router_fallback"] or rep["router_prefill_failures"]:
        problems.append(f"{rep['router_fallback']:.0f} requests fell back to decode-side prefill "
                        f"({rep['router_prefill_failures']:.0f} prefill failures)")
    held = rep["leases"] - rep["lease_confirmed"] - rep["lease_expiries"]
    if held:
        problems.append(f"{held:.0f} leases neither confirmed nor expired at the end")
    if not rep["bytes"]:
        problems.append("no KV bytes moved")
    exp, got = rep["expected_bytes_per_token"], rep["bytes_per_token"]
    if exp is not None and got is not None and abs(got - exp) > 0.5:
        problems.append(f"bytes/token {got:.1f} != expected {exp}")
    rep["problems"] = problems
    return rep


def print_kv(rep: dict, stream=None) -> str:
    lines = [f"\n1P1D KV hand-over ({rep['connector']}, consumer + producer + router /metrics over the "
             f"whole setup, its warmup included):",
             f"  transfers {rep['transfers']:.0f}, router disagg {rep['router_disagg']:.0f}, fallback "
             f"{rep['router_fallback']:.0f}, prefill failures {rep['router_prefill_failures']:.0f}, router failed "
             f"{rep['router_failed']:.0f}",
             f"  KV bytes moved {rep['bytes']:.0f} for {rep['tokens']:.0f} tokens: "
             f"{fmt(rep['bytes_per_token'], '{:.1f}')} B/token (expected {fmt(rep['expected_bytes_per_token'], '{}')}: "
             f"{rep['expected_how']}); mean pull {fmt(rep['mean_transfer_ms'], '{:.2f}')} ms",
             f"  recomputes {rep['recomputes']:.0f}, pull failures {rep['failures']:.0f}; leases {rep['leases']:.0f}, "
             f"confirmed {rep['lease_confirmed']:.0f}, expired {rep['lease_expiries']:.0f}"
             + (f"; producer bytes sent {rep['producer_bytes_sent']:.0f}" if rep["producer_bytes_sent"] else ""),
             f"  prompt tokens computed: producer {rep['producer_prompt_tokens_computed']:.0f}, consumer "
             f"{rep['consumer_prompt_tokens_computed']:.0f} of its {rep['consumer_prompt_tokens']:.0f} "
             f"(one per transferred request is expected)"]
    if rep["problems"]:
        bar = "!" * 100
        lines += [bar, "WARNING: 1P1D KV hand-over not clean: " + "; ".join(rep["problems"]), bar]
    else:
        lines.append("  OK: every prompt's KV was pulled, none recomputed, no lease expired")
    text = "\n".join(lines)
    print(text, file=stream or sys.stdout, flush=True)
    return text


# -- tables and the page ---------------------------------------------------------------------------------
def pct(v) -> str:
    return fmt(None if v is None else 100 * v, "{:.1f}")


def table_rows(setups: list[dict], short: str, long: str | None) -> tuple[list[str], list[list[str]]]:
    header = ["setup", "rate", "ok/fail", "SLO %", f"{short} TPOT p50", "p99", f"{short} ITL p50", "p99",
              f"{short} TTFT p50", "p99"] + ([f"{long} TTFT p50", "p99"] if long else [])
    rows = []
    for s in setups:
        for p in s["points"]:
            c = p["classes"].get(short, {})
            row = [s["name"], f"{p['rate']:g}", f"{p['completed']}/{p['failed']}", pct(p["slo_attainment"]),
                   fmt(c.get("median_tpot_ms"), "{:.1f}"), fmt(c.get("p99_tpot_ms"), "{:.1f}"),
                   fmt(c.get("median_itl_ms"), "{:.1f}"), fmt(c.get("p99_itl_ms"), "{:.1f}"),
                   fmt(c.get("median_ttft_ms"), "{:.0f}"), fmt(c.get("p99_ttft_ms"), "{:.0f}")]
            if long:
                lc = p["classes"].get(long, {})
                row += [fmt(lc.get("median_ttft_ms"), "{:.0f}"), fmt(lc.get("p99_ttft_ms"), "{:.0f}")]
            rows.append(row)
    return header, rows


def goodput_rows(setups: list[dict], best_b: str | None) -> tuple[list[str], list[list[str]]]:
    header = ["setup", "goodput req/s", "max SLO %", "token budget", "note"]
    rows = []
    for s in setups:
        g = s["goodput_rate"]
        att = [p["slo_attainment"] for p in s["points"] if p["slo_attainment"] is not None]
        rows.append([s["name"], "none" if g is None else f"{g:g}", pct(max(att) if att else None),
                     str(s.get("budget") or "-"), "best B" if s["name"] == best_b else ""])
    return header, rows


def write_page(path: str, doc: dict, title: str, header_text: str, tables: list[tuple[str, list, list]],
               kv_text: str | None) -> None:
    from html import escape

    from inferd.bench.html import _page, _table, write_html
    from inferd.bench.svgplot import plot

    setups = doc["setups"]
    order = [s for s in setups if s["kind"] == "A"]
    best = [s for s in setups if s["name"] == doc.get("best_b")]
    order += best + [s for s in setups if s["kind"] == "B" and s not in best] + [s for s in setups if s["kind"] == "C"]
    colors = {"A": "#d62728", "C": "#1f77b4"}
    b_others = ["#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]
    series = []
    for s in order:
        # short legend labels: six of them must fit in one row above the frame
        label = (f"{s['kind']} b={s['budget']}" if s["budget"] else f"C {s['name'].split()[-1]}") + (
            " best" if s["name"] == doc.get("best_b") else "")
        color = colors.get(s["kind"]) or (b_others.pop(0) if b_others else None)
        ser = {"label": label, "x": [p["rate"] for p in s["points"]],
               "y": [None if p["slo_attainment"] is None else 100 * p["slo_attainment"] for p in s["points"]],
               "kind": "linepoints", "color": color}
        if s["kind"] == "B" and s["name"] != doc.get("best_b"):
            ser["dash"] = True
        series.append(ser)
    short, long = doc["short_class"], doc["long_class"]
    figs = [plot("SLO attainment vs request rate", "request rate (req/s)", "SLO attainment (%)", series,
                 hlines=[(100 * SLO_TARGET, "90 % (DistServe goodput target)")],
                 note=f"SLOs: TTFT {doc['slo_ttft_ms']:g} ms, TPOT {doc['slo_tpot_ms']:g} ms", width=760, height=420)]

    def metric_series(cls, key):
        return [dict(ser, y=[p["classes"].get(cls, {}).get(key) for p in s["points"]])
                for ser, s in zip(series, order)]

    figs.append(plot(f"{short}: p99 TPOT vs request rate", "request rate (req/s)", "ms",
                     metric_series(short, "p99_tpot_ms"), hlines=[(doc["slo_tpot_ms"], "TPOT SLO")]))
    if long:
        figs.append(plot(f"{long}: p99 TTFT vs request rate", "request rate (req/s)", "ms",
                         metric_series(long, "p99_ttft_ms"), hlines=[(doc["slo_ttft_ms"], "TTFT SLO")]))
    body = [f"<h1>{escape(title)}</h1>", f"<pre class=\"meta\" style=\"white-space:pre-wrap\">{escape(header_text)}</pre>",
            '<div class="grid">' + "".join(figs) + "</div>"]
    for name, head, rows in tables:
        body.append(f"<h2>{escape(name)}</h2>" + _table(head, [[escape(c) for c in r] for r in rows]))
    if kv_text:
        body.append(f"<h2>1P1D KV hand-over</h2><pre>{escape(kv_text.strip())}</pre>")
    write_html(path, _page(title, body))


# -- main --------------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="colocated (with and without chunked prefill) vs 1P1D, by goodput")
    ap.add_argument("--setups", default="A,B,C", help="any of A (colocated, no chunking), B (colocated, chunked, "
                                                      "each --budgets), C (1P1D)")
    ap.add_argument("--mix", default="chat:0.8:128:64,rag:0.2:1024:16",
                    help="bench --mix: NAME:FRACTION:INPUT_LEN:OUTPUT_LEN,...; the first class is the short one")
    ap.add_argument("--rates", default="0.5,1,2,3", help="request rates swept (req/s, Poisson)")
    ap.add_argument("--num-prompts", type=int, default=40, help="requests per rate point")
    ap.add_argument("--warmup", type=int, default=2, help="warmup requests before each setup's first point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="64,128,256,512", help="B: --max-num-batched-tokens values")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--baseline-prompts", type=int, default=6,
                    help="requests sent one at a time on the first setup before its sweep (0: none)")
    ap.add_argument("--model", default=None, help="a .gguf file or model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="keep the servers' prefix cache on (off by default: each sweep point repeats the prompts "
                         "of the one before, which would then cost no prefill)")
    ap.add_argument("--kv-cache-memory", default=None, help="each server's KV pool, e.g. 1GiB (default: the "
                                                            "server's own default)")
    ap.add_argument("--connector", default="shm", choices=sorted(CONNECTORS))
    ap.add_argument("--lease-timeout-s", type=float, default=60.0, help="C: how long the producer keeps unpulled KV")
    ap.add_argument("--out", default=os.path.join("out", "disaggregated"), help="output folder (created)")
    a = ap.parse_args(argv)
    a.setup_list = [x.strip().upper() for x in a.setups.split(",") if x.strip()]
    if not a.setup_list or set(a.setup_list) - {"A", "B", "C"}:
        ap.error(f"--setups {a.setups!r}: expected a list of A, B, C")
    a.rate_list = sorted({float(x) for x in a.rates.split(",") if x.strip()})
    if not a.rate_list or any(not (r > 0 and math.isfinite(r)) for r in a.rate_list):
        ap.error(f"--rates {a.rates!r}: expected finite rates > 0")
    a.budget_list = [int(x) for x in a.budgets.split(",") if x.strip()]
    if "B" in a.setup_list and (not a.budget_list or min(a.budget_list) < 1):
        ap.error(f"--budgets {a.budgets!r}: expected token budgets >= 1")
    if a.num_prompts < 1:
        ap.error("--num-prompts must be at least 1")
    if a.model:
        a.model = os.path.abspath(os.path.expanduser(a.model))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        classes = mix_classes(a.mix)
    except Exception as e:
        print(f"disaggregated.py: bad --mix: {e}", file=sys.stderr)
        return 2
    short = classes[0][0]
    others = [c for c in classes[1:]]
    long = max(others, key=lambda c: c[1])[0] if others else None
    longest = max(n for _, n in classes)
    # A: any prompt (+1 for a BOS the server may add) in one step beside a full batch of decodes
    no_chunk_budget = longest + 1 + a.max_num_seqs
    os.makedirs(a.out, exist_ok=True)
    if len(cores()) < 2:
        print("WARNING: fewer than 2 cores are available to this process: the setups are not what they say",
              file=sys.stderr)
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so every server is stopped
    signal.signal(signal.SIGTERM, _interrupt)

    plan: list[tuple[str, str, int | None]] = []  # (name, kind, budget)
    for k in a.setup_list:
        if k == "A":
            plan.append((f"A colocated b={no_chunk_budget}", "A", no_chunk_budget))
        elif k == "B":
            plan += [(f"B chunked b={b}", "B", b) for b in a.budget_list]
        else:
            plan.append((f"C 1P1D {a.connector}", "C", None))
    send_s = sum(a.num_prompts / r for r in a.rate_list)
    print(f"[plan] {len(plan)} setups x {len(a.rate_list)} rates x {a.num_prompts} requests: at least "
          f"{len(plan) * send_s / 60:.1f} min of arrivals, plus server starts and each point's tail",
          file=sys.stderr, flush=True)

    t_start = time.monotonic()
    results, kv, base, paths = [], None, None, {}
    for name, kind, budget in plan:
        tag = {"A": "A", "B": f"B{budget}", "C": "C"}[kind]
        t0 = time.monotonic()
        ctx = one_p_one_d(a, no_chunk_budget) if kind == "C" else colocated(a, budget, tag)
        with ctx as (url, urls, cmds):
            if base is None and a.baseline_prompts > 0:
                base = baseline(url, a, name)
            doc = sweep(url, a, tag)
            if kind == "C":
                kv = kv_report(a, urls)
                print_kv(kv, sys.stderr)
                paths[f"{name} prefill worker"] = served_paths(urls["producer"])
                paths[f"{name} decode worker"] = served_paths(urls["consumer"])
            else:
                paths[name] = served_paths(urls["server"])
        results.append({"name": name, "kind": kind, "budget": budget, "commands": cmds,
                        "goodput_rate": doc.get("goodput_rate"), "points": points_of(doc),
                        "sweep_json": os.path.join(a.out, f"sweep-{tag}.json"), "seconds": time.monotonic() - t0})
        g = doc.get("goodput_rate")
        print(f"[setup] {name}: goodput {'none' if g is None else f'{g:g} req/s'} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    bs = [s for s in results if s["kind"] == "B"]
    best_b = None
    if bs:
        def score(s):
            att = [p["slo_attainment"] or 0 for p in s["points"]]
            return (s["goodput_rate"] or 0, sum(att) / len(att) if att else 0)
        best_b = max(bs, key=score)["name"]

    check_rows(paths)
    cs = cores()
    header = (f"{cpu_features()}\n"
              f"model {a.model or 'default (SmolLM2-135M-Instruct Q4_1)'}, --quantization {a.quantization}, "
              f"--dtype {a.dtype}; --mix {a.mix}; {a.num_prompts} requests per rate (Poisson), seed {a.seed}; "
              f"SLOs TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms (attainment: both met); prefix caching "
              f"{'on' if a.prefix_caching else 'off'}\n"
              f"A/B: one server, --threads {min(2, len(cs))}, cores {','.join(map(str, cs[:2]))}; "
              f"C: prefill worker on core {cs[0]}, decode worker and router on core {cs[1 % len(cs)]}, "
              f"1 thread each, {CONNECTORS[a.connector]}; bench client unpinned; latencies in ms")
    if base:
        header += "\nbaseline, one request at a time on " + base["setup"] + ": " + "; ".join(
            f"{k} TTFT {fmt(v['median_ttft_ms'], '{:.0f}')}, TPOT {fmt(v['median_tpot_ms'], '{:.1f}')}"
            for k, v in base["classes"].items())
    header += "\nrounds: 1 (one sweep a setup; each point one run)\npaths that ran:\n" + "\n".join(
        f"  {k}: {paths_line(p)}" for k, p in paths.items())
    h1, r1 = table_rows(results, short, long)
    print_table("\n" + header, h1, r1)
    h2, r2 = goodput_rows(results, best_b)
    print_table(f"\ngoodput (DistServe: highest swept rate with SLO attainment >= {100 * SLO_TARGET:.0f} %)"
                + (f"; best B budget: {best_b}" if best_b else ""), h2, r2)
    kv_text = None
    if kv is not None:
        kv_text = print_kv(kv)
    elapsed = time.monotonic() - t_start
    print(f"\ntotal {elapsed / 60:.1f} min", flush=True)

    doc = {"cpu": cpu_features(), "args": {k: v for k, v in vars(a).items()}, "short_class": short,
           "long_class": long, "no_chunk_budget": no_chunk_budget, "slo_ttft_ms": a.slo_ttft_ms,
           "slo_tpot_ms": a.slo_tpot_ms, "slo_target": SLO_TARGET, "baseline": base, "setups": results,
           "best_b": best_b, "kv_transfer": kv, "seconds": elapsed, "setup": header.splitlines(), "paths": paths,
           "rows": [{"label": f"{s['name']}, rate {p['rate']} req/s, {a.num_prompts} requests", **p}
                    for s in results for p in s["points"]]}
    jpath, hpath = os.path.join(a.out, "disaggregated.json"), os.path.join(a.out, "disaggregated.html")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=2)
    write_page(hpath, doc, "inferd: colocated vs chunked prefill vs 1P1D, by goodput", header,
               [("Per setup and rate", h1, r1), ("Goodput", h2, r2)], kv_text)
    print(f"wrote {jpath} and {hpath}", flush=True)
    return 1 if kv is not None and kv["problems"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as e:  # the servers' context managers have stopped them on the way out
        print(f"disaggregated.py: interrupted ({e or 'Ctrl-C'}): every server started here is stopped",
              file=sys.stderr)
        sys.exit(130)

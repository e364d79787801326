"""Trace -> metrics: pure functions, no I/O, no clock.

A trace is a header, one record per request and a footer (see `inferd.bench.trace`). Every time in
a request record is an integer number of nanoseconds since the run's start (`t0`, the moment the
arrival schedule counts from); metrics are reported in milliseconds.

A request record's `events` is a list of `[t_ns, kind, tokens, chars]`:
    kind    "role" (a role-only or empty first chunk), "content" (a chunk that carries output
            tokens), "empty" (a chunk with no text and no new tokens, e.g. finish_reason only),
            "usage" (a usage-only chunk with no choices), "error" (an error event in the stream),
            "done" (`data: [DONE]`)
    tokens  the chunk's number of new output tokens when the server said so (continuous usage
            stats), else None
    chars   characters of text the chunk carried

Definitions (vLLM's):
    TTFT  = first content event - send                (role-only and empty chunks do not count)
    E2EL  = last content event - send                 (no content: end of response - send)
    TPOT  = (E2EL - TTFT) / (output_tokens - 1)       (requests with more than one output token)
    ITL   per chunk: the gaps between consecutive content events (what vLLM reports);
          per token: a chunk of k tokens arriving g after the previous one contributes k gaps of g/k,
          and the first chunk's extra tokens contribute gaps of 0 -- so a request's per-token ITLs
          number output_tokens - 1 and average to its TPOT. Both sum to E2EL - TTFT.

SLO attainment (DistServe's): the fraction of the sent requests that meet every --goodput SLO
(DistServe sets a TTFT and a TPOT one); failed requests miss. Given per request class too, when the
records carry one (`"class"`, from --dataset mixed).
"""
from __future__ import annotations

import math
from typing import Iterable

NS_PER_MS = 1_000_000
# metric name -> what it measures; each gets mean/median/std/pNN fields "<stat>_<name>_ms"
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
EXTRA_METRICS = ("itl_per_token", "ttft_from_schedule", "e2el_from_schedule", "send_lag", "slot_wait")


# -- statistics ---------------------------------------------------------------------------------
def mean(xs: list[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def std(xs: list[float]) -> float | None:
    """Population standard deviation (numpy's default, as vLLM reports)."""
    if not xs:
        return None
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


def percentile(xs: list[float], p: float, *, presorted: bool = False) -> float | None:
    """Linear interpolation between closest ranks (numpy's default `linear` method)."""
    if not xs:
        return None
    s = xs if presorted else sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def pct_name(p: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9' (vLLM's field names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(name: str, xs: list[float], percentiles: Iterable[float]) -> dict:
    s = sorted(xs)
    out = {f"mean_{name}_ms": mean(s), f"median_{name}_ms": percentile(s, 50, presorted=True),
           f"std_{name}_ms": std(s)}
    for p in percentiles:
        out[f"{pct_name(p)}_{name}_ms"] = percentile(s, p, presorted=True)
    return out


# -- one request ---------------------------------------------------------------------------------
def content_events(rec: dict) -> list[list]:
    return [e for e in rec.get("events", ()) if e[1] == "content"]


def per_chunk_tokens_known(rec: dict) -> bool:
    c = content_events(rec)
    return bool(c) and all(e[2] is not None for e in c)


def request_metrics(rec: dict) -> dict:
    """Latencies of one request (ms), or only its failure when it failed."""
    if not rec.get("ok"):
        return {"ok": False}
    send = rec["send_ns"]
    content = content_events(rec)
    n_out = rec.get("output_tokens") or 0
    m: dict = {"ok": True, "output_tokens": n_out}
    if content:
        first, last = content[0][0], content[-1][0]
        m["ttft"] = (first - send) / NS_PER_MS
        m["ttft_from_schedule"] = (first - rec["sched_ns"]) / NS_PER_MS
    else:
        first = last = None
        m["ttft"] = m["ttft_from_schedule"] = None
    last_ns = last if last is not None else rec["end_ns"]
    m["e2el"] = (last_ns - send) / NS_PER_MS
    m["e2el_from_schedule"] = (last_ns - rec["sched_ns"]) / NS_PER_MS
    m["decode_ns"] = (last - first) if content else 0
    m["tpot"] = m["decode_ns"] / NS_PER_MS / (n_out - 1) if content and n_out > 1 else None
    m["itl"] = [(b[0] - a[0]) / NS_PER_MS for a, b in zip(content, content[1:])]
    if per_chunk_tokens_known(rec):
        itl_tok = [0.0] * (content[0][2] - 1)
        for a, b in zip(content, content[1:]):
            k = b[2]
            itl_tok.extend([(b[0] - a[0]) / NS_PER_MS / k] * k)
        m["itl_per_token"] = itl_tok
    else:
        m["itl_per_token"] = None
    m["send_lag"] = (rec["dispatch_ns"] - rec["sched_ns"]) / NS_PER_MS
    m["slot_wait"] = (rec["slot_ns"] - rec["dispatch_ns"]) / NS_PER_MS
    return m


def meets_slos(m: dict, slos: dict[str, float]) -> bool:
    """Goodput test of one request: every SLO (ms) met. Failed requests miss; a request without a
    first token misses a TTFT SLO; a request with a single output token has no TPOT and meets it."""
    if not m.get("ok"):
        return False
    for key, limit in slos.items():
        v = m.get(key)
        if v is None:
            if key == "tpot":
                continue
            return False
        if v > limit:
            return False
    return True


def slo_attainment(per: list[dict], slos: dict[str, float]) -> float | None:
    """Fraction of requests (their request_metrics, failed ones included) meeting every SLO."""
    if not slos or not per:
        return None
    return sum(meets_slos(m, slos) for m in per) / len(per)


def latency_summaries(ok: list[dict], percentiles: Iterable[float]) -> dict:
    """TTFT, TPOT, ITL (per chunk) and E2EL summaries over successful requests' request_metrics."""
    out: dict = {}
    for name in LATENCY_METRICS:
        if name == "itl":
            vals = [x for m in ok for x in m["itl"]]
        else:
            vals = [m[name] for m in ok if m.get(name) is not None]
        out.update(summarize(name, vals, percentiles))
    return out


def class_results(recs: list[dict], per: list[dict], percentiles: Iterable[float],
                  slos: dict[str, float]) -> dict[str, dict]:
    """Per request class (records' "class"; records without one are left out), sorted by name."""
    groups: dict[str, list[dict]] = {}
    for r, m in zip(recs, per):
        if r.get("class") is not None:
            groups.setdefault(str(r["class"]), []).append(m)
    out = {}
    for name in sorted(groups):
        ms = groups[name]
        ok = [m for m in ms if m["ok"]]
        out[name] = {"num_prompts": len(ms), "completed": len(ok), "failed": len(ms) - len(ok),
                     **latency_summaries(ok, percentiles), "slo_attainment": slo_attainment(ms, slos)}
    return out


def peak_concurrency(intervals: Iterable[tuple[int, int]]) -> int:
    """Most requests in flight at once; an interval is [start, end) so back-to-back ones do not overlap."""
    edges = []
    for a, b in intervals:
        edges.append((a, 1))
        edges.append((b, -1))
    edges.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak


def exp_ks_statistic(gaps: list[float], rate: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps' empirical CDF and Exp(rate)."""
    s = sorted(gaps)
    n = len(s)
    d = 0.0
    for i, x in enumerate(s):
        f = 1.0 - math.exp(-rate * x)
        d = max(d, (i + 1) / n - f, f - i / n)
    return d


# -- a whole run ---------------------------------------------------------------------------------
def metric_field_names(percentiles: Iterable[float]) -> list[str]:
    """Every `<stat>_<metric>_ms` field a result carries (for validating --sla before a run)."""
    names = []
    for m in LATENCY_METRICS + EXTRA_METRICS:
        names.extend(summarize(m, [], percentiles))
    return names


def compute_result(header: dict, records: list[dict], footer: dict) -> dict:
    """The benchmark result (vLLM `bench serve` field names where the metric is the same)."""
    cfg = header.get("config", {})
    percentiles = cfg.get("percentiles", [50, 90, 95, 99])
    slos = cfg.get("goodput") or {}
    recs = [r for r in records if not r.get("warmup")]
    per = [request_metrics(r) for r in recs]
    ok = [(r, m) for r, m in zip(recs, per) if m["ok"]]
    failed = [r for r in recs if not r.get("ok")]

    duration_ns = max((r["end_ns"] for r in recs), default=0)
    duration = duration_ns / 1e9
    total_in = sum(r.get("prompt_len") or 0 for r, _ in ok)
    total_out = sum(m["output_tokens"] for _, m in ok)
    server_in = [r.get("prompt_tokens") for r, _ in ok]

    def rate(x):
        return x / duration if duration > 0 else None

    res: dict = {
        "date": header.get("date"),
        "base_url": cfg.get("base_url"),
        "endpoint": cfg.get("endpoint"),
        "endpoint_type": cfg.get("endpoint_type"),
        "model_id": cfg.get("model"),
        "tokenizer_id": cfg.get("tokenizer"),
        "dataset": cfg.get("dataset"),
        "num_prompts": len(recs),
        "request_rate": cfg.get("request_rate"),
        "burstiness": cfg.get("burstiness"),
        "max_concurrency": cfg.get("max_concurrency"),
        "seed": cfg.get("seed"),
        "percentiles": percentiles,
        "goodput_slos_ms": slos or None,
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_input_tokens_server": sum(server_in) if ok and all(x is not None for x in server_in) else None,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "request_goodput": rate(sum(meets_slos(m, slos) for m in per)) if slos else None,
        "slo_attainment": slo_attainment(per, slos),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "max_concurrent_requests": peak_concurrency((r["send_ns"], r["end_ns"]) for r in recs),
    }
    sends = sorted(r["send_ns"] for r in recs)
    res["achieved_send_rate"] = ((len(sends) - 1) / ((sends[-1] - sends[0]) / 1e9)
                                 if len(sends) > 1 and sends[-1] > sends[0] else None)
    reasons: dict[str, int] = {}
    for r in failed:
        key = r.get("error_kind") or "error"
        if r.get("http_status"):
            key = f"http {r['http_status']}"
        reasons[key] = reasons.get(key, 0) + 1
    res["failure_reasons"] = dict(sorted(reasons.items()))
    res["errors"] = [f"request {r['index']}: {r.get('error')}" for r in failed][:20]
    sources: dict[str, int] = {}
    for r, _ in ok:
        s = r.get("output_tokens_source") or "unknown"
        sources[s] = sources.get(s, 0) + 1
    res["output_tokens_source"] = dict(sorted(sources.items()))
    res["output_len_mismatch"] = sum(1 for r, m in ok if r.get("output_len") is not None
                                     and m["output_tokens"] != r["output_len"])
    per_tok = bool(ok) and all(m["itl_per_token"] is not None for _, m in ok if m["output_tokens"] > 1)
    res["itl_definition"] = "per chunk (gaps between content chunks, as vLLM)"
    res["itl_per_token_available"] = per_tok

    def col(key):
        return [m[key] for _, m in ok if m.get(key) is not None]

    res.update(latency_summaries([m for _, m in ok], percentiles))
    res.update(summarize("itl_per_token", [x for _, m in ok for x in (m["itl_per_token"] or ())]
                         if per_tok else [], percentiles))
    res.update(summarize("ttft_from_schedule", col("ttft_from_schedule"), percentiles))
    res.update(summarize("e2el_from_schedule", col("e2el_from_schedule"), percentiles))
    res.update(summarize("send_lag", [m["send_lag"] for m in per if "send_lag" in m]
                         + [(r["dispatch_ns"] - r["sched_ns"]) / NS_PER_MS for r in failed], percentiles))
    res.update(summarize("slot_wait", [m["slot_wait"] for m in per if "slot_wait" in m]
                         + [(r["slot_ns"] - r["dispatch_ns"]) / NS_PER_MS for r in failed], percentiles))

    classes = class_results(recs, per, percentiles, slos)
    if classes:
        res["classes"] = classes
    lag = [x / NS_PER_MS for x in footer.get("loop_lag_ns", ())]
    res["client_loop_lag_p50_ms"] = percentile(lag, 50)
    res["client_loop_lag_p99_ms"] = percentile(lag, 99)
    res["client_loop_lag_max_ms"] = max(lag) if lag else None
    res["rx_timestamps"] = header.get("rx_timestamps")
    rx = [r["rx_delay_max_ns"] / NS_PER_MS for r in recs if r.get("rx_delay_max_ns") is not None]
    kernel = header.get("rx_timestamps") == "kernel"
    res["client_rx_delay_p99_ms"] = percentile(rx, 99) if kernel else None
    res["client_rx_delay_max_ms"] = max(rx) if kernel and rx else None
    wall = footer.get("wall_ns") or 0
    res["client_cpu_util"] = footer.get("cpu_ns", 0) / wall if wall else None
    res["warnings"] = list(header.get("warnings", ())) + run_warnings(res)
    sm = footer.get("server_metrics")
    if sm is not None:  # /metrics scraped around the run: the server's view of the same window
        from inferd.bench.crosscheck import crosscheck

        res["crosscheck"] = crosscheck(res, sm.get("before"), sm.get("after"))
    return res


def run_warnings(res: dict) -> list[str]:
    w = []
    lag99, cpu = res.get("client_loop_lag_p99_ms"), res.get("client_cpu_util")
    if cpu is not None and cpu > 0.8:
        w.append(f"the client may be the bottleneck: it used {100 * cpu:.0f}% of a core (event-loop lag p99 "
                 f"{lag99 or 0:.1f} ms); latencies include client delay")
    elif lag99 is not None and lag99 > 5.0:
        which = ("send times (receive times are the kernel's)" if res.get("rx_timestamps") == "kernel"
                 else "timestamps")
        w.append(f"the client's event loop ran late (p99 {lag99:.1f} ms) while using {100 * (cpu or 0):.0f}% of a "
                 f"core: the machine is busy; {which} may be late by about that much")
    lag = res.get("p99_send_lag_ms")
    if lag is not None and lag > 10.0:
        w.append(f"sends lagged the schedule (p99 {lag:.1f} ms): the requested rate was not met exactly")
    src = res.get("output_tokens_source", {})
    if src.get("tokenizer"):
        w.append(f"{src['tokenizer']} requests had no usage from the server: output tokens counted with the "
                 f"local tokenizer")
    if src.get("chunks"):
        w.append(f"{src['chunks']} requests had no usage and no tokenizer: output tokens counted as content "
                 f"chunks (unreliable)")
    if res.get("output_len_mismatch"):
        w.append(f"{res['output_len_mismatch']} requests returned a different number of tokens than asked "
                 f"(does the server honour ignore_eos?)")
    return w

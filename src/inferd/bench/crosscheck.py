"""Client-vs-server cross-check: the server's own latency histograms over the run's window.

`/metrics` is scraped (Prometheus text format) just before the timed run and just after it; a
histogram's mean over the window is Δ_sum / Δ_count, so requests served before the run (warm-up,
other benchmarks) do not count. Both inferd's `inferd:*` and vLLM's `vllm:*` names are understood.
Another client using the same server during the run would be counted too: the check assumes the
bench is the server's only client.
"""
from __future__ import annotations

import math
import re
import time

PREFIXES = ("inferd:", "vllm:")
# (key, server histogram names in the order tried, client result field or None, label)
METRICS = (
    ("ttft", ("time_to_first_token_seconds",), "mean_ttft_ms", "TTFT"),
    ("e2el", ("e2e_request_latency_seconds",), "mean_e2el_ms", "E2EL"),
    ("queue", ("request_queue_time_seconds",), None, "queue time"),
    ("itl", ("inter_token_latency_seconds", "time_per_output_token_seconds"), "mean_itl_per_token_ms", "ITL"),
)
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_exposition(text: str) -> dict[str, float]:
    """`<name>_sum` and `<name>_count` of every histogram, summed over label sets (one server may
    label by model, engine or finished reason). A histogram that is declared but has no series yet (a
    labelled one before its first observation, as on a server that has served nothing) counts as 0,
    so that a run against a fresh server still has a window."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) == 4 and parts[3] == "histogram":
                out.setdefault(parts[2] + "_sum", 0.0)
                out.setdefault(parts[2] + "_count", 0.0)
            continue
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(1)
        if not (name.endswith("_sum") or name.endswith("_count")):
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(v):
            out[name] = out.get(name, 0.0) + v
    return out


def scrape(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, float] | None:
    """The server's histogram sums/counts, or None when it has no usable /metrics."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    names = {p + n + suf for p in PREFIXES for _, ns, _, _ in METRICS for n in ns for suf in ("_sum", "_count")}
    vals = {k: v for k, v in parse_exposition(r.text).items() if k in names}  # what the trace keeps
    return vals or None


def _hist(vals: dict[str, float], names) -> tuple[str, float, float] | None:
    for prefix in PREFIXES:
        for n in names:
            s, c = vals.get(f"{prefix}{n}_sum"), vals.get(f"{prefix}{n}_count")
            if s is not None and c is not None:
                return prefix + n, s, c
    return None


def window_means(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """{key: {"metric", "count", "mean_ms"}} for each histogram that moved during the window."""
    out = {}
    for key, names, _, _ in METRICS:
        a, b = _hist(before, names), _hist(after, names)
        if a is None or b is None:
            continue
        dc = b[2] - a[2]
        if dc > 0:
            out[key] = {"metric": b[0], "count": int(round(dc)), "mean_ms": 1000.0 * (b[1] - a[1]) / dc}
    return out


def settled_after(base_url: str, api_key: str | None, before: dict[str, float], expect: int,
                  wait_s: float = 3.0) -> dict[str, float] | None:
    """Scrape after the run; the server may record a request's histograms a moment after its last
    chunk left, so wait (briefly) until its E2E count covers the requests the client saw finish."""
    deadline = time.monotonic() + wait_s
    while True:
        after = scrape(base_url, api_key)
        if after is None:
            return None
        e2e = window_means(before, after).get("e2el")
        if (e2e and e2e["count"] >= expect) or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def crosscheck(result: dict, before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The cross-check block of a result: client mean, server mean, gap (client - server) in % of the
    server's, per metric."""
    if before is None or after is None:
        return {"available": False, "reason": "the endpoint exposes no inferd:/vllm: histograms at /metrics"}
    means = window_means(before, after)
    rows = {}
    for key, _, field, label in METRICS:
        s = means.get(key)
        if s is None:
            continue
        c = result.get(field) if field else None
        gap = (100.0 * (c - s["mean_ms"]) / s["mean_ms"]) if c is not None and s["mean_ms"] > 0 else None
        rows[key] = {"label": label, "server_metric": s["metric"], "server_count": s["count"],
                     "server_mean_ms": s["mean_ms"], "client_mean_ms": c, "gap_pct": gap}
    if not rows:
        return {"available": False, "reason": "no server request histograms moved during the run"}
    return {"available": True, "client_completed": result.get("completed"), "metrics": rows}


def format_crosscheck(cc: dict | None) -> str:
    if not cc:
        return ""
    if not cc.get("available"):
        return f"Server metrics cross-check: not available ({cc.get('reason')})"
    w = 56
    lines = [" Client vs server (/metrics over the run) ".center(w, "-"),
             f"{'':<14}{'client ms':>11}{'server ms':>11}{'gap %':>9}{'n srv':>11}"]
    for row in cc["metrics"].values():
        c, s, g = row["client_mean_ms"], row["server_mean_ms"], row["gap_pct"]
        lines.append(f"{'Mean ' + row['label']:<14}{'-' if c is None else f'{c:.2f}':>11}{s:>11.2f}"
                     f"{'-' if g is None else f'{g:+.1f}':>9}{row['server_count']:>11}")
    n = cc.get("client_completed")
    counts = {r["server_count"] for k, r in cc["metrics"].items() if k in ("ttft", "e2el")}
    if n is not None and counts and counts != {n}:
        lines.append(f"note: the server saw {'/'.join(map(str, sorted(counts)))} requests, the client {n} "
                     f"(another client, or warm-up/failed requests?)")
    return "\n".join(lines)


def sweep_lines(points: list[dict]) -> list[str]:
    """One line per sweep point: client and server mean TTFT and E2EL with their gaps."""
    ccs = [(p["label"], p["result"].get("crosscheck")) for p in points]
    if all(not c for _, c in ccs):
        return []
    if not any(c and c.get("available") for _, c in ccs):
        reason = next((c.get("reason") for _, c in ccs if c), "")
        return [f"Server metrics cross-check: not available ({reason})"]
    out = ["Client vs server mean (ms), gap %:"]
    for label, c in ccs:
        if not c or not c.get("available"):
            out.append(f"  {label}: not available")
            continue
        parts = []
        for key in ("ttft", "e2el"):
            row = c["metrics"].get(key)
            if row and row["client_mean_ms"] is not None:
                g = row["gap_pct"]
                parts.append(f"{row['label']} {row['client_mean_ms']:.1f} vs {row['server_mean_ms']:.1f}"
                             + ("" if g is None else f" ({g:+.1f} %)"))
        out.append(f"  {label}: " + ", ".join(parts))
    return out

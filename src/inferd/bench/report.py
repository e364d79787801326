"""Trace files, the console table, JSON and CSV output, goodput and SLA parsing."""
from __future__ import annotations

import csv
import json
import math
import operator
import re

from inferd.bench.metrics import compute_result, metric_field_names, pct_name, request_metrics
from inferd.bench.runner import TRACE_FORMAT
from inferd.errors import InferdError


# -- trace --------------------------------------------------------------------------------------
def trace_lines(trace: list[dict]) -> list[str]:
    return [json.dumps(r, ensure_ascii=False, allow_nan=False) for r in trace]


def write_trace(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")


def read_trace(path: str) -> tuple[dict, list[dict], dict]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except FileNotFoundError:
        raise InferdError(f"trace not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InferdError(f"cannot read trace {path}: {e}") from None
    try:
        recs = [json.loads(line) for line in lines]
    except ValueError as e:
        raise InferdError(f"{path} is not a bench trace (bad JSON line: {e})") from None
    return split_trace(recs, path)


def split_trace(recs: list[dict], where: str = "trace") -> tuple[dict, list[dict], dict]:
    if not recs or not isinstance(recs[0], dict) or recs[0].get("format") != TRACE_FORMAT:
        raise InferdError(f"{where} is not an inferd bench trace (no header line)")
    header = recs[0]
    footer = recs[-1] if recs[-1].get("type") == "footer" else {}
    requests = [r for r in recs if r.get("type") == "request"]
    return header, requests, footer


def result_from_lines(lines: list[str]) -> dict:
    """The result exactly as `inferd bench report` would compute it from the written trace."""
    header, reqs, footer = split_trace([json.loads(x) for x in lines])
    return compute_result(header, reqs, footer)


# -- parsing of --goodput, --sla, --percentiles ---------------------------------------------------
def parse_percentiles(s: str) -> list[float]:
    try:
        ps = [float(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise InferdError(f"bad --percentiles {s!r}: expected numbers such as 50,90,95,99") from None
    if not ps or not all(0 < p <= 100 for p in ps):
        raise InferdError(f"bad --percentiles {s!r}: each must be in (0, 100]")
    return [int(p) if p.is_integer() else p for p in ps]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            k, sep, v = part.partition(":")
            try:
                val = float(v)
            except ValueError:
                val = -1.0
            if not sep or k not in ("ttft", "tpot", "e2el") or not val > 0 or math.isinf(val):
                raise InferdError(f"bad --goodput {part!r}: expected ttft:MS, tpot:MS or e2el:MS (MS > 0)")
            slos[k] = val
    return slos


_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_SLA_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def parse_sla(s: str | None, percentiles: list[float]) -> list[tuple[str, str, float]]:
    if not s:
        return []
    known = set(metric_field_names(percentiles)) | {
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "failed",
        "completed", "duration", "max_concurrent_requests", "client_loop_lag_p99_ms", "achieved_send_rate",
        "total_output_tokens", "total_input_tokens", "slo_attainment"}
    out = []
    for part in s.split(","):
        if not part.strip():
            continue
        m = _SLA_RE.match(part)
        if not m:
            raise InferdError(f"bad --sla clause {part.strip()!r}: expected FIELD<NUMBER, e.g. p99_ttft_ms<500")
        key, op, val = m.group(1), m.group(2), float(m.group(3))
        if key not in known:
            raise InferdError(f"bad --sla field {key!r}: not a result field (e.g. p99_ttft_ms, mean_tpot_ms, "
                              f"failed, request_throughput; percentiles come from --percentiles)")
        out.append((key, op, val))
    if not out:
        raise InferdError(f"bad --sla {s!r}: no clauses")
    return out


def check_sla(result: dict, clauses) -> list[str]:
    bad = []
    for key, op, limit in clauses:
        v = result.get(key)
        if v is None:
            bad.append(f"{key} has no value (no successful requests?), wanted {key}{op}{limit:g}")
        elif not _OPS[op](v, limit):
            bad.append(f"{key} = {v:.4g}, wanted {key}{op}{limit:g}")
    return bad


# -- output ---------------------------------------------------------------------------------------
def _f(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def console_table(res: dict) -> str:
    w = 56
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(label, v, nd=2):
        lines.append(f"{label:<{w - 14}}{_f(v, nd):>14}")

    def sect(title):
        lines.append(f" {title} ".center(w, "-"))

    row("Endpoint:", f"{res.get('endpoint')}")
    row("Request rate (req/s):", res.get("request_rate"))
    row("Max concurrency:", res.get("max_concurrency"))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    for reason, n in res.get("failure_reasons", {}).items():
        row(f"  {reason}:", n)
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    if res.get("request_goodput") is not None:
        row("Request goodput (req/s):", res["request_goodput"])
    if res.get("slo_attainment") is not None:
        row("SLO attainment (%):", 100 * res["slo_attainment"], 1)
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    row("Peak concurrent requests:", res["max_concurrent_requests"])
    pcts = res.get("percentiles") or []

    top = pct_name(pcts[-1]) if pcts else None
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency (per chunk gap)"), ("e2el", "End-to-end Latency")):
        if res.get(f"mean_{name}_ms") is None:
            continue
        sect(title)
        short = name.upper()
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", res[f"median_{name}_ms"])
        row(f"Std {short} (ms):", res[f"std_{name}_ms"])
        for p in pcts:
            if p != 50:
                row(f"P{pct_name(p)[1:]} {short} (ms):", res[f"{pct_name(p)}_{name}_ms"])
        if name == "itl" and res.get("itl_per_token_available") and top:
            row("Mean ITL per token (ms):", res["mean_itl_per_token_ms"])
            row(f"P{top[1:]} ITL per token (ms):", res[f"{top}_itl_per_token_ms"])
    if res.get("classes"):
        lines.extend(class_lines(res["classes"], pcts, w))
    sect("Schedule and client")
    for name, label in (("ttft_from_schedule", "TTFT from scheduled send"), ("send_lag", "send lag behind schedule"),
                        ("slot_wait", "wait for a concurrency slot")):
        if res.get(f"mean_{name}_ms") is not None and top:
            row(f"Mean {label} (ms):", res[f"mean_{name}_ms"])
            row(f"P{top[1:]} {label} (ms):", res[f"{top}_{name}_ms"])
    row("Client event-loop lag P99 (ms):", res.get("client_loop_lag_p99_ms"))
    if res.get("client_rx_delay_max_ms") is not None:
        row("Client read delay after arrival, max (ms):", res["client_rx_delay_max_ms"])
    row("Client CPU (% of one core):", None if res.get("client_cpu_util") is None else 100 * res["client_cpu_util"], 1)
    lines.append("=" * w)
    for warn in res.get("warnings", []):
        lines.append(f"warning: {warn}")
    return "\n".join(lines)


def class_lines(classes: dict[str, dict], pcts: list[float], w: int = 56) -> list[str]:
    """The console's per-class section: p50 and p99 (or the highest percentile asked for) of TTFT,
    TPOT and ITL, one row each per class -- enough to see which class pays for the other."""
    hi = 99 if 99 in pcts else (pcts[-1] if pcts else 99)
    hi_name = pct_name(hi)
    lines = [f" Per request class (p50 / {hi_name}, ms) ".center(w, "-")]
    for name, c in classes.items():
        head = f"{name}: {c['completed']} ok, {c['failed']} failed"
        if c.get("slo_attainment") is not None:
            head += f", SLO attainment {100 * c['slo_attainment']:.1f}%"
        lines.append(head)
        for metric in ("ttft", "tpot", "itl"):
            v = f"{_f(c.get(f'median_{metric}_ms'))} / {_f(c.get(f'{hi_name}_{metric}_ms'))}"
            lines.append(f"  {metric.upper() + ':':<{w - 24}}{v:>22}")
    return lines


def write_json(path: str, res: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2, allow_nan=False)
        f.write("\n")


CSV_FIELDS = ["index", "ok", "error_kind", "http_status", "prompt_len", "output_len", "output_tokens",
              "output_tokens_source", "sched_ms", "send_ms", "ttft_ms", "tpot_ms", "e2el_ms", "ttft_from_schedule_ms",
              "e2el_from_schedule_ms", "send_lag_ms", "slot_wait_ms", "chunks", "mean_itl_ms", "max_itl_ms", "error", "class"]


def write_csv(path: str, requests: list[dict]) -> None:
    """One row per measured request."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in requests:
            if r.get("warmup"):
                continue
            m = request_metrics(r)
            itl = m.get("itl") or []
            w.writerow([r["index"], int(bool(r.get("ok"))), r.get("error_kind") or "", r.get("http_status") or "",
                        _c(r.get("prompt_len")), _c(r.get("output_len")), _c(r.get("output_tokens")),
                        r.get("output_tokens_source") or "", _c(r["sched_ns"] / 1e6), _c(r["send_ns"] / 1e6),
                        _c(m.get("ttft")), _c(m.get("tpot")), _c(m.get("e2el")), _c(m.get("ttft_from_schedule")),
                        _c(m.get("e2el_from_schedule")), _c((r["dispatch_ns"] - r["sched_ns"]) / 1e6),
                        _c((r["slot_ns"] - r["dispatch_ns"]) / 1e6),
                        sum(1 for e in r.get("events", ()) if e[1] == "content"),
                        _c(sum(itl) / len(itl) if itl else None), _c(max(itl) if itl else None), r.get("error") or "",
                        r.get("class") or ""])


def _c(v):
    if v is None:
        return ""
    return f"{v:.6f}" if isinstance(v, float) else v

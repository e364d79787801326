"""`inferd bench compare A.json B.json ...`: results side by side, with deltas and ratios vs the first.

A sweep JSON takes part through its capacity point (the highest load that met its SLA), or its
highest-load point when none met it, so two sweeps compare as "what each endpoint can take".
"""
from __future__ import annotations

import json
import os

from inferd.bench.sweep import SWEEP_FORMAT
from inferd.errors import InferdError

ROWS = (("completed", "Successful requests", 0), ("failed", "Failed requests", 0),
        ("duration", "Duration (s)", 2), ("request_throughput", "Request throughput (req/s)", 2),
        ("request_goodput", "Request goodput (req/s)", 2), ("output_throughput", "Output tok/s", 1),
        ("total_token_throughput", "Total tok/s", 1), ("max_concurrent_requests", "Peak concurrency", 0),
        ("mean_ttft_ms", "Mean TTFT (ms)", 2), ("median_ttft_ms", "Median TTFT (ms)", 2),
        ("p99_ttft_ms", "P99 TTFT (ms)", 2), ("mean_tpot_ms", "Mean TPOT (ms)", 2),
        ("median_tpot_ms", "Median TPOT (ms)", 2), ("p99_tpot_ms", "P99 TPOT (ms)", 2),
        ("mean_itl_ms", "Mean ITL (ms)", 2), ("p99_itl_ms", "P99 ITL (ms)", 2),
        ("mean_e2el_ms", "Mean E2EL (ms)", 2), ("median_e2el_ms", "Median E2EL (ms)", 2),
        ("p99_e2el_ms", "P99 E2EL (ms)", 2))


def load_result(path: str) -> tuple[str, dict]:
    """(column name, result dict) of a run's --result-json or a sweep's JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise InferdError(f"compare: {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InferdError(f"compare: cannot read {path}: {e}") from None
    except ValueError as e:
        hint = " (a trace? compare takes --result-json files)" if path.endswith(".jsonl") else ""
        raise InferdError(f"compare: {path} is not JSON{hint}: {e}") from None
    name = os.path.basename(path)
    if isinstance(d, dict) and d.get("format") == SWEEP_FORMAT:
        pts = d.get("points") or []
        if not pts:
            raise InferdError(f"compare: sweep {path} has no points")
        cap = d.get("capacity")
        best = next((p for p in pts if cap and p["label"] == cap["label"]), None)
        tag = "capacity " if best else "no capacity, highest "
        best = best or max(pts, key=lambda p: p.get("x") or 0)
        return f"{name} ({tag}{best['label']})", best["result"]
    if not isinstance(d, dict) or "completed" not in d or "mean_ttft_ms" not in d:
        raise InferdError(f"compare: {path} is not an inferd bench result (--result-json) or sweep JSON")
    return name, d


def _f(v, nd) -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.{nd}f}" if nd else f"{v:g}" if isinstance(v, float) else str(v)
    return str(v)


def compare_table(named: list[tuple[str, dict]]) -> str:
    """Columns A, B, ... (named in a legend above, so that long file names do not widen the table),
    then B-A and B/A for each run after the first."""
    base = named[0][1]
    tags = [chr(ord("A") + i) if i < 26 else f"R{i}" for i in range(len(named))]
    w = 12
    lines = [f"{t} = {n}" for t, (n, _) in zip(tags, named)]
    head = f"{'':<28}" + "".join(f"{t:>{w}}" for t in tags)
    for t in tags[1:]:
        head += f"{t + '-' + tags[0]:>{w}}{t + '/' + tags[0]:>{w}}"
    lines += [head, "-" * len(head)]
    for key, label, nd in ROWS:
        vals = [r.get(key) for _, r in named]
        if all(v is None for v in vals):
            continue
        line = f"{label:<28}" + "".join(f"{_f(v, nd):>{w}}" for v in vals)
        b = base.get(key)
        for v in vals[1:]:
            num = isinstance(v, (int, float)) and isinstance(b, (int, float))
            delta = _f(v - b, nd) if num else "-"
            if num and not delta.startswith("-"):
                delta = "+" + delta
            ratio = f"{v / b:.3f}" if num and b else "-"
            line += f"{delta:>{w}}{ratio:>{w}}"
        lines.append(line)
    return "\n".join(lines)


def cmd_compare(paths: list[str]) -> int:
    if len(paths) < 2:
        raise InferdError("usage: inferd bench compare A.json B.json [...] (at least two results)")
    print(compare_table([load_result(p) for p in paths]))
    return 0

"""`--sweep`: the same prompts at several loads, and the capacity at an SLA.

    concurrency:1,2,4,8   closed loop, that many requests in flight
    rate:1,2,5,inf        open loop, requests/s on the --burstiness arrival process
    auto[:N]              synchronous (concurrency 1), then saturation (everything at once, no cap),
                          then N (default 4) rates evenly between the two measured throughputs

The capacity is the highest load whose run meets every --sla clause. Points are run in the order
given (auto: sync, saturation, then ascending rates) and reported sorted by load.

With --goodput, each point has its SLO attainment, and the sweep its DistServe goodput
(`goodput_rate`): the highest swept (finite) request rate whose attainment is at least 90 %.
"""
from __future__ import annotations

import math

from inferd.errors import InferdError

SWEEP_FORMAT = "inferd-bench-sweep"
AUTO_POINTS = 4
SAMPLE_FIELDS = ("ttft", "tpot", "e2el")
SLO_TARGET = 0.9  # DistServe's attainment target for its goodput


def parse_sweep(s: str) -> tuple[str, list[float]]:
    """'concurrency:1,2,4' -> ('concurrency', [1, 2, 4]); 'auto:3' -> ('auto', [3])."""
    usage = "expected concurrency:N,N,..., rate:R,R,... or auto[:POINTS]"
    kind, sep, rest = (s or "").strip().partition(":")
    kind = kind.strip().lower()
    if kind == "auto":
        if not sep:
            return "auto", [AUTO_POINTS]
        try:
            n = int(rest)
        except ValueError:
            n = -1
        if not 0 <= n <= 32:
            raise InferdError(f"bad --sweep {s!r}: auto:POINTS takes 0 to 32 points between sync and saturation")
        return "auto", [n]
    if kind not in ("concurrency", "rate") or not sep:
        raise InferdError(f"bad --sweep {s!r}: {usage}")
    items = [x.strip() for x in rest.split(",") if x.strip()]
    if not items:
        raise InferdError(f"bad --sweep {s!r}: no {kind} values given ({usage})")
    vals: list[float] = []
    for x in items:
        try:
            v = float(x)
        except ValueError:
            v = float("nan")
        if kind == "concurrency" and not (v >= 1 and math.isfinite(v) and v.is_integer()):
            raise InferdError(f"bad --sweep {s!r}: concurrency {x!r} must be an integer >= 1")
        if kind == "rate" and not v > 0:
            raise InferdError(f"bad --sweep {s!r}: rate {x!r} must be > 0 (or inf)")
        vals.append(int(v) if kind == "concurrency" else v)
    if len(set(vals)) != len(vals):
        raise InferdError(f"bad --sweep {s!r}: a value is repeated")
    return kind, vals


def point_label(kind: str, value: float) -> str:
    if kind == "concurrency":
        return f"c={int(value)}"
    return "rate=inf" if math.isinf(value) else f"rate={value:g}/s"


def auto_rates(sync_tput: float | None, max_tput: float | None, n: int) -> list[float]:
    if not sync_tput or not max_tput or max_tput <= sync_tput * 1.02 or n < 1:
        return []
    return [float(f"{sync_tput + (max_tput - sync_tput) * k / (n + 1):.3g}") for k in range(1, n + 1)]


def samples(requests: list[dict]) -> dict[str, list[float]]:
    """Per-request latencies kept in the sweep JSON, so that its page can draw distributions."""
    from inferd.bench.metrics import request_metrics

    out: dict[str, list[float]] = {k: [] for k in SAMPLE_FIELDS}
    for r in requests:
        if r.get("warmup"):
            continue
        m = request_metrics(r)
        for k in SAMPLE_FIELDS:
            if m.get(k) is not None:
                out[k].append(round(m[k], 3))
    return out


def capacity(points: list[dict]) -> dict | None:
    ok = [p for p in points if p.get("sla_ok") and p.get("x") is not None]
    if not ok:
        return None
    best = max(ok, key=lambda p: p["x"])
    r = best["result"]
    return {"label": best["label"], "kind": best["kind"], "value": best["value"], "x": best["x"],
            "request_throughput": r.get("request_throughput"), "request_goodput": r.get("request_goodput"),
            "output_throughput": r.get("output_throughput")}


def goodput_rate(points: list[dict], target: float = SLO_TARGET) -> float | None:
    """DistServe's goodput: the highest swept request rate (rate points with a finite value) whose SLO
    attainment reaches `target`; None when there is none (or no attainment: no --goodput)."""
    ok = [p["value"] for p in points if p.get("kind") == "rate" and isinstance(p.get("value"), (int, float))
          and math.isfinite(p["value"]) and (p.get("slo_attainment") or 0) >= target]
    return max(ok) if ok else None


def _f(v, nd=2):
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def points_table(sweep: dict) -> str:
    top = "p" + str((sweep.get("percentiles") or [99])[-1]).removesuffix(".0")
    att = any(p["result"].get("slo_attainment") is not None for p in sweep["points"])
    head = (f"{'load':<16}{'ok/fail':>9}{'req/s':>8}{'goodput':>9}{'tok/s':>9}{top + ' TTFT':>11}{top + ' TPOT':>11}"
            f"{top + ' E2EL':>11}" + (f"{'SLO %':>7}" if att else "") + "  SLA")
    lines = [" Sweep ".center(len(head), "="), head]
    for p in sweep["points"]:
        r = p["result"]
        sla = "" if p.get("sla_ok") is None else ("ok" if p["sla_ok"] else "no")
        a = r.get("slo_attainment")
        lines.append(f"{p['label']:<16}{str(r['completed']) + '/' + str(r['failed']):>9}"
                     f"{_f(r.get('request_throughput')):>8}{_f(r.get('request_goodput')):>9}"
                     f"{_f(r.get('output_throughput'), 1):>9}{_f(r.get(top + '_ttft_ms'), 1):>11}"
                     f"{_f(r.get(top + '_tpot_ms'), 1):>11}{_f(r.get(top + '_e2el_ms'), 1):>11}"
                     + (f"{_f(None if a is None else 100 * a, 1):>7}" if att else "") + f"  {sla}")
    lines.append("=" * len(head))
    if att and sweep.get("mode") in ("rate", "auto"):
        g = sweep.get("goodput_rate")
        lines.append(f"goodput (DistServe: highest rate with SLO attainment >= {100 * SLO_TARGET:.0f}%): "
                     + (f"{g:g} req/s" if g is not None else "none (no swept rate reached it)"))
    cap = sweep.get("capacity")
    if not sweep.get("sla"):
        lines.append("no --sla given: no capacity computed")
    elif cap:
        lines.append(f"capacity at SLA {sweep['sla']}: {cap['label']} ({_f(cap['request_throughput'])} req/s, "
                     f"{_f(cap['output_throughput'], 1)} output tok/s)")
    else:
        lines.append(f"capacity at SLA {sweep['sla']}: none (no point met it)")
    return "\n".join(lines)

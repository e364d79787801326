"""Self-contained HTML reports of a run or a sweep: summary tables and inline-SVG plots.

No network fetch of any kind (no CDN script, font or image): the page is one file to mail or attach
to an issue. A small inline script checks on load that every plot drew at least one visible mark
and writes the verdict into `#plot-check` and the title, so a headless browser can tell.
"""
from __future__ import annotations

import math
import os
from html import escape

from inferd.bench.metrics import pct_name, request_metrics
from inferd.bench.svgplot import cdf, histogram, plot
from inferd.bench.sweep import SLO_TARGET
from inferd.errors import InferdError
from inferd.web.style import BASE_CSS, ROLE

_CSS = BASE_CSS + "#plot-check{color:#999;font-size:11px;margin-top:20px}\n"
_CHECK = """
window.addEventListener('load', function () {
  var plots = document.querySelectorAll('svg.plot'), bad = [];
  for (var i = 0; i < plots.length; i++) {
    var marks = plots[i].querySelectorAll('.mark'), drawn = 0;
    for (var j = 0; j < marks.length; j++) {
      var b = marks[j].getBBox();
      if (b.width > 0 || b.height > 0) drawn++;
    }
    if (!drawn) bad.push(plots[i].getAttribute('data-title'));
  }
  var verdict = bad.length ? 'plots-failed ' + bad.length + '/' + plots.length + ': ' + bad.join('; ')
                           : 'plots-ok ' + plots.length;
  document.getElementById('plot-check').textContent = verdict;
  document.title = document.title + ' [' + verdict + ']';
});
"""


def check_writable(path: str) -> None:
    """Fail before a run, not after it, when the page could not be written."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise InferdError(f"--html {path}: is a directory")
    if not os.path.isdir(d):
        raise InferdError(f"--html {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise InferdError(f"--html {path}: not writable")


def write_html(path: str, page: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise InferdError(f"cannot write --html {path}: {e.strerror or e}") from None


def _v(v, nd=2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{nd}f}"
    return escape(str(v))


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body)
            + f'\n<div id="plot-check">plots not checked (scripts disabled?)</div>\n<script>{_CHECK}</script>\n'
              "</body></html>\n")


def _table(header: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{escape(c)}</th>" for c in header)
    r = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{r}</table>"


def _load_desc(res: dict) -> str:
    conc = res.get("max_concurrency")
    rate = res.get("request_rate")
    load = "arrivals from the trace" if rate == "trace" else f"rate {_v(rate)}/s"
    return f"{load}, max concurrency {conc if conc else 'unlimited'}"


def crosscheck_html(cc: dict | None) -> str:
    if not cc:
        return ""
    if not cc.get("available"):
        return f"<h2>Client vs server</h2><p class=\"meta\">Not available: {escape(cc.get('reason', ''))}</p>"
    rows = [[escape("Mean " + r["label"]), _v(r["client_mean_ms"]), _v(r["server_mean_ms"]),
             "-" if r["gap_pct"] is None else f"{r['gap_pct']:+.1f}", str(r["server_count"]),
             escape(r["server_metric"])] for r in cc["metrics"].values()]
    return ("<h2>Client vs server (the server's /metrics over the run)</h2>"
            + _table(["", "client (ms)", "server (ms)", "gap %", "server count", "server metric"], rows))


# -- one run ------------------------------------------------------------------------------------
def run_page(res: dict, requests: list[dict], title: str | None = None) -> str:
    recs = [r for r in requests if not r.get("warmup")]
    per = [(r, request_metrics(r)) for r in recs]
    ok = [(r, m) for r, m in per if m["ok"]]
    title = title or f"inferd bench: {res.get('model_id') or ''} @ {res.get('base_url') or ''}"
    body = [f"<h1>{escape(title)}</h1>",
            f"<p class=\"meta\">{escape(str(res.get('date') or ''))} &middot; {escape(str(res.get('endpoint')))} &middot; "
            f"{escape(str(res.get('dataset')))} &middot; {res.get('num_prompts')} requests &middot; {_load_desc(res)}</p>"]
    pcts = res.get("percentiles") or [50, 90, 95, 99]
    top = pct_name(pcts[-1])
    rows = [["Successful / failed requests", f"{res['completed']} / {res['failed']}"],
            ["Duration (s)", _v(res.get("duration"))],
            ["Request throughput (req/s)", _v(res.get("request_throughput"))],
            ["Request goodput (req/s)", _v(res.get("request_goodput"))],
            ["SLO attainment (%)", _v(None if res.get("slo_attainment") is None else 100 * res["slo_attainment"], 1)],
            ["Output token throughput (tok/s)", _v(res.get("output_throughput"))],
            ["Total token throughput (tok/s)", _v(res.get("total_token_throughput"))],
            ["Peak concurrent requests", _v(res.get("max_concurrent_requests"))]]
    body.append("<h2>Summary</h2>" + _table(["", "value"], rows))
    lat = []
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (per chunk)"), ("e2el", "E2EL")):
        lat.append([label] + [_v(res.get(f"{s}_{name}_ms")) for s in ("mean", "median", "std")]
                   + [_v(res.get(f"{pct_name(p)}_{name}_ms")) for p in pcts if p != 50])
    body.append(_table(["latency (ms)", "mean", "median", "std"] + [f"P{pct_name(p)[1:]}" for p in pcts if p != 50],
                       lat))
    if res.get("classes"):
        hi = pct_name(99 if 99 in pcts else pcts[-1])
        crow = []
        for name, c in res["classes"].items():
            att = c.get("slo_attainment")
            crow.append([escape(name), f"{c['completed']} / {c['failed']}", _v(None if att is None else 100 * att, 1)]
                        + [_v(c.get(f"{s}_{m}_ms")) for m in ("ttft", "tpot", "itl") for s in ("median", hi)])
        body.append("<h2>Per request class</h2>" + _table(
            ["class", "ok / failed", "SLO attainment %"]
            + [f"{lab} {s} ms" for lab in ("TTFT", "TPOT", "ITL") for s in ("p50", hi)], crow))
    body.append(crosscheck_html(res.get("crosscheck")))
    for w in res.get("warnings") or []:
        body.append(f"<p class=\"warn\">warning: {escape(w)}</p>")

    def col(key):
        return [m[key] for _, m in ok if m.get(key) is not None]

    itl = [x for _, m in ok for x in (m.get("itl") or ())]
    figs = []
    for name, label, vals in (("TTFT", "time to first token (ms)", col("ttft")),
                              ("TPOT", "time per output token (ms)", col("tpot")),
                              ("ITL", "inter-token latency, per chunk (ms)", itl)):
        if not vals:  # e.g. TPOT of one-token outputs: nothing to draw, so no empty frame either
            continue
        edges, counts, w = histogram(vals)
        figs.append(plot(f"{name} histogram", label, "requests" if name != "ITL" else "gaps",
                         [{"label": name, "x": edges, "y": counts, "kind": "bars", "bar_width": w,
                           "color": ROLE[name.lower()]}],
                         yint=True, note=f"{len(vals)} values"))
        xs, ys = cdf(vals)
        p50 = res.get(f"median_{name.lower()}_ms")
        ptop = res.get(f"{top}_{name.lower()}_ms")
        figs.append(plot(f"{name} CDF", label, "fraction ≤ x",
                         [{"label": name, "x": xs, "y": ys, "kind": "step", "color": ROLE[name.lower()]}],
                         vlines=[(p50, "p50"), (ptop, top)]))
    body.append("<h2>Distributions</h2><div class=\"grid\">" + "\n".join(figs) + "</div>")

    send_s = [r["send_ns"] / 1e9 for r, _ in ok]
    tl = [{"label": "E2EL", "x": send_s, "y": [m["e2el"] for _, m in ok], "kind": "points", "color": ROLE["e2el"]},
          {"label": "TTFT", "x": [r["send_ns"] / 1e9 for r, m in ok if m.get("ttft") is not None],
           "y": col("ttft"), "kind": "points", "color": ROLE["ttft"]}]
    dur = max((r["end_ns"] for r in recs), default=0) / 1e9
    bw = max(0.25, dur / 60) if dur > 0 else 1.0
    nb = max(1, int(math.ceil(dur / bw)))
    sends, ends = [0] * nb, [0] * nb
    for r in recs:
        sends[min(nb - 1, int(r["send_ns"] / 1e9 / bw))] += 1
    for r, _ in ok:
        ends[min(nb - 1, int(r["end_ns"] / 1e9 / bw))] += 1
    edges = [i * bw for i in range(nb + 1)]
    rate = [{"label": "sent (req/s)", "x": edges, "y": [c / bw for c in sends] + [sends[-1] / bw], "kind": "step"},
            {"label": "completed (req/s)", "x": edges, "y": [c / bw for c in ends] + [ends[-1] / bw], "kind": "step"}]
    body.append("<h2>Over the run</h2><div class=\"grid\">"
                + (plot("Latency over the run", "request sent at (s since start)", "latency (ms)", tl) if ok else "")
                + plot("Request rate over the run", "time since start (s)", "requests / s", rate,
                       note=f"{bw:.2g} s bins")
                + "</div>")
    return _page(title, body)


# -- a sweep ------------------------------------------------------------------------------------
def sweep_page(sweep: dict, title: str | None = None) -> str:
    pts = sweep.get("points") or []
    cap = sweep.get("capacity")
    xlabel = sweep.get("load_label") or "load"
    title = title or f"inferd bench sweep: {sweep.get('model_id') or ''} @ {sweep.get('base_url') or ''}"
    body = [f"<h1>{escape(title)}</h1>",
            f"<p class=\"meta\">{escape(str(sweep.get('date') or ''))} &middot; sweep {escape(str(sweep.get('sweep')))}"
            f" &middot; {len(pts)} points &middot; {sweep.get('num_prompts')} requests each &middot; "
            f"SLA: {escape(sweep.get('sla') or 'none')}</p>"]
    if sweep.get("sla"):
        if cap:
            body.append(f"<p class=\"ok\">Capacity at the SLA: {escape(cap['label'])} "
                        f"({_v(cap.get('request_throughput'))} req/s, {_v(cap.get('output_throughput'))} output tok/s)</p>")
        else:
            body.append("<p class=\"bad\">No point met the SLA.</p>")
    att = any(p["result"].get("slo_attainment") is not None for p in pts)
    if att and sweep.get("mode") in ("rate", "auto"):
        g = sweep.get("goodput_rate")
        body.append(f"<p class=\"{'ok' if g is not None else 'bad'}\">Goodput (DistServe: the highest request rate "
                    f"with SLO attainment &ge; {100 * SLO_TARGET:.0f} %): {f'{g:g} req/s' if g is not None else 'none'}</p>")
    rows = []
    for p in pts:
        r = p["result"]
        verdict = "" if p.get("sla_ok") is None else ("<span class=ok>yes</span>" if p["sla_ok"]
                                                      else f"<span class=bad>no</span> {escape('; '.join(p.get('violations') or []))}")
        rows.append([escape(p["label"]), f"{r['completed']}/{r['failed']}", _v(r.get("request_throughput")),
                     _v(r.get("request_goodput")), _v(r.get("output_throughput")), _v(r.get("p99_ttft_ms")),
                     _v(r.get("p99_tpot_ms")), _v(r.get("p99_e2el_ms"))]
                    + ([_v(None if r.get("slo_attainment") is None else 100 * r["slo_attainment"], 1)] if att else [])
                    + [verdict])
    body.append("<h2>Points</h2>" + _table(["load", "ok/failed", "req/s", "goodput req/s", "output tok/s",
                                            "P99 TTFT ms", "P99 TPOT ms", "P99 E2EL ms"]
                                           + (["SLO attainment %"] if att else []) + ["meets SLA"], rows))
    cc_rows = []
    for p in pts:
        cc = p["result"].get("crosscheck") or {}
        if cc.get("available"):
            row = [escape(p["label"])]
            for key in ("ttft", "e2el"):
                m = cc["metrics"].get(key) or {}
                g = m.get("gap_pct")
                row += [_v(m.get("client_mean_ms")), _v(m.get("server_mean_ms")), "-" if g is None else f"{g:+.1f}"]
            cc_rows.append(row)
    if cc_rows:
        body.append("<h2>Client vs server (the server's /metrics over each point)</h2>"
                    + _table(["load", "client TTFT", "server TTFT", "gap %", "client E2EL", "server E2EL", "gap %"],
                             cc_rows))
    xs = [p["x"] for p in pts]
    pos = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    xlog = len(pos) == len(xs) and len(pos) > 1 and max(pos) / min(pos) >= 8
    ticks = sorted(set(pos)) if xlog and len(set(pos)) <= 12 else None
    vl = [(cap["x"], "capacity")] if cap and cap.get("x") is not None else []
    limits: dict[str, list] = {}
    for key, op, val in sweep.get("sla_clauses") or []:
        limits.setdefault(key, []).append((val, f"SLA {key}{op}{val:g}"))

    def series(field, label):
        return {"label": label, "x": xs, "y": [p["result"].get(field) for p in pts], "kind": "linepoints"}

    kw = dict(xlog=xlog, xticks=ticks, vlines=vl)
    figs = [plot("Throughput vs load", xlabel, "requests / s", [series("request_throughput", "throughput")]
                 + ([series("request_goodput", "goodput")] if any(p["result"].get("request_goodput") is not None
                                                                 for p in pts) else []),
                 hlines=limits.get("request_throughput", []) + limits.get("request_goodput", []), **kw),
            plot("Output tokens vs load", xlabel, "output tokens / s", [series("output_throughput", "output tok/s")],
                 hlines=limits.get("output_throughput", []), **kw)]
    top = pct_name((sweep.get("percentiles") or [99])[-1])
    for name in ("ttft", "tpot", "e2el"):
        field = f"{top}_{name}_ms"
        figs.append(plot(f"{top.upper()} {name.upper()} vs load", xlabel, "ms",
                         [series(field, f"{top} {name}"), series(f"median_{name}_ms", f"median {name}")],
                         hlines=limits.get(field, []), **kw))
    if att:  # DistServe's view: how much of the traffic meets its SLOs as the rate grows
        ys = [None if p["result"].get("slo_attainment") is None else 100 * p["result"]["slo_attainment"] for p in pts]
        figs.append(plot("SLO attainment vs load", xlabel, "requests meeting the SLOs (%)",
                         [{"label": "SLO attainment", "x": xs, "y": ys, "kind": "linepoints"}],
                         hlines=[(100 * SLO_TARGET, f"{100 * SLO_TARGET:.0f} %")], **kw))
    body.append("<h2>Against load</h2><div class=\"grid\">" + "\n".join(figs) + "</div>")
    dist = []
    for name in ("ttft", "e2el"):
        ser = []
        for p in pts:
            vals = (p.get("samples") or {}).get(name) or []
            if vals:
                x, y = cdf(vals)
                ser.append({"label": p["label"], "x": x, "y": y, "kind": "step"})
        if ser:
            dist.append(plot(f"{name.upper()} CDF per point", f"{name.upper()} (ms)", "fraction ≤ x", ser))
    if dist:
        body.append("<h2>Distributions</h2><div class=\"grid\">" + "\n".join(dist) + "</div>")
    return _page(title, body)

"""Just enough plotting for the bench's HTML reports, as inline SVG.

Hand-written rather than matplotlib: the bench client stays free of heavy dependencies, a page is
a few hundred kB of text that any browser draws offline, and every data mark carries class
`mark`, which lets the page (and its test) verify that each plot actually drew something.
"""
from __future__ import annotations

import math
from html import escape

from inferd.web.style import PALETTE

W, H = 600, 340
ML, MR, MT, MB = 70, 20, 46, 52  # margins: room for the y label, the title and legend, the x label


def nice_ticks(lo: float, hi: float, n: int = 6, integer: bool = False) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    if integer:  # counts: no 0.2-request ticks
        raw = max(raw, 1.0)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def log_ticks(lo: float, hi: float) -> list[float]:
    out = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
                out.append(v)
    return out


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2g}"
    if float(v).is_integer():
        return str(int(v))
    return f"{v:.3g}"


def tick_labels(ticks: list[float]) -> list[str]:
    """The fewest decimals that write every tick exactly (84.25 is not "84.2"; 0-30 needs none)."""
    if any(abs(v) >= 1e6 for v in ticks):
        return [fmt(v) for v in ticks]
    for d in range(0, 7):
        if all(abs(v - round(v, d)) <= 1e-9 * max(1.0, abs(v)) for v in ticks):
            return ["0" if round(v, d) == 0 else f"{v:.{d}f}" for v in ticks]
    return [fmt(v) for v in ticks]


def plot(title: str, xlabel: str, ylabel: str, series: list[dict], *, xlog: bool = False,
         xticks: list[float] | None = None, xticklabels: list[str] | None = None,
         hlines: list[tuple[float, str]] = (), vlines: list[tuple[float, str]] = (),
         y0: bool = True, yint: bool = False, note: str | None = None, width: int = W, height: int = H) -> str:
    """One SVG chart. A series: {"label", "x", "y", "kind": line|step|points|linepoints|bars,
    "color"?, "bar_width"? (x units)}."""
    xs = [x for s in series for x in s["x"] if x is not None and math.isfinite(x) and (x > 0 or not xlog)]
    ys = [y for s in series for y in s["y"] if y is not None and math.isfinite(y)]
    for s in series:
        if s.get("kind") == "bars" and s["x"]:
            bw = s.get("bar_width", 0)
            xs += [min(s["x"]), max(s["x"]) + bw]
    xs += [v for v, _ in vlines if v is not None and math.isfinite(v) and (v > 0 or not xlog)]
    ys += [v for v, _ in hlines if v is not None and math.isfinite(v)]
    pw, ph = width - ML - MR, height - MT - MB
    out = [f'<svg class="plot" data-title="{escape(title)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>',
           f'<text x="{ML + pw / 2}" y="{height - 10}" text-anchor="middle">{escape(xlabel)}</text>',
           f'<text transform="translate(16,{MT + ph / 2}) rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>']
    if not xs or not ys:
        out.append(f'<text x="{ML + pw / 2}" y="{MT + ph / 2}" text-anchor="middle" fill="#888">no data</text></svg>')
        return "\n".join(out)
    x0, x1 = min(xs), max(xs)
    if xlog:
        if x1 <= x0:
            x0, x1 = x0 / 2, x1 * 2
        lx0, lx1 = math.log10(x0), math.log10(x1)
        pad = (lx1 - lx0) * 0.04
        lx0, lx1 = lx0 - pad, lx1 + pad

        def X(v):
            return ML + (math.log10(v) - lx0) / (lx1 - lx0) * pw
        ticks = xticks if xticks is not None else log_ticks(10 ** lx0, 10 ** lx1)
    else:
        if x1 <= x0:
            x0, x1 = x0 - (abs(x0) or 1) * 0.5, x1 + (abs(x1) or 1) * 0.5
        if any(s.get("kind") in ("points", "linepoints") for s in series):  # whole markers, not halves
            pad = (x1 - x0) * 0.03
            x0, x1 = x0 - pad, x1 + pad
        ticks = xticks if xticks is not None else nice_ticks(x0, x1)
        if xticks is None and ticks and not any(s.get("kind") in ("points", "linepoints") for s in series):
            x0, x1 = min(x0, ticks[0]), max(x1, ticks[-1])

        def X(v):
            return ML + (v - x0) / (x1 - x0) * pw
    ylo, yhi = (min(0.0, min(ys)) if y0 else min(ys)), max(ys)
    if yhi <= ylo:
        yhi = ylo + (abs(ylo) or 1.0)
    yhi = yhi + (yhi - ylo) * 0.05  # headroom: a line along the top would hide in the frame
    yt = nice_ticks(ylo, yhi, integer=yint)
    ylo, yhi = min(ylo, yt[0]), max(yhi, yt[-1])

    def Y(v):
        return MT + ph - (v - ylo) / (yhi - ylo) * ph

    out.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for v, lab in zip(yt, tick_labels(yt)):
        y = Y(v)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{ML - 5}" y="{y + 4:.1f}" text-anchor="end">{lab}</text>')
    labels = xticklabels or ([fmt(v) for v in ticks] if xlog else tick_labels(ticks))
    for v, lab in zip(ticks, labels):
        if xlog and v <= 0:
            continue
        x = X(v)
        if ML - 0.5 <= x <= ML + pw + 0.5:
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{MT + ph}" stroke="#eee"/>'
                       f'<text x="{x:.1f}" y="{MT + ph + 15}" text-anchor="middle">{escape(lab)}</text>')
    out.append(f'<svg x="{ML}" y="{MT}" width="{pw}" height="{ph}" viewBox="{ML} {MT} {pw} {ph}" overflow="hidden">')
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = [(x, y) for x, y in zip(s["x"], s["y"]) if x is not None and y is not None
               and math.isfinite(x) and math.isfinite(y) and (x > 0 or not xlog)]
        kind = s.get("kind", "line")
        tip = f"<title>{escape(s.get('label', ''))}</title>"
        if kind == "bars":
            bw = s.get("bar_width", 0)
            for x, y in pts:
                xa, xb = X(x), X(x + bw)
                out.append(f'<rect class="mark" x="{xa:.2f}" y="{Y(max(y, 0)):.2f}" width="{max(0.8, xb - xa - 0.6):.2f}" '
                           f'height="{abs(Y(0) - Y(y)):.2f}" fill="{color}" fill-opacity="0.75">{tip}</rect>')
            continue
        if kind in ("line", "step", "linepoints") and len(pts) > 1:
            d, prev = [], None
            for x, y in pts:
                if prev is None:
                    d.append(f"M{X(x):.2f},{Y(y):.2f}")
                elif kind == "step":
                    d.append(f"H{X(x):.2f}V{Y(y):.2f}")
                else:
                    d.append(f"L{X(x):.2f},{Y(y):.2f}")
                prev = (x, y)
            dash = ' stroke-dasharray="5,3"' if s.get("dash") else ""
            out.append(f'<path class="mark" d="{"".join(d)}" fill="none" stroke="{color}" stroke-width="1.8"{dash}>{tip}</path>')
        if kind in ("points", "linepoints") or (kind in ("line", "step") and len(pts) == 1):
            r = 3.5 if kind == "linepoints" else 2.2
            for x, y in pts:
                out.append(f'<circle class="mark" cx="{X(x):.2f}" cy="{Y(y):.2f}" r="{r}" fill="{color}" '
                           f'fill-opacity="{0.9 if kind == "linepoints" else 0.55}"><title>{escape(s.get("label", ""))}: '
                           f'{fmt(x)}, {fmt(y)}</title></circle>')
    for v, lab in hlines:
        if v is None or not math.isfinite(v):
            continue
        y = Y(v)
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#b00" stroke-dasharray="6,4"/>'
                   f'<text x="{ML + 4}" y="{y + 13:.1f}" fill="#b00">{escape(lab)}</text>')
    for k, (v, lab) in enumerate(vlines):
        if v is None or not math.isfinite(v) or (xlog and v <= 0):
            continue
        x = X(v)
        right = x > ML + pw * 0.8  # keep the label inside the frame
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT}" y2="{MT + ph}" stroke="#070" stroke-dasharray="4,3"/>'
                   f'<text x="{x - 4 if right else x + 4:.1f}" y="{MT + 12 + 12 * (k % 2)}" fill="#070" '
                   f'text-anchor="{"end" if right else "start"}">{escape(lab)}</text>')
    out.append("</svg>")
    named = [(i, s) for i, s in enumerate(series) if s.get("label")]
    if len(named) > 1:  # one row between the title and the frame, so that it hides no data
        lx, yy = ML, MT - 8
        for i, s in named:
            color = s.get("color") or PALETTE[i % len(PALETTE)]
            out.append(f'<rect x="{lx}" y="{yy - 8}" width="12" height="8" fill="{color}"/>'
                       f'<text x="{lx + 16}" y="{yy}">{escape(s["label"])}</text>')
            lx += 16 + 6.2 * len(s["label"]) + 14
    if note:
        out.append(f'<text x="{ML + pw}" y="{height - 10}" text-anchor="end" fill="#666" font-size="10">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def histogram(values: list[float], bins: int | None = None) -> tuple[list[float], list[int], float]:
    """(left edges, counts, bin width) over [min, max]."""
    if not values:
        return [], [], 0.0
    lo, hi = min(values), max(values)
    n = bins or max(5, min(40, int(math.sqrt(len(values))) + 1))
    if hi <= lo:
        w = (abs(lo) or 1.0) * 0.02
        return [lo - w / 2], [len(values)], w
    w = (hi - lo) / n
    counts = [0] * n
    for v in values:
        counts[min(n - 1, int((v - lo) / w))] += 1
    return [lo + i * w for i in range(n)], counts, w


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    n = len(s)
    return s, [(i + 1) / n for i in range(n)]

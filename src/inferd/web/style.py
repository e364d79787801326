"""One visual language for every page inferd draws: the bench's HTML reports and the server's chat
page and dashboard. Each measured quantity keeps its colour everywhere (TTFT is the same blue in a
bench report and on the live dashboard), latencies are in ms and rates in tok/s or req/s.

Python, not a CSS file, because the bench writes self-contained pages (styles inline) while the
server serves `/static/theme.css` made from the same values.
"""
from __future__ import annotations

# matplotlib's tab10 order: series without a role of their own take these in turn
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")

ROLE = {
    "ttft": "#1f77b4",
    "tpot": "#d62728",
    "itl": "#2ca02c",
    "e2el": "#9467bd",
    "queue": "#8c564b",
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "recompute": "#e377c2",
    "batch": "#222222",
    "kv-free": "#eeeeee",
    "kv-used": "#1f77b4",
    "kv-shared": "#9467bd",
    "kv-cached": "#2ca02c",
    "ok": "#007700",
    "bad": "#bb0000",
    "warn": "#aa6600",
}

FONT = "system-ui,-apple-system,'Segoe UI',sans-serif"

# the rules both kinds of page share
BASE_CSS = f"""
body{{font-family:{FONT};margin:20px;color:#222;max-width:1300px}}
h1{{font-size:20px;margin:0 0 4px}} h2{{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ccc}}
.meta{{color:#555;font-size:13px}} table{{border-collapse:collapse;font-size:13px;margin:6px 0}}
td,th{{border:1px solid #ddd;padding:3px 8px;text-align:right}} th{{background:#f4f4f4}}
td:first-child,th:first-child{{text-align:left}} .grid{{display:flex;flex-wrap:wrap;gap:10px}}
.ok{{color:{ROLE['ok']};font-weight:bold}} .bad{{color:{ROLE['bad']};font-weight:bold}}
.warn{{color:{ROLE['warn']};font-size:13px}}
"""


def css_variables() -> str:
    """The role colours as CSS custom properties (`var(--ttft)`), for pages that draw in the browser."""
    return ":root{" + "".join(f"--{k}:{v};" for k, v in ROLE.items()) + "}\n"


def theme_css() -> str:
    return css_variables() + BASE_CSS

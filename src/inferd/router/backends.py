"""The router's view of its backends: up or down, and how loaded.

Health: GET /health every interval; any answer but 200 (or no answer) marks a backend down, a
200 up again. Load: the backend's own queue gauges from /metrics when it has them (inferd's,
vLLM's, SGLang's or llama-server's names), else the router's count of the requests it has open
there. A scraped gauge is up to one interval old, so the load used is the larger of the two: a
burst the router just sent counts before the backend's gauges show it.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

log = logging.getLogger("inferd")

# (running gauge, waiting gauge) per server family, in the order tried: inferd also exposes the
# vllm: names, so one family is read, never two summed
LOAD_GAUGES = (
    ("inferd:num_requests_running", "inferd:num_requests_waiting"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
)
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_load(text: str) -> float | None:
    """Running + waiting requests from a Prometheus exposition, summed over label sets (engines,
    models); None when it has none of the known gauges."""
    vals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(2))
            except ValueError:
                continue
    for running, waiting in LOAD_GAUGES:
        if running in vals or waiting in vals:
            return vals.get(running, 0.0) + vals.get(waiting, 0.0)
    return None


def parse_backends(urls: list[str] | None, path: str | None) -> list[str]:
    """--backend URL (repeated) and/or --backends-file YAML (a list of URLs, or of {url: ...}, or
    {backends: [...]})."""
    from inferd.errors import InferdError

    out = list(urls or [])
    if path:
        import yaml

        try:
            with open(path) as f:
                doc = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise InferdError(f"--backends-file {path}: {e}") from None
        if isinstance(doc, dict):
            doc = doc.get("backends")
        if not isinstance(doc, list):
            raise InferdError(f"--backends-file {path}: expected a list of backend URLs")
        for item in doc:
            url = item.get("url") if isinstance(item, dict) else item
            if not isinstance(url, str):
                raise InferdError(f"--backends-file {path}: every backend needs a url")
            out.append(url)
    if not out:
        raise InferdError("the router needs at least one --backend URL (or --backends-file)")
    clean = []
    for u in out:
        u = u.rstrip("/")
        if u.endswith("/v1"):
            u = u[:-3]
        if not re.match(r"^https?://[^/\s]+$", u):
            raise InferdError(f"--backend {u!r}: expected http(s)://host:port")
        if u in clean:
            raise InferdError(f"--backend {u} given twice")
        clean.append(u)
    return clean


@dataclass
class Backend:
    url: str
    up: bool | None = None  # None: not checked yet
    inflight: int = 0  # requests the router has open there
    gauge: float | None = None  # running + waiting from its /metrics
    gauge_at: float = 0.0
    sent: int = 0
    last_error: str = ""
    ever_up: bool = False

    def load(self, max_age: float) -> float:
        if self.gauge is not None and time.monotonic() - self.gauge_at <= max_age:
            return max(self.gauge, self.inflight)
        return self.inflight


class Pool:
    """The backends and the loop that checks them."""

    def __init__(self, urls: list[str], client, interval: float = 2.0, on_change=None):
        self.backends = {u: Backend(u) for u in urls}
        self.client = client
        self.interval = interval
        self.on_change = on_change  # (backend, up) when a backend goes down or comes back

    def live(self) -> list[str]:
        return [u for u, b in self.backends.items() if b.up]

    def loads(self) -> dict[str, float]:
        return {u: b.load(3 * self.interval) for u, b in self.backends.items()}

    async def check(self, b: Backend, metrics: bool = True):
        import httpx

        try:
            r = await self.client.get(b.url + "/health", timeout=min(5.0, max(1.0, self.interval)))
            ok = r.status_code == 200
            reason = "" if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if ok and metrics:
            try:
                r = await self.client.get(b.url + "/metrics", timeout=min(5.0, max(1.0, self.interval)))
                b.gauge = parse_load(r.text) if r.status_code == 200 else None
                b.gauge_at = time.monotonic()
            except httpx.HTTPError:
                b.gauge = None
        self.mark(b, ok, reason)

    def mark(self, b: Backend, ok: bool, reason: str = ""):
        if not ok:
            b.last_error = reason
        if ok == b.up:
            return
        was, b.up = b.up, ok
        if ok:
            log.info("backend %s is up%s", b.url, " again" if b.ever_up else "")
            b.ever_up = True
        elif was is None:
            log.warning("backend %s is unreachable (%s); retrying every %.0f s", b.url, reason, self.interval)
        else:
            log.warning("backend %s is down (%s); retrying every %.0f s", b.url, reason, self.interval)
        if self.on_change:
            self.on_change(b, ok)

    async def run(self):
        import asyncio

        while True:
            await asyncio.gather(*(self.check(b) for b in self.backends.values()))
            await asyncio.sleep(self.interval)

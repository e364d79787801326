"""The built-in pages: a chat page at `/`, a live engine dashboard at `/dashboard`, and the JSON that
feeds the dashboard (`/v1/engine/state`, and `/v1/engine/state/stream` as server-sent events).

The pages are static files shipped in the package (`inferd/server/static/`, read with
importlib.resources): no CDN, no build step, nothing the browser fetches from anywhere else. They
hold no data, so they are served without the API key; everything they show comes from the API,
which asks for it (the key is typed into the page and sent as a bearer token).

The engines are asked for their state only while somebody reads it, at most once per `MIN_INTERVAL_S`
however many dashboards are open: one state serves every reader that asks within that time.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Query
from fastapi.responses import Response, StreamingResponse

from inferd.engine.state import STEP_HISTORY
from inferd.server.protocol import COMMON_ERRORS, ApiError, error_responses
from inferd.style import theme_css

# Scripts and styles from this origin only, no inline script or style: model output that slipped
# into the DOM as markup could still not run. No framing (clickjacking of the stop button).
CSP = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
MIN_INTERVAL_S = 0.1
DEFAULT_INTERVAL_S = 0.25
KEEP_STATES = 64  # recent states per engine, findable by their step id (?engine=&step=)


def is_public(path: str) -> bool:
    """The pages and their assets carry no data: they load without the API key."""
    return path in PAGES or path.startswith("/static/")


@lru_cache(maxsize=None)
def asset(name: str) -> bytes | None:
    if name == "theme.css":  # the role colours shared with the bench's reports (inferd.style)
        return theme_css().encode()
    base = resources.files("inferd.server") / "static"
    if "/" in name or name.startswith(".") or not any(name.endswith(ext) for ext in TYPES):
        return None
    f = base / name
    return f.read_bytes() if f.is_file() else None


def _asset_response(name: str) -> Response:
    data = asset(name)
    if data is None:
        raise ApiError("no such file", status=404, type_="not_found_error")
    ext = name[name.rfind("."):]
    return Response(data, media_type=TYPES[ext], headers=PAGE_HEADERS)


class StateCache:
    """The engines' latest states, shared by every reader; and recent ones by step id."""

    def __init__(self, llm):
        self.llm = llm
        self.lock = asyncio.Lock()
        self.latest: list[dict] | None = None
        self.at = 0.0
        self.by_step: dict[int, OrderedDict] = {}

    async def fetch(self, max_age: float = MIN_INTERVAL_S) -> list[dict]:
        async with self.lock:
            if self.latest is not None and time.monotonic() - self.at < max_age:
                return self.latest
            try:
                engines = await self.llm.state(STEP_HISTORY)
            except asyncio.TimeoutError:
                raise ApiError("the engine did not answer within 10 s", status=503, type_="server_error") from None
            for st in engines:
                if "step" in st:
                    kept = self.by_step.setdefault(st["engine"], OrderedDict())
                    kept[st["step"]] = st
                    kept.move_to_end(st["step"])
                    while len(kept) > KEEP_STATES:
                        kept.popitem(last=False)
            self.latest, self.at = engines, time.monotonic()
            return engines

    def at_step(self, engine: int, step: int) -> dict | None:
        return self.by_step.get(engine, {}).get(step)


def trim(st: dict, steps: int, after_step: int = -1, after_finished: int = 0) -> dict:
    """A copy of one engine's state with only the step rows and finished requests a reader asked for."""
    if "steps" not in st:
        return st
    rows = [r for r in st["steps"]["rows"] if r[0] > after_step]
    fin = [r for r in st["finished"]["rows"] if r[0] > after_finished]
    return {**st, "steps": {**st["steps"], "rows": rows[-steps:] if steps > 0 else []},
            "finished": {**st["finished"], "rows": fin}}


def router(srv, app_state) -> APIRouter:
    r = APIRouter()
    cache = StateCache(srv.llm)

    def document(engines: list[dict]) -> dict:
        return {"object": "engine.state", "model": srv.name, "time": time.time(),
                "draining": bool(getattr(app_state, "draining", False)), "engines": engines}

    @r.get("/", include_in_schema=False)
    async def chat_page():
        return _asset_response(PAGES["/"])

    @r.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return _asset_response(PAGES["/dashboard"])

    @r.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        return _asset_response(name)

    @r.get("/v1/engine/state", responses=error_responses(*COMMON_ERRORS, 404, 503))
    async def engine_state(steps: int = Query(STEP_HISTORY, ge=0, le=STEP_HISTORY),
                           engine: int | None = Query(None, ge=0), step: int | None = Query(None, ge=0)):
        """Each engine's state after its last step: running and waiting requests (ids and lengths),
        the KV block map, recent steps and finished requests, counters. With `engine` and `step`:
        that engine's state as it was after that step, if it is one of the last few read."""
        if step is not None:
            st = cache.at_step(engine or 0, step)
            if st is None:
                raise ApiError(f"no state of engine {engine or 0} at step {step} is kept (only the last "
                               f"{KEEP_STATES} read)", status=404, type_="not_found_error", param="step")
            return document([trim(st, steps)])
        engines = await cache.fetch()
        if engine is not None:
            engines = [st for st in engines if st.get("engine") == engine]
            if not engines:
                raise ApiError(f"no engine {engine}", status=404, type_="not_found_error", param="engine")
        return document([trim(st, steps) for st in engines])

    @r.get("/v1/engine/state/stream", responses={200: {"content": {"text/event-stream": {}}},
                                                 **error_responses(*COMMON_ERRORS, 503)})
    async def engine_state_stream(interval: float = Query(DEFAULT_INTERVAL_S, ge=MIN_INTERVAL_S, le=10.0)):
        """The same state as server-sent events, one event every `interval` seconds while the
        connection is open. After the first event, each carries only the step rows and finished
        requests that are new since the last one."""
        first = await cache.fetch(interval / 2)  # an engine that does not answer is a 503 before the stream starts

        async def events():
            last_step: dict[int, int] = {}
            last_fin: dict[int, int] = {}
            engines = first
            while True:
                out = []
                for st in engines:
                    e = st.get("engine", 0)
                    out.append(trim(st, STEP_HISTORY, last_step.get(e, -1), last_fin.get(e, 0)))
                    if st.get("steps", {}).get("rows"):
                        last_step[e] = st["steps"]["rows"][-1][0]
                    if st.get("finished", {}).get("rows"):
                        last_fin[e] = st["finished"]["rows"][-1][0]
                yield f"data: {json.dumps(document(out), separators=(',', ':'))}\n\n"
                if getattr(app_state, "draining", False):  # an open dashboard must not hold a drain up
                    return
                await asyncio.sleep(interval)
                try:
                    engines = await cache.fetch(interval / 2)
                except ApiError as e:
                    yield f"event: error\ndata: {json.dumps(e.body())}\n\n"
                    return

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return r


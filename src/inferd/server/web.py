"""The built-in pages (inferd.web: a chat page at `/`, the live dashboard at `/dashboard`) and the
JSON that feeds the dashboard: `/v1/engine/state`, and `/v1/engine/state/stream` as server-sent events.

The pages hold no data, so they are served without the API key; everything they show comes from
the API, which asks for it (the key is typed into the page and sent as a bearer token).

The engines are asked for their state only while somebody reads it, at most once per
`MIN_INTERVAL_S` however many dashboards are open: one state serves every reader that asks within
that time.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from fastapi import APIRouter, Query
from fastapi.responses import Response, StreamingResponse

from inferd.errors import openai_error
from inferd.server.protocol import COMMON_ERRORS, ApiError, error_responses
from inferd.web.assets import HEADERS, PAGES, asset
from inferd.web.feed import STEP_ROWS, events, trim

MIN_INTERVAL_S = 0.1
DEFAULT_INTERVAL_S = 0.25
KEEP_STATES = 64  # recent states per engine, findable by their step id (?engine=&step=)


def page_response(name: str) -> Response:
    found = asset(name)
    if found is None:
        raise ApiError("no such file", status=404, type_="not_found_error")
    return Response(found[0], media_type=found[1], headers=HEADERS)


class StateCache:
    """The engines' latest states, shared by every reader; and recent ones by step id."""

    def __init__(self, source):
        self.source = source  # anything with `async state(steps)`
        self.lock = asyncio.Lock()
        self.latest: list[dict] | None = None
        self.at = 0.0
        self.by_step: dict[int, OrderedDict] = {}

    async def fetch(self, max_age: float = MIN_INTERVAL_S) -> list[dict]:
        async with self.lock:
            if self.latest is not None and time.monotonic() - self.at < max_age:
                return self.latest
            try:
                engines = await self.source.state(STEP_ROWS)
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


def router(models, app_state) -> APIRouter:
    """`models`: the served models (inferd.server.models); the state is their loaded engines'."""
    r = APIRouter()
    cache = StateCache(models)

    def document(engines: list[dict]) -> dict:
        return {"object": "engine.state", "model": models.default.name, "time": time.time(),
                "draining": bool(getattr(app_state, "draining", False)), "engines": engines}

    @r.get("/", include_in_schema=False)
    async def chat_page():
        return page_response(PAGES["/"])

    @r.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return page_response(PAGES["/dashboard"])

    @r.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        return page_response(name)

    @r.get("/v1/engine/state", responses=error_responses(*COMMON_ERRORS, 404, 503))
    async def engine_state(steps: int = Query(STEP_ROWS, ge=0, le=STEP_ROWS),
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
        await cache.fetch(interval / 2)  # an engine that does not answer is a 503 before the stream starts
        body = events(lambda: cache.fetch(interval / 2), document, interval,
                      lambda: getattr(app_state, "draining", False),
                      lambda e: e.body() if isinstance(e, ApiError) else openai_error(str(e), "server_error", code=503))
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return r

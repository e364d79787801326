"""The dashboard's state as server-sent events: the first event whole, then only what is new.

`inferd serve` feeds it from its engines, `inferd router` from its backends' /v1/engine/state; both
go through `events` so the page reads one format. A state is one engine's dict (inferd.engine.state)
with its `engine` index; `steps` and `finished` rows start with an increasing id (step id, finish
sequence number), which is what "new" means.
"""
from __future__ import annotations

import asyncio
import json

STEP_ROWS = 240  # as many as an engine keeps (inferd.engine.state.STEP_HISTORY)


def trim(st: dict, steps: int = STEP_ROWS, after_step: int = -1, after_finished: int = 0) -> dict:
    """A copy of one engine's state with only the step rows and finished requests a reader asked for."""
    if "steps" not in st or "finished" not in st:
        return st
    rows = [r for r in st["steps"]["rows"] if r[0] > after_step]
    fin = [r for r in st["finished"]["rows"] if r[0] > after_finished]
    return {**st, "steps": {**st["steps"], "rows": rows[-steps:] if steps > 0 else []},
            "finished": {**st["finished"], "rows": fin}}


async def events(fetch, document, interval: float, stopping, error_body):
    """SSE text: `document(engines)` every `interval` seconds, engines from `await fetch()`.
    Ends when `stopping()` (a draining server must not wait on an open dashboard) or when fetch
    raises (an `event: error` with `error_body(e)` first, if it is a known error)."""
    last_step: dict = {}
    last_fin: dict = {}
    while True:
        try:
            engines = await fetch()
        except Exception as e:  # noqa: BLE001 - the reader gets the reason, the stream ends
            yield f"event: error\ndata: {json.dumps(error_body(e))}\n\n"
            return
        out = []
        for st in engines:
            key = (st.get("backend"), st.get("engine", 0))
            out.append(trim(st, STEP_ROWS, last_step.get(key, -1), last_fin.get(key, 0)))
            if st.get("steps", {}).get("rows"):
                last_step[key] = st["steps"]["rows"][-1][0]
            if st.get("finished", {}).get("rows"):
                last_fin[key] = st["finished"]["rows"][-1][0]
        yield f"data: {json.dumps(document(out), separators=(',', ':'))}\n\n"
        if stopping():
            return
        await asyncio.sleep(interval)

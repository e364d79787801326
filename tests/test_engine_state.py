"""The engine's dashboard state (inferd.engine.state) on a tiny random model: the KV map agrees with
the block manager block by block, shared and cached blocks show as such, the rings stay bounded,
reading the state changes nothing, and an abort is a finished output the metrics can count."""
from __future__ import annotations

import json

from helpers import assert_no_leaks

from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.engine.state import STEP_HISTORY, kv_counts, kv_map


def engine(tiny_model, **opts):
    return LLMEngine(loaded=tiny_model, dtype="float32", num_kv_blocks=64, block_size=8, **opts)


def test_kv_map_is_the_block_managers_states():
    ref = [0, 1, 2, 0, 3, 0]
    assert kv_map(ref, [3]) == ".uscs."
    assert kv_counts("..us.cs") == {"free": 3, "used": 3, "shared": 2, "cached": 1}


def test_shared_then_cached_blocks_and_rows(tiny_model):
    eng = engine(tiny_model)
    prefix = list(range(1, 41))  # 5 full blocks shared by both requests
    a = eng.add_request(prefix + [50, 51], SamplingParams(max_tokens=6, temperature=0))
    eng.step()
    b = eng.add_request(prefix + [60], SamplingParams(max_tokens=6, temperature=0))
    eng.step()
    st = eng.state()
    json.dumps(st)  # plain data: it crosses the process boundary and goes out as JSON
    bm = eng.block_manager
    m = st["kv"]["map"]
    assert len(m) == 64 and st["kv"]["used_blocks"] == bm.num_used == m.count("u") + m.count("s")
    assert m.count("s") == 5 == st["kv"]["shared_blocks"]  # b found a's prefix blocks
    assert {r["id"] for r in st["running"]} == {a, b} and st["num_running"] == 2
    assert all(r["phase"] == "decode" for r in st["running"])
    assert st["counters"]["prefix_hits"] == 40 and st["step"] == 2

    assert stable(eng.state()) == stable(st)  # reading it changes nothing
    while eng.has_unfinished():
        eng.step()
    st = eng.state()
    assert st["kv"]["used_blocks"] == 0 and st["kv"]["cached_blocks"] > 0 and "u" not in st["kv"]["map"]
    rows = [dict(zip(st["finished"]["fields"], r)) for r in st["finished"]["rows"]]
    assert [r["id"] for r in rows] == [a, b] or [r["id"] for r in rows] == [b, a]
    assert all(r["output_tokens"] == 6 and r["finish_reason"] == "length" and r["ttft_ms"] > 0 for r in rows)
    assert [r["seq"] for r in rows] == [1, 2]
    steps = [dict(zip(st["steps"]["fields"], r)) for r in st["steps"]["rows"]]
    assert [s["step"] for s in steps] == list(range(1, st["step"] + 1))
    assert steps[0]["prefill"] == 42 and steps[1]["decode"] == 1 and steps[1]["prefill"] == 1
    assert_no_leaks_but_cached(eng)


def stable(st: dict) -> dict:
    """The state without what moves with the clock."""
    return {**st, "time": None, "build_ms": None, "running": [{**r, "age_ms": None} for r in st["running"]]}


def assert_no_leaks_but_cached(eng):
    bm = eng.block_manager
    bm.check_invariants([])
    assert bm.num_used == 0 and not eng.requests


def test_abort_is_a_finished_output_and_a_row(tiny_model):
    eng = engine(tiny_model)
    rid = eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    eng.abort(rid)
    outs = eng.take_aborted()
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
    assert len(outs[0].output_ids) == 2 and eng.take_aborted() == []
    st = eng.state()
    assert st["finished"]["rows"][-1][1] == rid and st["finished"]["rows"][-1][5] == "abort"
    assert st["kv"]["used_blocks"] == 0
    # an abort between steps comes out with the next step's outputs
    rid2 = eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    rid3 = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    eng.abort(rid2)
    first = eng.step()
    assert first[0].request_id == rid2 and first[0].finish_reason == "abort"
    assert any(o.request_id == rid3 for o in first)
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)


def test_step_ring_is_bounded(tiny_model):
    eng = engine(tiny_model)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=STEP_HISTORY + 20, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    st = eng.state(steps=10)
    assert len(eng.history.steps) == STEP_HISTORY and len(st["steps"]["rows"]) == 10
    assert st["steps"]["rows"][-1][0] == st["step"] == STEP_HISTORY + 20

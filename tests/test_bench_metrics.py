"""Pure metric functions of `inferd bench` on hand-built traces (no server, no clock)."""
import json
import math

import pytest

from inferd.bench import metrics as M
from inferd.bench.http import Response
from inferd.bench.report import check_sla, parse_goodput, parse_percentiles, parse_sla, result_from_lines
from inferd.bench.runner import parse_events
from inferd.errors import InferdError

MS = 1_000_000


def rec(events, out, *, send=0, sched=0, end=None, ok=True, index=0, prompt_len=10, output_len=None, **kw):
    """A request record; events as (t_ms, kind, tokens, chars)."""
    ev = [[int(t * MS), k, n, c] for t, k, n, c in events]
    r = {"type": "request", "index": index, "warmup": False, "prompt_len": prompt_len,
         "output_len": output_len if output_len is not None else out, "sched_ns": int(sched * MS),
         "dispatch_ns": int(sched * MS), "slot_ns": int(send * MS), "send_ns": int(send * MS),
         "end_ns": int((end if end is not None else (ev[-1][0] / MS if ev else send)) * MS), "ok": ok,
         "error_kind": None if ok else "http", "error": None if ok else "boom", "http_status": None if ok else 500,
         "output_tokens": out if ok else None, "output_tokens_source": "usage" if ok else None, "events": ev}
    r.update(kw)
    return r


def result(records, percentiles=(50, 99), goodput=None, lags=()):
    header = {"type": "header", "format": "inferd-bench-trace", "version": 1, "date": "d",
              "config": {"percentiles": list(percentiles), "goodput": goodput or {}}, "warnings": []}
    footer = {"type": "footer", "wall_ns": 10 ** 9, "cpu_ns": 10 ** 8, "loop_lag_ns": list(lags)}
    return M.compute_result(header, records, footer)


def test_multi_token_chunks_itl_per_chunk_and_per_token():
    # 1 token at 100 ms, then chunks of 4 tokens at 180 and 260, then 3 at 320 -> 12 tokens
    r = rec([(100, "content", 1, 4), (180, "content", 4, 16), (260, "content", 4, 16), (320, "content", 3, 12),
             (321, "usage", 0, 0), (321, "done", None, 0)], 12, send=0)
    m = M.request_metrics(r)
    assert m["ttft"] == 100 and m["e2el"] == 320
    assert m["tpot"] == pytest.approx(220 / 11)
    assert m["itl"] == [80, 80, 60]
    assert len(m["itl_per_token"]) == 11 and m["itl_per_token"][:4] == [20.0] * 4
    assert m["itl_per_token"][-3:] == [20.0] * 3
    # per request: E2EL - TTFT = sum ITL, both ways; per-token ITLs average to TPOT
    assert sum(m["itl"]) == pytest.approx(m["e2el"] - m["ttft"])
    assert sum(m["itl_per_token"]) == pytest.approx(m["e2el"] - m["ttft"])
    assert M.mean(m["itl_per_token"]) == pytest.approx(m["tpot"])


def test_multi_token_first_chunk_counts_zero_gaps():
    r = rec([(50, "content", 3, 3), (70, "content", 2, 2)], 5)
    m = M.request_metrics(r)
    assert m["itl_per_token"] == [0.0, 0.0, 10.0, 10.0]
    assert m["tpot"] == pytest.approx(20 / 4) == M.mean(m["itl_per_token"])


def test_single_token_output_has_no_tpot_and_no_itl():
    r = rec([(40, "content", 1, 3), (41, "usage", None, 0)], 1)
    m = M.request_metrics(r)
    assert m["ttft"] == 40 and m["e2el"] == 40
    assert m["tpot"] is None and m["itl"] == [] and m["itl_per_token"] == []
    res = result([r])
    assert res["mean_tpot_ms"] is None and res["mean_ttft_ms"] == 40 and res["completed"] == 1


def test_role_only_first_chunk_does_not_count_as_first_token():
    r = rec([(1, "role", None, 0), (200, "content", 1, 4), (220, "content", 1, 4)], 2)
    m = M.request_metrics(r)
    assert m["ttft"] == 200 and m["tpot"] == 20 and m["itl"] == [20]


def test_empty_output_is_completed_without_ttft():
    r = rec([(1, "role", None, 0), (5, "empty", None, 0), (6, "usage", None, 0), (6, "done", None, 0)], 0, end=7)
    m = M.request_metrics(r)
    assert m["ttft"] is None and m["tpot"] is None and m["itl"] == [] and m["e2el"] == 7
    res = result([r])
    assert res["completed"] == 1 and res["total_output_tokens"] == 0 and res["mean_ttft_ms"] is None
    assert res["mean_e2el_ms"] == 7


def test_failed_requests_are_counted_not_measured():
    good = rec([(100, "content", 1, 1), (120, "content", 1, 1)], 2, index=0)
    bad = rec([], None, ok=False, index=1, end=3)
    bad2 = rec([], None, ok=False, index=2, end=4, http_status=None, error_kind="timeout")
    res = result([good, bad, bad2])
    assert res["completed"] == 1 and res["failed"] == 2
    assert res["failure_reasons"] == {"http 500": 1, "timeout": 1}
    assert res["mean_ttft_ms"] == 100 and res["total_output_tokens"] == 2
    assert res["request_throughput"] == pytest.approx(1 / 0.12)


def test_goodput_with_mixed_slos():
    # a: meets all; b: TTFT too slow; c: TPOT too slow; d: single token (no TPOT) meets;
    # e: failed (a miss); f: empty output (no first token) misses the TTFT SLO
    a = rec([(100, "content", 1, 1), (130, "content", 1, 1)], 2, index=0)              # tpot 30
    b = rec([(600, "content", 1, 1), (610, "content", 1, 1)], 2, index=1)              # ttft 600
    c = rec([(100, "content", 1, 1), (200, "content", 1, 1)], 2, index=2)              # tpot 100
    d = rec([(100, "content", 1, 1)], 1, index=3)
    e = rec([], None, ok=False, index=4, end=50)
    f = rec([(5, "empty", None, 0)], 0, index=5, end=1000)
    slos = {"ttft": 500, "tpot": 50}
    per = [M.request_metrics(x) for x in (a, b, c, d, e, f)]
    assert [M.meets_slos(m, slos) for m in per] == [True, False, False, True, False, False]
    assert M.meets_slos(per[1], {"tpot": 50}) and not M.meets_slos(per[2], {"e2el": 150})
    res = result([a, b, c, d, e, f], goodput=slos)
    assert res["request_goodput"] == pytest.approx(2 / res["duration"])
    assert res["duration"] == 1.0  # the last end


def test_statistics_match_numpy_definitions():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3]
    for p in (1, 50, 90, 95, 99, 99.9):
        assert M.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert M.std(xs) == pytest.approx(float(np.std(xs)))
    assert M.mean(xs) == pytest.approx(float(np.mean(xs)))
    assert M.pct_name(99) == "p99" and M.pct_name(99.9) == "p99.9"
    s = M.summarize("ttft", xs, [50, 99.9])
    assert set(s) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms"}
    assert M.summarize("ttft", [], [99])["p99_ttft_ms"] is None


def test_peak_concurrency_and_schedule_metrics():
    assert M.peak_concurrency([(0, 10), (10, 20), (5, 15)]) == 2
    r = rec([(130, "content", 1, 1)], 1, sched=10, send=30)
    r["dispatch_ns"] = 12 * MS
    m = M.request_metrics(r)
    assert m["ttft"] == 100 and m["ttft_from_schedule"] == 120
    assert m["send_lag"] == 2 and m["slot_wait"] == 18


def test_exp_ks_statistic():
    rate = 20.0
    n = 1000
    gaps = [-math.log(1 - (i + 0.5) / n) / rate for i in range(n)]  # exact quantiles of Exp(20)
    assert M.exp_ks_statistic(gaps, rate) < 1 / n
    assert M.exp_ks_statistic([1 / rate] * n, rate) > 0.3  # constant gaps are not exponential


def _resp(payloads, t0=1000):
    r = Response.__new__(Response)
    r.events = [(t0 + i * MS, p.encode() if isinstance(p, str) else p) for i, p in enumerate(payloads)]
    return r


def test_parse_stream_with_continuous_usage_role_chunk_and_usage_chunk():
    def ch(delta, ct=None, choices=True):
        d = {"id": "x", "choices": [{"index": 0, "delta": delta}] if choices else []}
        if ct is not None:
            d["usage"] = {"prompt_tokens": 7, "completion_tokens": ct}
        return json.dumps(d)

    p = parse_events(_resp([ch({"role": "assistant", "content": ""}, 0), ch({"content": "a"}, 1),
                            ch({"content": "bcd"}, 4), ch({}, 4), ch({}, 4, choices=False), "[DONE]"]), "chat")
    kinds = [(e[1], e[2]) for e in p["events"]]
    assert kinds == [("role", None), ("content", 1), ("content", 3), ("empty", None), ("usage", 0), ("done", None)]
    assert p["completion_tokens"] == 4 and p["prompt_tokens"] == 7 and p["text"] == "abcd" and p["done"]


def test_parse_stream_without_per_chunk_usage_falls_back_to_text():
    p = parse_events(_resp(['{"choices": [{"text": ""}]}', '{"choices": [{"text": "hi"}]}',
                            '{"choices": [], "usage": {"completion_tokens": 3}}', "[DONE]"]), "completions")
    assert [(e[1], e[2]) for e in p["events"]] == [("empty", None), ("content", None), ("usage", None), ("done", None)]
    assert p["completion_tokens"] == 3


def test_parse_stream_error_event():
    p = parse_events(_resp(['{"error": {"message": "out of memory"}}', "[DONE]"]), "completions")
    assert "out of memory" in p["error"]


def test_trace_roundtrip_reproduces_result_exactly():
    from inferd.bench.report import trace_lines

    recs = [rec([(100 + i, "content", 1, 1), (120 + 2 * i, "content", 2, 2)], 3, index=i, send=i / 3)
            for i in range(5)]
    header = {"type": "header", "format": "inferd-bench-trace", "version": 1, "date": "d",
              "config": {"percentiles": [50, 99.9], "goodput": {"ttft": 103}, "request_rate": "inf"},
              "warnings": []}
    footer = {"type": "footer", "wall_ns": 10 ** 9, "cpu_ns": 1, "loop_lag_ns": [1, 2, 3]}
    lines = trace_lines([header, *recs, footer])
    a = result_from_lines(lines)
    b = M.compute_result(header, recs, footer)
    assert json.loads(json.dumps(a)) == a == b


def test_goodput_sla_percentiles_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500, "tpot": 50}
    assert parse_percentiles("50,90,99.9") == [50, 90, 99.9]
    clauses = parse_sla("p99_ttft_ms<500, p99_tpot_ms<=50,failed<1", [50, 99])
    assert clauses == [("p99_ttft_ms", "<", 500), ("p99_tpot_ms", "<=", 50), ("failed", "<", 1)]
    assert check_sla({"p99_ttft_ms": 400, "p99_tpot_ms": 50, "failed": 0}, clauses) == []
    bad = check_sla({"p99_ttft_ms": 612.4, "p99_tpot_ms": 50, "failed": 0}, clauses)
    assert len(bad) == 1 and "p99_ttft_ms = 612.4" in bad[0]
    for s in ("p99_ttft_ms", "p99_ttft_ms<fast", "p97_ttft_ms<5", "nonsense<1"):
        with pytest.raises(InferdError):
            parse_sla(s, [50, 99])
    for g in (["ttft"], ["ttft:-1"], ["speed:3"]):
        with pytest.raises(InferdError):
            parse_goodput(g)
    with pytest.raises(InferdError):
        parse_percentiles("0,101")


def test_http_response_parser_any_split():
    import asyncio

    events = [b'{"a": 1}', b'{"b": "x\\ny"}', b"[DONE]"]
    sse = b"".join(b"data: " + e + b"\n\n" for e in events[:1]) + b"data: " + events[1] + b"\r\n\r\n" \
        + b": comment\n\ndata:[DONE]\n\n"
    body = b""
    for i in range(0, len(sse), 7):  # chunks of 7 bytes, with an extension on one
        piece = sse[i:i + 7]
        body += (b"%x;ext=1" % len(piece) if i == 7 else b"%x" % len(piece)) + b"\r\n" + piece + b"\r\n"
    raw = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           + body + b"0\r\nX-Trailer: 1\r\n\r\n")
    loop = asyncio.new_event_loop()
    try:
        for step in (1, 3, 10, len(raw)):
            r = Response(loop)
            for i in range(0, len(raw), step):
                r.feed(i, raw[i:i + step])
            assert r.done.done() and r.error is None and r.status == 200 and r.reusable
            assert [e for _, e in r.events] == [b'{"a": 1}', b'{"b": "x\\ny"}', b"[DONE]"] and r.sse_done
        r = Response(loop)
        r.feed(0, b"HTTP/1.1 503 Busy\r\nContent-Length: 5\r\nConnection: close\r\n\r\nno")
        assert not r.done.done()
        r.feed(1, b"pe!")
        assert r.done.done() and r.status == 503 and b"".join(r.body) == b"nope!" and not r.reusable
        r = Response(loop)
        r.feed(0, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nda")
        r.eof(9, None)
        assert r.error and "mid-stream" in r.error
    finally:
        loop.close()

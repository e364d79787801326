"""Workloads for disaggregated prefill/decode: `--dataset mixed` (request classes), per-class metrics,
SLO attainment and a rate sweep's DistServe goodput, and trace replay in Mooncake's and Azure's
formats (arrival times from the trace, shared hash ids as shared token prefixes). Pure functions on
hand-built inputs, plus two short runs against `inferd mock-server`."""
import json
import subprocess
import sys

import pytest

from inferd.bench import datasets as D
from inferd.bench.calibrate import spawn_mock
from inferd.bench.html import sweep_page
from inferd.bench.metrics import compute_result
from inferd.bench.report import console_table, read_trace, result_from_lines, trace_lines
from inferd.bench.sweep import SWEEP_FORMAT, goodput_rate, points_table
from inferd.bench.traces import AZURE_FILE, MOONCAKE_FILE, azure_text, mooncake_text
from inferd.errors import InferdError

MS = 1_000_000


@pytest.fixture(scope="module")
def tok():
    from inferd.bench.tokenizer import resolve_tokenizer

    t, _ = resolve_tokenizer(None, "", None, None)
    if t is None:
        pytest.skip("the default model's tokenizer is not installed")
    return t


def test_local_tokenizer_from_a_gguf_file_or_its_folder(tok, tmp_path):
    """--tokenizer PATH: a .gguf file, or a folder holding one, read through inferd.gguf_file."""
    import os

    from inferd.bench.tokenizer import default_tokenizer_path, load_local

    path = default_tokenizer_path()
    os.symlink(path, tmp_path / "model.gguf")
    for spec in (path, str(tmp_path)):
        t = load_local(spec)
        assert t.vocab_size == tok.vocab_size and t.encode("Hello, world!") == tok.encode("Hello, world!")
    with pytest.raises(InferdError, match="tokenizer not found"):
        load_local(str(tmp_path / "missing"))


# -- --mix ---------------------------------------------------------------------------------------
def test_parse_mix_forms_and_errors():
    classes = D.parse_mix(D.DEFAULT_MIX)
    assert [(c.name, c.fraction) for c in classes] == [("chat", 0.8), ("rag", 0.2)]
    c = D.parse_mix("a:0.5:normal:100,10:8,b:0.25:10-20:normal:5,1,c:0.25:7:3")
    assert [x.name for x in c] == ["a", "b", "c"]  # the commas inside normal:M,S split no class
    for bad, needle in (("a:0.5:10:10", "add up to 0.5"), ("a:0.5:10:10,a:0.5:1:1", "twice"),
                        ("a:0.5:10,b:0.5:1:1", "a:0.5:10"), ("a:1.5:1:1", "fraction"), ("a:1:0:1", "input length"),
                        ("a:1:1:normal:5", "output length"), ("a:1:1:1:1", "a:1:1:1:1")):
        with pytest.raises(InferdError, match=needle):
            D.parse_mix(bad)


def test_class_counts_are_rounded_fractions_adding_up():
    assert D.class_counts([0.8, 0.2], 10) == [8, 2]
    assert D.class_counts([0.8, 0.2], 7) == [6, 1]  # 5.6 / 1.4: the larger remainder rounds up
    assert D.class_counts([1 / 3] * 3, 10) == [4, 3, 3]
    for n in range(1, 40):
        assert sum(D.class_counts([0.5, 0.3, 0.2], n)) == n


def test_mixed_prompts_exact_under_the_tokenizer(tok):
    ps, warns = D.build_prompts("mixed", 10, tok, "1024", None, 3, mix="a:0.7:16-24:4,b:0.3:normal:40,5:2")
    assert not warns
    assert sum(p.klass == "a" for p in ps) == 7 and sum(p.klass == "b" for p in ps) == 3
    assert [p.klass for p in ps] != sorted(p.klass for p in ps)  # shuffled, not grouped
    for p in ps:
        assert len(tok.encode(p.prompt)) == p.prompt_len  # exactly the length it claims
        assert (16 <= p.prompt_len <= 24 and p.output_len == 4) if p.klass == "a" else p.output_len == 2
    again, _ = D.build_prompts("mixed", 10, tok, "1024", None, 3, mix="a:0.7:16-24:4,b:0.3:normal:40,5:2")
    assert [(p.prompt, p.klass) for p in again] == [(p.prompt, p.klass) for p in ps]  # seeded
    _, warns = D.build_prompts("mixed", 2, tok, "1024", "9", 0, mix="a:0.9:8:2,b:0.1:8:2")
    assert any("ignored" in w for w in warns) and any("'b' gets no request" in w for w in warns)


# -- per-class metrics and SLO attainment --------------------------------------------------------------
def rec(index, klass, ttft, tpot, n=5, ok=True):
    """A request sent at 0 whose n tokens arrive one per chunk: the first at ttft, then every tpot (ms)."""
    ev = [[int((ttft + k * tpot) * MS), "content", 1, 1] for k in range(n)] if ok else []
    r = {"type": "request", "index": index, "warmup": False, "prompt_len": 8, "output_len": n, "sched_ns": 0,
         "dispatch_ns": 0, "slot_ns": 0, "send_ns": 0, "end_ns": ev[-1][0] if ev else MS, "ok": ok,
         "error_kind": None if ok else "http", "error": None if ok else "boom", "http_status": None if ok else 500,
         "output_tokens": n if ok else None, "output_tokens_source": "usage" if ok else None, "events": ev}
    if klass is not None:
        r["class"] = klass
    return r


def trace(records, goodput=None, percentiles=(50, 99)):
    header = {"type": "header", "format": "inferd-bench-trace", "version": 1, "date": "d",
              "config": {"percentiles": list(percentiles), "goodput": goodput or {}}, "warnings": []}
    return [header, *records, {"type": "footer", "wall_ns": 10 ** 9, "cpu_ns": 0, "loop_lag_ns": []}]


def test_per_class_metrics_and_slo_attainment():
    recs = [rec(0, "chat", 100, 10), rec(1, "chat", 300, 10), rec(2, "chat", 120, 60),
            rec(3, "rag", 900, 5), rec(4, "rag", 0, 0, ok=False)]
    t = trace(recs, goodput={"ttft": 200, "tpot": 50})
    res = compute_result(t[0], recs, t[-1])
    # DistServe: both SLOs met -- only request 0 (1: TTFT too high, 2: TPOT, 3: TTFT, 4 failed)
    assert res["slo_attainment"] == pytest.approx(1 / 5)
    chat, rag = res["classes"]["chat"], res["classes"]["rag"]
    assert list(res["classes"]) == ["chat", "rag"]
    assert (chat["completed"], chat["failed"], rag["completed"], rag["failed"]) == (3, 0, 1, 1)
    assert chat["slo_attainment"] == pytest.approx(1 / 3) and rag["slo_attainment"] == 0
    assert chat["median_ttft_ms"] == pytest.approx(120) and chat["p99_ttft_ms"] == pytest.approx(120 + 180 * 0.98)
    assert chat["mean_tpot_ms"] == pytest.approx(80 / 3) and rag["p50_tpot_ms"] == pytest.approx(5)
    assert chat["p50_itl_ms"] == pytest.approx(10) and rag["mean_e2el_ms"] == pytest.approx(920)
    table = console_table(res)
    assert "SLO attainment (%):" in table and "Per request class (p50 / p99, ms)" in table
    assert "chat: 3 ok, 0 failed, SLO attainment 33.3%" in table and "rag: 1 ok, 1 failed" in table
    assert result_from_lines(trace_lines(t)) == res  # what `inferd bench report` recomputes

    plain = [rec(0, None, 100, 10)]
    res = compute_result(trace(plain)[0], plain, {})
    assert "classes" not in res and res["slo_attainment"] is None  # no classes, no --goodput


def sweep_doc(points, mode="rate"):
    pts = []
    for kind, value, att in points:
        res = {"completed": 4, "failed": 0, "request_throughput": 1.0, "slo_attainment": att}
        pts.append({"label": f"{kind}={value}", "kind": kind, "value": value,
                    "x": value if value != float("inf") else 50.0, "slo_attainment": att, "result": res})
    doc = {"format": SWEEP_FORMAT, "mode": mode, "sweep": "rate:...", "points": pts, "percentiles": [50, 99],
           "sla": None, "capacity": None, "load_label": "request rate (req/s)"}
    doc["goodput_rate"] = goodput_rate(pts)
    return doc


def test_goodput_rate_from_points():
    doc = sweep_doc([("rate", 1, 0.99), ("rate", 2, 0.95), ("rate", 4, 0.9), ("rate", 8, 0.5),
                     ("rate", float("inf"), 1.0)])
    assert doc["goodput_rate"] == 4  # attainment >= 0.9 is enough; inf is no rate
    assert goodput_rate(sweep_doc([("rate", 1, 0.89), ("rate", 2, 0.5)])["points"]) is None
    assert goodput_rate(sweep_doc([("rate", 1, None)])["points"]) is None  # no --goodput
    assert goodput_rate(sweep_doc([("concurrency", 4, 1.0)], "concurrency")["points"]) is None
    table = points_table(doc)
    assert "SLO %" in table and "goodput (DistServe: highest rate with SLO attainment >= 90%): 4 req/s" in table
    page = sweep_page(doc)
    assert "SLO attainment vs load" in page and "90 %" in page and "Goodput (DistServe" in page
    assert "SLO attainment vs load" not in sweep_page(sweep_doc([("rate", 1, None)]))


# -- trace replay ---------------------------------------------------------------------------------------
def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_mooncake_shared_hash_ids_are_shared_token_prefixes(tok, tmp_path):
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]},
            {"timestamp": 500, "input_length": 45, "output_length": 4, "hash_ids": [7, 8, 10]},
            {"timestamp": 1500, "input_length": 10, "output_length": 0, "hash_ids": [7]},
            {"timestamp": 1500, "input_length": 12, "output_length": 2}]
    path = write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows) + "\n")
    ps, warns = D.build_prompts("mooncake-trace", 10, tok, "1024", None, 0, path, block_size=16)
    ids = [tok.encode(p.prompt, add_special_tokens=False) for p in ps]
    assert [p.prompt_len for p in ps] == [len(i) for i in ids] == [40, 45, 10, 12]
    assert ids[0][:32] == ids[1][:32] and ids[0][32:] != ids[1][32:40]  # blocks 7, 8 shared; 9 vs 10 not
    assert ids[2] == ids[0][:10]  # block 7 cut to fit
    assert ps[0].prompt.startswith(ps[2].prompt)
    assert [p.output_len for p in ps] == [3, 4, 1, 2] and any("0 output tokens" in w for w in warns)
    assert [p.arrival_ns for p in ps] == [0, 500 * MS, 1500 * MS, 1500 * MS]
    fast, _ = D.build_prompts("mooncake-trace", 2, tok, "1024", "5", 0, path, block_size=16, speedup=4)
    assert [p.arrival_ns for p in fast] == [0, 125 * MS] and [p.output_len for p in fast] == [5, 5]
    other, _ = D.build_prompts("mooncake-trace", 1, tok, "1024", None, 1, path, block_size=16)
    assert other[0].prompt != ps[0].prompt  # the block tokens depend on the seed


def test_azure_timestamps_offsets_and_speedup(tmp_path):
    ts = D.parse_timestamp_ns
    assert ts("2023-11-16 18:15:46.6805900") - ts("2023-11-16 18:15:46") == 680_590_000
    assert ts("2023-11-17 00:00:00.0000001") - ts("2023-11-16 23:59:59.9999999") == 200  # across midnight
    assert ts("2023-11-16T18:15:46.123456789123") - ts("2023-11-16 18:15:46") == 123_456_789  # cut to ns
    assert ts("2023-11-16 19:15:46+01:00") == ts("2023-11-16 18:15:46Z") and ts(" 12.5 ") == 12_500_000_000
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:46.6805900,374,44\n\n"
                                    "2023-11-16 18:15:47.1805900,396,109\n"
                                    "2023-11-16 18:15:50.6805900,879,0\n")
    rows = D.read_azure(path)
    assert [(r.input_len, r.output_len, r.line) for r in rows] == [(374, 44, 2), (396, 109, 4), (879, 0, 5)]
    assert D.trace_offsets_ns(rows) == [0, 500 * MS, 4000 * MS]
    assert D.trace_offsets_ns(rows, 2.0) == [0, 250 * MS, 2000 * MS]
    cols = write(tmp_path, "b.csv", "GeneratedTokens,TIMESTAMP,ContextTokens\n7,2023-11-16 18:15:46.0,5\n")
    assert [(r.input_len, r.output_len) for r in D.read_azure(cols)] == [(5, 7)]  # columns by name


@pytest.mark.parametrize("name,text,where,needle", [
    ("m.jsonl", '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 5}\n',
     ":2:", "input_length"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n', ":1:", "needs 2"),
    ("m.jsonl", '{"timestamp": 9, "input_length": 4, "output_length": 1}\n'
                '{"timestamp": 3, "input_length": 4, "output_length": 1}\n', ":2:", "arrival order"),
    ("m.jsonl", 'not json\n', ":1:", "bad Mooncake trace row"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["x"]}\n', ":1:", "hash_ids"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,5,5\n2023-11-16 25:00:00,5,5\n",
     ":3:", "bad timestamp"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 18:15:46,5,5\n", ":2:", "day is out of range"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,many,5\n", ":2:", "ContextTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5\n", ":2:", "fields"),
    ("a.csv", "time,in,out\n1,2,3\n", ":1:", "header"),
])
def test_bad_trace_rows_are_one_line_errors(tmp_path, name, text, where, needle):
    path = write(tmp_path, name, text)
    with pytest.raises(InferdError) as e:
        D.read_mooncake(path) if name.endswith(".jsonl") else D.read_azure(path)
    msg = str(e.value)
    assert msg.startswith(path + where) and needle in msg and "\n" not in msg


def test_shipped_traces_are_what_the_generator_writes(tok):
    assert (D.TRACES_DIR / MOONCAKE_FILE).read_text() == mooncake_text()
    assert (D.TRACES_DIR / AZURE_FILE).read_text() == azure_text()
    rows = D.read_mooncake(D.default_trace_path("mooncake-trace"))
    azure = D.read_azure(D.default_trace_path("azure-trace"))
    assert len(rows) == len(azure) == 60
    for rs in (rows, azure):
        assert 50e9 < D.trace_offsets_ns(rs)[-1] < 70e9 and max(r.input_len for r in rs) > 1500
    firsts = [r.hash_ids[0] for r in rows]
    assert max(firsts.count(h) for h in set(firsts)) >= 5  # shared prefixes, for the prefix cache
    ps, warns = D.build_prompts("azure-trace", 3, tok, "1024", None, 0)  # no --dataset-path: the shipped one
    assert [p.prompt_len for p in ps] == [r.input_len for r in azure[:3]]
    assert any("first 3 of the 60 rows" in w for w in warns)


# -- end to end against the mock -------------------------------------------------------------------------
def bench(*args):
    return subprocess.run([sys.executable, "-m", "inferd", "bench", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def mock():
    proc, url = spawn_mock(5, 1, 8, tokens_per_chunk=2, boost=False)
    yield url
    proc.terminate()
    proc.wait(10)


def test_mixed_run_reports_classes_and_report_agrees(mock, tmp_path):
    res_json, res2, t = tmp_path / "r.json", tmp_path / "r2.json", tmp_path / "t.jsonl"
    r = bench("--base-url", mock, "--dataset", "mixed", "--mix", "chat:0.75:16:4,rag:0.25:64:2", "--num-prompts", "8",
              "--goodput", "ttft:5000", "tpot:1000", "--result-json", str(res_json), "--trace", str(t),
              "--no-progress")
    assert r.returncode == 0, r.stderr
    res = json.loads(res_json.read_text())
    assert res["slo_attainment"] == 1.0 and res["total_input_tokens"] == 6 * 16 + 2 * 64
    chat, rag = res["classes"]["chat"], res["classes"]["rag"]
    assert (chat["completed"], rag["completed"], chat["failed"] + rag["failed"]) == (6, 2, 0)
    assert chat["slo_attainment"] == rag["slo_attainment"] == 1.0 and chat["p99_ttft_ms"] > 0
    _, reqs, _ = read_trace(str(t))
    assert sorted(q["class"] for q in reqs) == ["chat"] * 6 + ["rag"] * 2
    assert all(q["prompt_len"] == (16 if q["class"] == "chat" else 64) and q["output_tokens"] == q["output_len"]
               for q in reqs)
    assert "Per request class" in r.stdout and "rag: 2 ok, 0 failed" in r.stdout
    r = bench("report", str(t), "--result-json", str(res2))
    assert r.returncode == 0 and json.loads(res2.read_text()) == res and "Per request class" in r.stdout


def test_trace_replay_sends_at_the_trace_times(mock, tmp_path):
    res_json, t = tmp_path / "r.json", tmp_path / "t.jsonl"
    r = bench("--base-url", mock, "--dataset", "mooncake-trace", "--num-prompts", "5", "--trace-speedup", "40",
              "--request-rate", "3", "--result-json", str(res_json), "--trace", str(t), "--no-progress")
    assert r.returncode == 0, r.stderr
    res = json.loads(res_json.read_text())
    assert res["completed"] == 5 and res["request_rate"] == "trace"
    assert any("--request-rate 3 is ignored" in w for w in res["warnings"])
    header, reqs, _ = read_trace(str(t))
    rows = D.read_mooncake(D.default_trace_path("mooncake-trace"))[:5]
    assert [q["sched_ns"] for q in reqs] == D.trace_offsets_ns(rows, 40.0)  # the schedule is the trace's
    assert [q["prompt_len"] for q in reqs] == [x.input_len for x in rows]
    assert [q["output_tokens"] for q in reqs] == [x.output_len for x in rows]
    assert header["config"]["trace_speedup"] == 40.0
    r = bench("--base-url", mock, "--dataset", "azure-trace", "--sweep", "rate:1,2")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--trace-speedup" in lines[0]


# -- chat workloads for speculative decoding (inferd.bench.workloads) ------------------------------

def test_speculation_workloads_are_reproducible_chats(tok):
    """Each workload: alternating user/assistant messages ending with the user, the same for the
    same seed and other for another; agent-loop quotes its tool output back, code-edit carries the
    file the answer copies; a chat endpoint is sent the messages, a completions one the transcript."""
    from inferd.bench.runner import request_body
    from inferd.bench.workloads import WORKLOADS, conversations

    for wl in WORKLOADS:
        ps, _ = D.build_prompts(wl, 6, tok, "1", None, seed=3)
        again, _ = D.build_prompts(wl, 6, tok, "1", None, seed=3)
        other, _ = D.build_prompts(wl, 6, tok, "1", None, seed=4)
        assert [p.messages for p in ps] == [p.messages for p in again] != [p.messages for p in other]
        for p in ps:
            roles = [m["role"] for m in p.messages]
            assert roles[-1] == "user" and all(a != b for a, b in zip(roles, roles[1:]))
            assert p.output_len == 160 and p.prompt_len == len(tok.encode(p.prompt))
            body = json.loads(request_body({"endpoint_type": "chat"}, p.prompt, p.output_len, p.messages))
            assert body["messages"] == p.messages
            assert json.loads(request_body({"endpoint_type": "completions"}, p.prompt, 8))["prompt"] == p.prompt
    turns = conversations("agent-loop", 3)
    assert [len(t) for t in turns] == [3, 5, 7]  # turns 2, 3 and 4 of one conversation
    listing = turns[0][2]["content"]
    assert "drwxr-xr-x" in listing and listing.split("\nWhich")[0] in turns[2][2]["content"]
    assert "def " in conversations("code-edit", 1)[0][0]["content"]

"""What the benchmark scripts record about what ran (issue #41): an engine's paths record
(inferd.engine.paths) and its place in the dashboard state, check_label refusing a row label whose
path did not run, llama.cpp's ISA options, and one script run end to end in its tiny mode."""
from __future__ import annotations

import json
import re

import pytest

from inferd.engine.engine import LLMEngine
from inferd.engine.paths import check_label
from inferd.engine.request import SamplingParams

W4A8_RECORD = {"engine": "inferd", "kernel_variant": "avx2", "dtype": "float32", "kv_dtype": "float32",
               "weight_formats": {"W4A8Linear": 120, "W8A8Linear": 1}, "lm_head": "W8A8Linear",
               "activations": "int8", "fused_built": True, "fused_steps": 131, "tensor_parallel_size": 1,
               "speculative_method": None, "draft": None}
BF16_RECORD = {**W4A8_RECORD, "dtype": "bfloat16", "kv_dtype": "bfloat16", "weight_formats": {"Linear": 121},
               "lm_head": "Linear", "activations": "bfloat16", "fused_built": False, "fused_steps": 0}


@pytest.mark.parametrize("label, record", [
    ("inferd gguf +lm_head W4A8/W8A8, fused decode", W4A8_RECORD),
    ("inferd int4 W4A8 fp32", W4A8_RECORD),
    ("inferd bf16 dense, eager", BF16_RECORD),
    ("inferd avx2 kernels", W4A8_RECORD),
    ("TP=1, 2 threads", W4A8_RECORD),
    ("plain decode", BF16_RECORD),
    ("llama.cpp Q4_1 (OMP active; AMX off)", {"engine": "llama.cpp", "amx": False}),
    ("llama.cpp without AMX (tile load faulted)", {"engine": "llama.cpp", "amx": False}),
    ("llama.cpp Q4_1 (OMP active; AMX on)", {"engine": "llama.cpp", "amx": True}),
    ("self-draft 10L k=3, draft int8", {**BF16_RECORD, "speculative_method": "draft",
                                         "draft": {"weight_formats": {"Int8Linear": 70}}}),
])
def test_check_label_passes_what_ran(label, record):
    check_label(label, record)


@pytest.mark.parametrize("label, record, claim", [
    ("inferd W4A8, fused decode", {**W4A8_RECORD, "fused_steps": 0}, "fused"),
    ("inferd gguf W4A8", BF16_RECORD, "W4A8"),
    ("inferd gguf +lm_head W4A8/W8A8", {**W4A8_RECORD, "weight_formats": {"W4A8Linear": 120, "Linear": 1}}, "W8A8"),
    ("inferd bf16", W4A8_RECORD, "bf16"),
    ("inferd fp32", BF16_RECORD, "fp32"),
    ("inferd W4A8 on AMX", W4A8_RECORD, "AMX"),
    ("inferd avx512_amx", W4A8_RECORD, "avx512_amx"),
    ("inferd +lm_head", BF16_RECORD, "+lm_head"),
    ("dense", W4A8_RECORD, "dense"),
    ("eager", W4A8_RECORD, "eager"),
    ("ngram k=4", BF16_RECORD, "ngram"),
    ("TP=2 shm", W4A8_RECORD, "tp=2"),
    ("llama.cpp Q4_1 (AMX on)", {"engine": "llama.cpp", "amx": False}, "AMX"),
    ("llama.cpp without AMX", {"engine": "llama.cpp", "amx": True}, "without AMX"),
    ("self-draft 10L k=3, draft int4", {**BF16_RECORD, "speculative_method": "draft",
                                         "draft": {"weight_formats": {"Int8Linear": 70}}}, "int4"),
    ("inferd fused", {}, "fused"),  # a record that cannot show it does not back it
])
def test_check_label_refuses_a_path_that_did_not_run(label, record, claim):
    with pytest.raises(ValueError, match=re.escape(repr(claim))):
        check_label(label, record)


def test_engine_state_reports_the_paths_that_ran(tiny_model):
    eng = LLMEngine(loaded=tiny_model, dtype="float32", num_kv_blocks=32, block_size=8)
    eng.add_request(list(range(1, 12)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    paths = eng.state()["paths"]
    json.dumps(paths)  # plain data: it crosses the engine-core boundary
    assert paths["weight_formats"] == {"Linear": 2 * 4 + 1} and paths["dense_weight_dtypes"] == ["float32"]
    assert paths["dtype"] == paths["kv_dtype"] == paths["activations"] == "float32"
    assert paths["fused_built"] is False and paths["fused_steps"] == 0  # a dense model has no fused step
    assert paths["steps"] == eng.stats.steps and paths["speculative_method"] is None
    assert paths["tensor_parallel_size"] == 1 and "kernel_variant" in paths
    check_label("tiny fp32 dense, eager", paths)
    with pytest.raises(ValueError):
        check_label("tiny W4A8, fused", paths)


# -- llama.cpp's ISA options (benchmarks/llamacpp.py: pure functions, fake /proc/cpuinfo flag sets) --

AVX2 = {"avx", "avx2", "fma", "f16c", "bmi2", "sse4_2"}
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni", "avx512_bf16"}
SPR = AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.fixture(scope="module")
def llamacpp():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import llamacpp

    return llamacpp


def test_llamacpp_amx_only_where_the_cpu_lists_it_and_the_kernel_grants_the_tile_state(llamacpp):
    assert llamacpp.amx_decision(AVX512, "auto", True) == (False, "AMX off: CPU has none")
    assert llamacpp.amx_decision(SPR, "auto", True) == (True, "AMX on")
    amx, why = llamacpp.amx_decision(SPR, "auto", False, "refused: Operation not supported")
    assert not amx and why.startswith("AMX off: the kernel refused the tile state") and "not supported" in why
    assert llamacpp.amx_decision(SPR, "off", True) == (False, "AMX off: INFERD_LLAMACPP_AMX=off")
    assert llamacpp.amx_decision(SPR, "faulted", True)[0] is False
    assert llamacpp.amx_decision(None, "auto", True) == (False, "AMX off: CPU has none")


def test_llamacpp_cpu_options_name_every_extension_the_cpu_runs(llamacpp):
    opts = llamacpp.cpu_options(SPR, amx=True)
    assert "-DGGML_NATIVE=OFF" in opts  # -march=native would switch AMX on whatever the kernel says
    for o in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{o}=ON" in opts
    assert "-DGGML_AVX_VNNI=OFF" in opts  # not listed by this CPU
    off = llamacpp.cpu_options(SPR, amx=False)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DGGML_AVX512=ON"} <= set(off)
    avx2 = llamacpp.cpu_options(AVX2, amx=False)
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    # avx512f alone is not ggml's AVX512 (it assumes cd, vl, dq and bw with it)
    assert "-DGGML_AVX512=OFF" in llamacpp.cpu_options(AVX2 | {"avx512f"}, amx=False)
    assert llamacpp.cpu_options(None, amx=False) == ["-DGGML_NATIVE=ON"]  # not x86 / no /proc/cpuinfo


def test_llamacpp_rows_say_which_isa_and_amx_state_ran(llamacpp):
    amx, why = llamacpp.amx_decision(AVX512, "auto", True)
    note = llamacpp.isa_note(llamacpp.cpu_options(AVX512, amx), why)
    assert note == "llama.cpp ISA: sse42 f16c fma bmi2 avx avx2 avx512 avx512_vnni avx512_bf16, AMX off: CPU has none"
    assert llamacpp.isa_note(llamacpp.cpu_options(SPR, True), "AMX on").endswith("avx512_bf16, AMX on")
    on = {"engine": "llama.cpp", "amx": True, "amx_faulted": False}
    off = {"engine": "llama.cpp", "amx": False, "amx_faulted": False}
    fault = {"engine": "llama.cpp", "amx": False, "amx_faulted": True}
    assert llamacpp.row_name(on) == "llama.cpp [AMX on]" and llamacpp.row_name(off, "llama-bench") == "llama-bench [AMX off]"
    assert llamacpp.row_name(fault) == "llama.cpp without AMX (tile load faulted)"
    for rec in (on, off, fault):
        check_label(llamacpp.row_name(rec) + " Q4_1 (OMP active)", rec)
    with pytest.raises(ValueError):
        check_label(llamacpp.row_name(on), off)


def test_llamacpp_retries_once_without_amx_after_a_tile_fault(llamacpp, monkeypatch):
    monkeypatch.setattr(llamacpp, "isa_choice", lambda: {"amx": llamacpp.os.environ.get(llamacpp.AMX_ENV) != "faulted"})
    monkeypatch.delenv(llamacpp.AMX_ENV, raising=False)
    calls, restarts = [], []

    def run():
        calls.append(llamacpp.os.environ.get(llamacpp.AMX_ENV))
        if len(calls) == 1:
            raise llamacpp.TileFault("SIGILL")
        return 42.0

    assert llamacpp.run_llamacpp(run, on_fault=lambda: restarts.append(1)) == 42.0
    assert calls == [None, "faulted"] and restarts == [1]
    with pytest.raises(llamacpp.TileFault):  # a fault without AMX is not retried
        llamacpp.run_llamacpp(lambda: (_ for _ in ()).throw(llamacpp.TileFault("SIGILL")))
    assert llamacpp.faulted(-4) and llamacpp.faulted(132) and not llamacpp.faulted(1) and not llamacpp.faulted(None)


# -- one benchmark end to end, in its tiny mode ---------------------------------------------------------

def test_quant_decode_tiny_records_the_paths_that_ran(default_gguf_path, tmp_path):
    """benchmarks/quant_decode.py --tiny: its JSON has the CPU, the setup, one row per contender and a
    paths record per inferd contender; the W4A8 row's record shows int8 activations and fused steps
    (the W4A8 config builds the fused decode step on every CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    from inferd.kernels import native

    if native.load() is None:
        pytest.skip("the native kernels did not build here (W4A8 needs them)")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "quant_decode.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "quant_decode.py"), "--tiny", "--json", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["cpu"] and doc["setup"]["rounds"].startswith("1,") and doc["setup"]["output tokens"] == 8
    w4a8 = "inferd gguf +lm_head W4A8/W8A8"
    assert set(doc["paths"]) == {"inferd fp32", w4a8}
    for label, p in doc["paths"].items():
        assert p["engine"] == "inferd" and p["kernel_variant"] == doc["paths"][w4a8]["kernel_variant"] is not None
        assert p["weight_formats"] and p["kv_dtype"] and isinstance(p["fused_steps"], int)
        check_label(label, p)
    fp32, q = doc["paths"]["inferd fp32"], doc["paths"][w4a8]
    assert fp32["weight_formats"] == {"Linear": 121} and fp32["kv_dtype"] == "float32" and fp32["fused_steps"] == 0
    assert q["activations"] == "int8" and q["activation_quant"] == "W4A8/W8A8"
    assert q["weight_formats"]["W4A8Linear"] > 0 and q["weight_formats"]["W8A8Linear"] == 1
    assert q["fused_built"] and 0 < q["fused_steps"] <= q["steps"]
    rows = {row["label"]: row for row in doc["rows"]}
    assert set(rows) == set(doc["paths"])
    for row in rows.values():  # the median of the rounds, with their spread: never a best-of
        assert row["metric"] == "batch-1 decode tok/s" and len(row["runs"]) == 1
        assert row["min"] <= row["median"] <= row["max"] and row["median"] > 0
    # the header printed the same record
    assert "paths that ran:" in r.stdout and f"{w4a8}: inferd kernels {q['kernel_variant']}" in r.stdout


def test_suffix_decode_tiny_reports_screening_ratios_and_paths(default_gguf_path, tmp_path):
    """benchmarks/suffix_decode.py --tiny: every contender on every workload and batch size, the
    loop screening per workload, ratios to plain decode and to prompt lookup, the suffix contender's
    record showing its cost model, and each label checked against its record."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "suffix.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "suffix_decode.py"), "--tiny", "--json", str(out)],
                       cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    labels = {"plain decode", "ngram k=8", "suffix k=16, cost model"}
    assert set(doc["paths"]) == labels
    sp = doc["paths"]["suffix k=16, cost model"]["speculative"]
    assert sp["method"] == "suffix" and sp["cost_model"] and sp["num_speculative_tokens"] == 16
    for label, p in doc["paths"].items():
        check_label(label, p)
    assert set(doc["screens"]) == {"code-edit", "low-rep-chat"}
    for s in doc["screens"].values():
        assert s["screened"] >= s["kept"] + s["looping"] and 0 <= s["mean_self_repeat"] <= 1
    rows = doc["rows"]
    assert {(r["workload"], r["batch"], r["label"]) for r in rows} == {
        (w, b, n) for w in doc["screens"] for b in (1, 2) for n in labels}
    for row in rows:
        assert row["median"] > 0 and len(row["runs"]) == 1
        if row["label"] == "plain decode":
            assert row["speedup_vs_plain"] == 1.0
        else:
            assert row["spec_num_verified_rows"] == row["spec_num_draft_tokens"] + row["spec_num_drafts"]
    assert "cost model: suffix k=16, cost model: 1:" in r.stdout and "/ngram" in r.stdout

"""What the benchmark scripts record about what ran (issue #41): an engine's paths record
(inferd.engine.paths) and its place in the dashboard state, check_label refusing a row label whose
path did not run, llama.cpp's ISA options, and one script run end to end in its tiny mode."""
from __future__ import annotations

import json
import re
from pathlib import Path

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

LONG_RECORD = {**BF16_RECORD, "attention": {"kernel": True, "decode_kernel_calls": 60, "split_decode_calls": 60,
                                            "tiled_prefill_calls": 30, "fallback_calls": 0, "fallback_why": None}}


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
    ("inferd bf16 dense, KV int8, tiled prefill, split decode", {**LONG_RECORD, "kv_dtype": "int8"}),
    ("inferd W4A8, bf16 KV", {**W4A8_RECORD, "kv_dtype": "bfloat16"}),
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
    ("inferd W4A8, KV int8", W4A8_RECORD, "kv int8"),  # the weights' int8 is not the cache's
    ("inferd bf16, int8 KV", {**LONG_RECORD, "kv_dtype": "bfloat16"}, "int8 kv"),
    ("inferd, tiled prefill", {**LONG_RECORD, "attention": {**LONG_RECORD["attention"], "tiled_prefill_calls": 0}},
     "tiled prefill"),
    ("inferd, split decode", {**LONG_RECORD, "attention": {**LONG_RECORD["attention"], "fallback_calls": 3}},
     "split decode"),
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
    a = paths["attention"]  # the prompt through the tiled prefill kernel, its decodes through the decode kernel
    if a["kernel"]:
        assert a["tiled_prefill_calls"] == 2 and a["decode_kernel_calls"] == 2 * 3 and a["fallback_calls"] == 0
        check_label("tiny fp32 KV, tiled prefill", paths)
    else:  # without the native kernels every layer call is the fallback's, and the record says why
        assert a["fallback_calls"] > 0 and a["fallback_why"]


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
    monkeypatch.setenv(llamacpp.AMX_ENV, "auto")  # recorded, so the "faulted" run_llamacpp sets is undone
    monkeypatch.delenv(llamacpp.AMX_ENV)
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


# -- every benchmark command the docs cite: it parses, and the headline ones run in their tiny mode ----

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/performance.md")
# the scripts of the README's headlines and the performance page's tables, each run by the suite in its
# --tiny mode on a tiny Q4_1 GGUF; the flag each takes the model file by
TINY = {"quant_decode.py": "--model", "serve_overhead.py": "--model", "llamacpp_server_bench.py": "--gguf",
        "engine_vs_hf.py": "--model", "spec_decode.py": "--model", "w4a8_gemm.py": None, "embeddings.py": None,
        "real_sizes.py": None, "suffix_decode.py": None,
        "decode_roofline.py": "--model", "long_context.py": None}
# run in their tiny mode by their own module's test, with that feature's checks
OWN_TEST = {"embeddings.py", "suffix_decode.py"}
# cited with a command but not run here: kv_tier.py (11 servers and 6 routers: its --tiny takes over a
# minute of two cores) and scheduling_bench.py (no number cited) have a --tiny the suite leaves to a
# person; llamacpp.py and llamacpp_decode.py are the competitor's build and run, llama.cpp itself; the
# rest are only listed in the performance page's table of scripts (their numbers are on other pages;
# gguf_repack.py's ops are held to the Python route by tests/test_repack.py)
NOT_RUN = {"kv_tier.py", "scheduling_bench.py", "llamacpp.py", "llamacpp_decode.py",
           "structured.py", "scale_out.py", "disaggregated.py", "tensor_parallel.py", "soak.py", "dashboard.py",
           "gguf_repack.py"}


def doc_commands(doc: str) -> list[tuple[str, list[str]]]:
    """(script, its arguments) for each inline code span of `doc` that runs a script in benchmarks/
    (a span may wrap onto the next line; an environment prefix such as OMP_WAIT_POLICY=... is dropped)."""
    import shlex

    text = (ROOT / doc).read_text()
    fenced = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    # a fenced block's lines are commands (and their # comments); elsewhere, inline spans
    spans = [line.split(" #")[0] for block in fenced for line in block.splitlines()]
    spans += re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    out = []
    for span in spans:
        m = re.search(r"(?:^|[\s/])([a-z0-9_]+\.py)(?=\s|$)(.*)", " ".join(span.split()))
        if m and (ROOT / "benchmarks" / m.group(1)).exists():
            out.append((m.group(1), shlex.split(m.group(2))))
    return out


def readme_headlines() -> list[tuple[str, list[str]]]:
    """The command of each row of the README's "Headline results" table ("the same" repeats the row
    above's)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Headline results"):].split("\n## ")[0]
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`") and ".py" in cells[2]:
            out.append(span_command(re.search(r"`([^`]+)`", cells[2]).group(1)))
        elif len(cells) == 3 and cells[2].startswith("the same") and out:
            out.append(out[-1])
    return out


def span_command(span: str) -> tuple[str, list[str]]:
    """`quant_decode.py --only W4A8` -> ("quant_decode.py", ["--only", "W4A8"])."""
    import shlex

    script, _, args = span.partition(" ")
    return script.rsplit("/", 1)[-1], shlex.split(args)


def bench_module(script: str):
    """benchmarks/`script` imported as a module (its siblings importable while it loads)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", ROOT / "benchmarks" / script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def parse_only(script: str, args: list[str]):
    """The namespace the script's own argument parser makes of `args`: its main() run up to
    parse_args() and stopped there (a command the parser refuses raises SystemExit)."""
    import argparse
    import sys

    class Parsed(Exception):
        pass

    mod = bench_module(script)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # main() may import a sibling
    real = argparse.ArgumentParser.parse_args

    def stop(self, a=None, namespace=None):
        raise Parsed(real(self, args, namespace))
    argparse.ArgumentParser.parse_args = stop
    try:
        mod.main()
    except Parsed as p:
        return p.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.path.remove(str(ROOT / "benchmarks"))
    raise AssertionError(f"{script}: main() never parsed its arguments")


def test_every_documented_benchmark_command_parses():
    """Each benchmark command the README and the performance page cite, as written, is one its
    script's parser accepts; and every script they cite is run in its tiny mode below or named in
    NOT_RUN with the reason."""
    cited = [(doc, *c) for doc in DOCS for c in doc_commands(doc)]
    assert len(cited) >= 10, cited  # the extraction found the commands (the two pages cite a dozen)
    for doc, script, args in cited:
        try:
            parse_only(script, args)
        except SystemExit as e:
            raise AssertionError(f"{doc}: `{script} {' '.join(args)}` does not parse ({e})") from None
    assert {s for _, s, _ in cited} <= set(TINY) | NOT_RUN, {s for _, s, _ in cited} - set(TINY) - NOT_RUN
    assert {s for s, _ in readme_headlines()} <= set(TINY)


@pytest.fixture(scope="module")
def tiny_q41_gguf(tmp_path_factory) -> str:
    """helpers.write_tiny_chat_gguf in Q4_1 blocks: the default model's formats (its matrices W4A8
    under gguf, its embedding's head W8A8), at a size that loads in a moment."""
    from gguf import GGMLQuantizationType
    from helpers import write_tiny_chat_gguf

    return write_tiny_chat_gguf(tmp_path_factory.mktemp("bench") / "tiny-q41.gguf", qtype=GGMLQuantizationType.Q4_1)


def run_tiny(script: str, model: str, tmp_path) -> tuple[dict, str]:
    """The command the docs cite for `script` (the README's headline where it has one), with --tiny,
    the tiny model and --json, in a subprocess whose temporary files (servers' logs) go to tmp_path;
    returns its JSON and stdout."""
    import os
    import subprocess
    import sys

    from inferd.kernels import native

    if native.load() is None:
        pytest.skip("the native kernels did not build here (the W4A8 rows need them)")
    args = dict(readme_headlines()).get(script)
    if args is None:
        args = next(a for doc in DOCS for s, a in doc_commands(doc) if s == script)
    out = tmp_path / "out.json"
    flag = [TINY[script], model] if TINY[script] else []
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--tiny", *flag, "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{script} {args}: exit {r.returncode}\n{r.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["cpu"] and doc["setup"] and doc["rows"], doc
    for label, p in doc["paths"].items():
        check_label(label, p)
    for row in doc["rows"]:
        if "runs" in row:  # the median of the rounds, with their spread: never a best-of
            assert row["min"] <= row["median"] <= row["max"] and len(row["runs"]) == 1, row
    return doc, r.stdout


@pytest.mark.parametrize("script", sorted(set(TINY) - {"quant_decode.py", "serve_overhead.py"} - OWN_TEST))
def test_cited_command_runs_in_its_tiny_mode(script, tiny_q41_gguf, tmp_path):
    """The documented command with --tiny: every table of it at tiny sizes, in one round; llama.cpp's
    parts (they need it built) left out, saying so."""
    doc, stdout = run_tiny(script, tiny_q41_gguf, tmp_path)
    if script == "llamacpp_server_bench.py":
        assert "--tiny: skipped llama-server" in stdout and set(doc["paths"]) == {"inferd auto"}
    if script == "engine_vs_hf.py":  # transformers ran beside inferd, on the same weights
        assert doc["setup"]["weights"].startswith("identical") and any(k.startswith("HF") for k in doc["paths"])
    if script == "spec_decode.py":
        assert {r["label"] for r in doc["rows"]} >= {"plain decode", "ngram k=4", "ngram k=8"}


def test_quant_decode_headline_runs_its_named_row(tiny_q41_gguf, tmp_path):
    """The README's batch-1 headline command with --tiny: the one 4-bit row it names beside the dense
    baselines, that row's ratios printed under its label; the batch, prefill and roofline tables at tiny
    sizes; llama.cpp left out, saying so. The W4A8 row's record shows int8 activations and fused steps."""
    doc, stdout = run_tiny("quant_decode.py", tiny_q41_gguf, tmp_path)
    w4a8 = "inferd gguf +lm_head W4A8/W8A8"
    headline = next(line for line in (ROOT / "README.md").read_text().splitlines() if "batch-1 decode" in line)
    assert f"`{w4a8}`" in headline  # the README names the row the command runs
    assert set(doc["paths"]) == {"inferd bf16", "inferd fp32", w4a8}
    assert doc["setup"]["rounds"].startswith("1,") and doc["setup"]["output tokens"] == 8
    fp32, q = doc["paths"]["inferd fp32"], doc["paths"][w4a8]
    assert fp32["weight_formats"] == {"Linear": 9} and fp32["kv_dtype"] == "float32" and fp32["fused_steps"] == 0
    assert q["activations"] == "int8" and q["activation_quant"] == "W4A8/W8A8"
    assert q["weight_formats"] == {"W4A8Linear": 8, "W8A8Linear": 1}
    assert q["fused_built"] and 0 < q["fused_steps"] <= q["steps"]
    metrics = {(r["label"], r["metric"]) for r in doc["rows"]}
    for label in doc["paths"]:
        assert {(label, "batch-1 decode tok/s"), (label, "batch-2 decode tok/s"),
                (label, "32-token prefill tok/s")} <= metrics
    assert f"\n{w4a8} = " in stdout and "vs inferd bf16:" in stdout and "of measured bandwidth:" in stdout
    assert "--tiny: skipped llama.cpp" in stdout and "paths that ran:" in stdout
    assert f"{w4a8}: inferd kernels {q['kernel_variant']}" in stdout


def test_serve_overhead_configs_load_one_model_on_both_sides(tiny_q41_gguf, tmp_path):
    """The README's serve-overhead command with --tiny: each config's server and offline engine ran
    the same weight formats (the dense config was once served `auto` against a dense offline engine,
    and the label check stopped the run at its end); a config without --quantization is refused."""
    doc, _ = run_tiny("serve_overhead.py", tiny_q41_gguf, tmp_path)
    configs = {"gguf W4A8 +lm_head": "W4A8Linear", "gguf": "Int4Linear", "dense (auto dtype)": "Linear"}
    for i, (label, fmt) in enumerate(configs.items()):
        # --tiny starts the in-process (thread) server for the first config only
        kinds = ("offline", "served (process)", "served (thread)")[:3 - (i > 0)]
        modes = [doc["paths"][f"{label}, {m}"] for m in kinds]
        assert all(m["weight_formats"] == modes[0]["weight_formats"] for m in modes), (label, modes)
        assert fmt in modes[0]["weight_formats"], (label, modes[0]["weight_formats"])
    with pytest.raises(SystemExit, match="names no --quantization"):
        bench_module("serve_overhead.py").load_options(["--dtype", "float32"])


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
    # the verify-cost curve: each depth's step of 1..3 rows (the context rounded up to whole blocks)
    assert set(doc["verify_cost"]) == {"64", "256"} and all(
        set(c) == {"1", "2", "3"} and min(c.values()) > 0 for c in doc["verify_cost"].values())
    assert "verify-cost curve" in r.stdout

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

"""The default `inferd serve` is the quantized fast path, measured by `inferd bench` (issue #8
must-show 4, issue #43 must-show 4).

The server runs the default model with no quantization flag, as `make run` does: `--quantization
auto` serves the GGUF from its own Q4_1 blocks with int8 activations (W4A8) and the file's Q8_0
output layer (W8A8). Proof that the fast path served, not a dense copy: the engine's state names
the layer classes (no dense linear), the fused decode step ran, and its greedy text equals the
offline engine's on the same configuration. `LLM(model=FILE)` takes the same default: the weight
formats of the offline engine equal the server's.
"""
import json
import subprocess
import sys

import httpx
import pytest

from helpers import wait_for_log


@pytest.fixture(scope="module")
def qserver(tmp_path_factory):
    from conftest import running_server

    log = tmp_path_factory.mktemp("qserve") / "serve.log"
    with running_server(["--max-num-seqs", "8", "--kv-cache-memory", "128MiB"], log) as url:
        yield url, log


def test_default_serve_runs_the_files_blocks_and_matches_offline(qserver):
    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams

    url, log = qserver
    prompt = "The capital of France is"
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    paths = httpx.get(url + "/v1/engine/state", timeout=10).json()["engines"][0]["paths"]
    # every linear is a packed integer kernel over the file's codes: 120 W4A8 (Q4_1) and the head (Q8_0)
    assert paths["weight_formats"] == {"W4A8Linear": 120, "W8A8Linear": 1}, paths
    assert paths["lm_head"] == "W8A8Linear" and paths["activations"] == "int8" and paths["dtype"] == "float32"
    assert paths["fused_built"] and paths["fused_steps"] > 0 and paths["eager_decode_steps"] == 0, paths
    wait_for_log(log.read_text, "gguf-native")
    # the Python API's default is the server's: `LLM()` on the same file, no quantization named
    from inferd.engine.paths import engine_paths

    with LLM(kv_cache_memory="64MiB") as llm:
        offline = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
        mine = engine_paths(llm.engine)
    assert served == offline.text
    for key in ("weight_formats", "lm_head", "activations", "dtype", "kv_dtype", "fused_built"):
        assert mine[key] == paths[key], (key, mine[key], paths[key])


def test_bench_measures_quantized_server(qserver, tmp_path):
    url, _ = qserver
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "bench", "--base-url", url, "--dataset", "random",
                        "--input-len", "32", "--output-len", "16", "--num-prompts", "8", "--max-concurrency", "4",
                        "--result-json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["total_output_tokens"] == 8 * 16
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0

"""A quantized model behind `inferd serve`, measured by `inferd bench` (issue #8, must-show 4).

The server runs the default GGUF with `--quantization gguf --quantize-lm-head` (the file's own Q4_1
blocks through the int4 kernel, the output layer in int8) in bf16. Proof that the quantized path
served, not a float fallback: the server logs the packed weight memory, and its greedy text equals
the offline engine's on the same quantized model.
"""
import json
import subprocess
import sys

import httpx
import pytest


@pytest.fixture(scope="module")
def qserver(default_gguf_path, tmp_path_factory):
    from conftest import running_server

    log = tmp_path_factory.mktemp("qserve") / "serve.log"
    with running_server(["--model", default_gguf_path, "--quantization", "gguf", "--quantize-lm-head",
                         "--dtype", "bfloat16", "--max-num-seqs", "8", "--kv-cache-memory", "128MiB"], log) as url:
        yield url, log


def test_quantized_serve_logs_packed_weights_and_matches_offline(qserver, default_gguf_path):
    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams
    from inferd.loading.loader import load_model

    url, log = qserver
    text = log.read_text()
    assert "gguf-native: int4 120 linears" in text and "lm_head int8" in text, text[-2000:]
    prompt = "The capital of France is"
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["text"]
    lm = load_model(default_gguf_path, dtype="bfloat16", quantization="gguf", quantize_lm_head=True)
    llm = LLM(loaded=lm, kv_cache_memory="64MiB")
    offline = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert served == offline.text


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

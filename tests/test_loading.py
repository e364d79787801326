"""The loading route (docs/development.md, "The loading route"): file -> plan -> skeleton -> method ->
layers, with no dense copy of a quantized weight anywhere on a GGUF's path, a guard that refuses
from the header, the dense fallback said and counted, and a context that fits its KV cache."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from inferd.errors import InferdError
from inferd.loading.loader import load_model


def test_a_quantized_load_never_reads_a_weight_dense(default_gguf_path, monkeypatch):
    """`auto` on the default model: every part of every projection is read as raw blocks; the only
    tensors dequantized at load are the one-dimensional ones (the norms)."""
    from inferd.loading import plan

    read = []
    real = plan.GGUFPart.dense

    def spy(self, dtype=torch.float32):
        read.append((self.name, self.shape))
        return real(self, dtype)

    monkeypatch.setattr(plan.GGUFPart, "dense", spy)
    lm = load_model(default_gguf_path, quantization="auto", with_tokenizer=False)
    assert read and all(len(shape) == 1 for _, shape in read), [r for r in read if len(r[1]) > 1][:3]
    assert lm.report["dense_fallback"] == {} and lm.report["weight_bytes"] < lm.report["file_bytes"]


def test_the_peak_of_a_block_load_stays_near_the_file(gemma_path):
    """Gemma 3 270M Q4_K_M (253 MB: a 262k-row table) loaded by default in a fresh process: its peak
    resident memory (mapped file pages counted) stays within 1.3x the file plus the interpreter and
    torch, where one dense fp32 copy of its weights alone would be 1.7 GB."""
    code = ("import json, resource, sys\nimport torch\nfrom inferd.loading.loader import load_model\n"
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
            "lm = load_model(sys.argv[1], quantization='auto', with_tokenizer=False)\n"
            "print(json.dumps({'base': base, **lm.report}))\n")
    r = subprocess.run([sys.executable, "-c", code, gemma_path], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    size = os.path.getsize(gemma_path)
    print(f"peak {rep['peak_rss_bytes'] / 2**20:.0f} MiB, imports {rep['base'] / 2**20:.0f} MiB, "
          f"file {size / 2**20:.0f} MiB, load {rep['load_seconds']:.1f} s")
    assert rep["peak_rss_bytes"] - rep["base"] <= 1.3 * size + (64 << 20)


def test_the_guard_refuses_a_load_that_cannot_fit(default_gguf_path):
    """From the header alone, before the skeleton: one line saying what it needs and which flag lowers it."""
    with pytest.raises(InferdError) as e:
        load_model(default_gguf_path, quantization="auto", kv_cache_memory="100000GiB", with_tokenizer=False)
    msg = str(e.value)
    assert "needs about" in msg and "lower --kv-cache-memory" in msg and "\n" not in msg


def test_a_type_without_a_kernel_is_one_line_and_a_count(tmp_path, caplog):
    """A projection stored F32 (no block kernel) beside quantized ones: served dense, said once per
    type, counted in the load report (and /v1/engine/state)."""
    from test_gguf import L, write_tiny_gguf

    from inferd import LLM

    path = write_tiny_gguf(tmp_path / "mixed.gguf")  # attn_output is F32 in every layer
    with caplog.at_level(logging.WARNING, logger="inferd"):
        llm = LLM(model=str(path), quantization="auto", kv_cache_memory="4MiB")
    lines = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert len(lines) == 1 and "F32" in lines[0], lines
    assert llm.engine.load_report["dense_fallback"] == {"F32": L}
    assert llm.engine.state()["load"]["dense_fallback"] == {"F32": L}


def test_the_load_is_on_the_served_metrics(tmp_path):
    """`inferd serve` on a file with an F32 projection in every layer: /metrics carries the dense
    fallback by type, the weights held and the load's peak; /v1/engine/state the same report."""
    import httpx
    from conftest import running_server
    from helpers import write_tiny_chat_gguf

    L = 2
    path = write_tiny_chat_gguf(tmp_path / "mixed.gguf", n_layers=L, types={"attn_output": "F32"})
    with running_server(["--model", str(path), "--kv-cache-memory", "4MiB"]) as base:
        metrics = httpx.get(base + "/metrics", timeout=30).text
        state = httpx.get(base + "/v1/engine/state", timeout=30).json()
    line = next(x for x in metrics.splitlines() if x.startswith("inferd:dense_fallback_layers{"))
    assert 'type="F32"' in line and float(line.split()[-1]) == L
    weights = next(x for x in metrics.splitlines() if x.startswith("inferd:model_weight_bytes{"))
    assert float(weights.split()[-1]) > 0
    load = state["load"] if "load" in state else state["engines"][0]["load"]
    assert load["dense_fallback"] == {"F32": L} and load["peak_rss_bytes"] > 0


def test_a_declared_context_is_clamped_to_the_kv_cache(default_gguf_path, caplog):
    """No --max-model-len: the model's context (8192) is clamped to the tokens the KV cache holds, in
    one line; an explicit one stays as given."""
    from inferd.engine.engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="inferd"):
        eng = LLMEngine(model=default_gguf_path, kv_cache_memory="8MiB")
    capacity = eng.num_kv_blocks * eng.config.block_size
    assert eng.max_model_len == capacity < eng.model_config.max_position_embeddings
    assert any("clamped" in r.getMessage() for r in caplog.records)
    eng2 = LLMEngine(model=default_gguf_path, kv_cache_memory="8MiB", max_model_len=4096)
    assert eng2.max_model_len == 4096

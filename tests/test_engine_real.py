"""The engine on the real default model (fp32) against the reference loop, and `inferd throughput`."""
import json
import subprocess
import sys

import pytest
from helpers import compare

from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.loading.loader import load_model
from inferd.engine.reference import reference_generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "In 1492, Columbus",
    "The three primary colors are",
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def real():
    return load_model(None, dtype="float32", quantization="none")


def test_real_model_engine_matches_reference(real):
    tok = real.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts += [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
                for q in ("What is 2+2?", "Name a fruit.")]
    eng = LLMEngine(loaded=real, max_num_batched_tokens=32, block_size=16, kv_cache_memory="64MiB")
    eng.keep_history = True
    rids = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=0)) for p in prompts]
    reqs = {r: eng.requests[r] for r in rids}
    while eng.has_unfinished():
        eng.step()
    refs = [reference_generate(real.model, p, 24, eos_ids=eng.eos_ids, keep_logits=True) for p in prompts]
    near = compare([reqs[rid].output_ids for rid in rids], [(r.token_ids, r.logits) for r in refs], max_ties=2)
    assert eng.stats.max_prefill_chunks >= 2 and eng.stats.max_batch_seqs >= 8
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    print("near ties:", near)


@pytest.mark.slow
def test_throughput_cli(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "inferd", "throughput", "--num-prompts", "12", "--input-len", "8-40",
                        "--output-len", "4-12", "--ignore-eos", "--dtype", "float32", "--max-num-seqs", "8",
                        "--kv-cache-memory", "64MiB", "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Output tokens/s" in r.stdout
    res = json.loads(out.read_text())
    assert res["num_requests"] == 12 and res["max_batch_seqs"] == 8
    assert 12 * 4 <= res["total_output_tokens"] <= 12 * 12
    assert res["output_throughput"] > 0 and res["mean_ttft_ms"] > 0


@pytest.mark.slow
def test_throughput_bad_range():
    r = subprocess.run([sys.executable, "-m", "inferd", "throughput", "--input-len", "9-3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "input-len" in r.stderr and "Traceback" not in r.stderr

"""W4A8/W8A8 (`--quantize-activations`): int4 or int8 weights times activations rounded to int8 per 32-block.

The oracle for the kernel is torch: round x the documented way (`fake_quant_activations`), then
multiply by the dequantized weights in fp32. The model-level tests check that the rewrite really
happened (every int4 layer is a W4A8 one) and that the engine on top stays lossless: batching,
chunking and paging give the reference loop's greedy tokens on the same W4A8 model.
"""
import pytest
import torch

from inferd.errors import InferdError
from inferd.quant import dequantize_int4, quantize, quantize_int4
from inferd.quant import w4a8


def test_kernel_builds():
    assert w4a8.load() is not None  # the project installs a compiler; no silent skip of the rest


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])
def test_kernel_equals_rounded_x_times_dequantized_w(group, rows):
    torch.manual_seed(rows)
    N, K = 96, 192
    q, s, z = quantize_int4(torch.randn(N, K), group)
    lin = w4a8.W4A8Linear(q, s, z, group, None, torch.float32)
    x = torch.randn(rows, K) * 3
    xr = w4a8.fake_quant_activations(x)
    assert torch.equal(lin.kernel.fake_quant(x), xr)  # the C++ rounding is torch's, bit for bit
    assert (xr != x).any()  # and it really rounds
    want = xr @ dequantize_int4(q, s, z, group).t()
    torch.testing.assert_close(lin(x), want, atol=1e-4, rtol=1e-5)
    xb = x.bfloat16()  # bf16 in: rounded from its own values, out in bf16
    want_b = w4a8.fake_quant_activations(xb) @ dequantize_int4(q, s, z, group).t()
    got_b = lin(xb)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), want_b, atol=0.05, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_w8a8_kernel_equals_rounded_x_times_dequantized_w(rows):
    from inferd.quant import Int8Linear, quantize_int8

    torch.manual_seed(rows)
    from inferd.quant.linear import dequantize_int8

    q, sc = quantize_int8(torch.randn(72, 128))  # Q8_0's form: a scale per 32-block
    lin = w4a8.W8A8Linear(q, sc, None, torch.float32)
    x = torch.randn(rows, 128) * 3
    want = w4a8.fake_quant_activations(x) @ dequantize_int8(q, sc).t()
    torch.testing.assert_close(lin(x), want, atol=1e-4, rtol=1e-5)
    # the rewrite takes an Int8Linear's own buffers
    from torch import nn
    holder = nn.Module()
    holder.lin = Int8Linear(q, sc, None, torch.float32)
    holder.dtype = torch.float32
    assert w4a8.quantize_activations(holder) == 1 and isinstance(holder.lin, w4a8.W8A8Linear)
    torch.testing.assert_close(holder.lin(x), want, atol=1e-4, rtol=1e-5)


def test_rounding_is_per_32_block():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32] = 127.0, 0.4, 1.0  # block 0: step 1.0; block 1: step 1/127
    r = w4a8.fake_quant_activations(x)
    assert r[0, 0] == 127 and r[0, 1] == 0 and r[0, 32] == 1.0


def _w4a8_tiny(**over):
    from conftest import make_tiny_model

    lm = make_tiny_model(**over)
    quantize(lm.model, "int4", group_size=32, include_lm_head=True)
    n = w4a8.quantize_activations(lm.model)  # run eagerly here (tests/test_fused_decode.py: fused)
    return lm, n


def test_rewrite_covers_every_int4_layer():
    lm, n = _w4a8_tiny()
    assert n == 4 * lm.config.num_hidden_layers + 1
    kinds = {type(m).__name__ for m in lm.model.modules()}
    assert "W4A8Linear" in kinds and "Int4Linear" not in kinds
    with pytest.raises(InferdError, match="packed"):
        w4a8.quantize_activations(lm.model)  # nothing packed left: a clear error, not a silent no-op


def test_engine_on_w4a8_model_gives_reference_greedy_tokens():
    """Lossless machinery on top of a lossy model: a batch of 24 mixed requests, chunked prefill and
    paging, against the reference loop on the same W4A8 weights. Every row of every step goes through
    the same integer GEMM (batch-invariant), but paged and contiguous attention sum in different
    orders, and a last-bit difference there can flip one activation's int8 rounding. So the near-tie
    rule is 1e-2 here, not 1e-4."""
    from helpers import compare, make_requests, run_engine

    from inferd.engine.reference import reference_generate

    lm, _ = _w4a8_tiny()
    reqs = make_requests(seed=3, n=24)
    outs, eng = run_engine(lm, reqs, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=700)  # no leaks
    assert eng.stats.max_batch_seqs >= 8  # a real batch went through the kernel's multi-row path
    refs = [reference_generate(lm.model, prompt, n, keep_logits=True) for prompt, n in reqs]
    compare(outs, [(r.token_ids, r.logits) for r in refs], gap=1e-2, max_ties=2)


def test_loader_flags_and_errors():
    from inferd.loading.loader import load_model

    lm = load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantization="int4",
                    quantize_lm_head=True, quantize_activations=True)
    assert lm.model.dtype == torch.float32  # auto dtype: the kernel takes fp32, no bf16 glue on AVX2
    assert type(lm.model.lm_head).__name__ == "W4A8Linear"
    lm = load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantization="int8",
                    quantize_activations=True)
    assert type(lm.model.layers[0].qkv_proj).__name__ == "W8A8Linear"
    with pytest.raises(InferdError, match="quantized weights"):
        load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantize_activations=True)


def test_default_model_w4a8_engine_matches_its_reference_loop(default_gguf_path):
    """The real model: gguf's own Q4_1 blocks (W4A8) and its int8 lm_head (W8A8), served by the engine."""
    from helpers import compare

    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams
    from inferd.loading.loader import load_model
    from inferd.engine.reference import reference_generate

    lm = load_model(default_gguf_path, quantization="gguf", quantize_lm_head=True, quantize_activations=True)
    assert type(lm.model.layers[0].gate_up_proj).__name__ == "W4A8Linear"
    assert type(lm.model.lm_head).__name__ == "W8A8Linear"
    prompt = lm.tokenizer.encode("The capital of France is")
    ref = reference_generate(lm.model, prompt, 12, keep_logits=True)
    got = LLM(loaded=lm, kv_cache_memory="32MiB").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    compare([got.token_ids], [(ref.token_ids, ref.logits)], gap=1e-2, max_ties=1)  # the W4A8 rule (above)
    assert "Paris" in lm.tokenizer.decode(got.token_ids)


def test_eval_rejects_a8_without_quantized_weights():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "inferd", "eval", "--quantization", "none+a8", "--windows", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "quantized weights" in r.stderr and "Traceback" not in r.stderr


def test_a_512_token_prefill_runs_the_integer_gemm_and_copies_no_weights(default_gguf_path):
    """The quantized model's prefill: one 512-token chunk goes through the integer GEMM in one call
    per linear (every row of it), and no step makes a dequantized copy of any layer."""
    from inferd.engine.engine import LLMEngine
    from inferd.engine.request import SamplingParams
    from inferd.loading.loader import load_model

    lm = load_model(default_gguf_path, quantization="gguf", quantize_lm_head=True, quantize_activations=True,
                    with_tokenizer=False)
    L = lm.model.cfg.num_hidden_layers
    eng = LLMEngine(loaded=lm, kv_cache_memory="64MiB", max_num_batched_tokens=512, enable_prefix_caching=False)
    prompt = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    calls, rows = torch.ops.inferd.gemm_counters()
    copies = w4a8.dequantized_copies
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    after_calls, after_rows = torch.ops.inferd.gemm_counters()
    assert after_calls - calls == 4 * L + 1  # four linears a layer, one chunk, and the lm_head
    assert after_rows - rows == 4 * L * 512 + 1  # every prompt row; the lm_head only the last position
    assert w4a8.dequantized_copies == copies


def test_the_tied_embedding_is_read_in_place_from_the_file(default_gguf_path):
    """A tied GGUF model's embedding is the file's own Q8_0 table, read in place (its rows dequantized
    at lookup, exactly gguf's own values); the W8A8 head holds the one copy the kernel needs, and the
    model's weights come to under half of dense bf16's."""
    import numpy as np
    from gguf import GGUFReader, quants

    from inferd.loading.loader import load_model
    from inferd.quant import weight_bytes
    from inferd.model.gguf_embedding import GGUFEmbedding

    lm = load_model(default_gguf_path, quantization="gguf", quantize_lm_head=True, quantize_activations=True,
                    with_tokenizer=False)
    assert isinstance(lm.model.embed_tokens, GGUFEmbedding) and isinstance(lm.model.lm_head, w4a8.W8A8Linear)
    t = next(t for t in GGUFReader(default_gguf_path).tensors if t.name == "token_embd.weight")
    ids = torch.tensor([[0, 1, 49151], [31, 32, 12345]])
    want = np.asarray(quants.dequantize(t.data[ids.flatten().numpy()], t.tensor_type), dtype=np.float32)
    assert torch.equal(lm.model.embed_tokens(ids), torch.from_numpy(want).view(2, 3, -1))
    dense = load_model(default_gguf_path, dtype="bfloat16", with_tokenizer=False)
    assert weight_bytes(lm.model) <= 0.5 * weight_bytes(dense.model), (weight_bytes(lm.model), weight_bytes(dense.model))

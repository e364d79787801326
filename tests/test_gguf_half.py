"""GGUF F16 and BF16 tensors kept in their 16 bits (inferd.quant.half, csrc/cpu/half_gemm_impl.h): the
kernel is the dequantized weights' product up to the order of the sums, the same floats on every ISA
variant and batch; a file of either type serves from them by default (--quantization auto) in about
the file's bytes, with the dense model's greedy tokens."""
from __future__ import annotations

import pytest
import torch
from helpers import check_on_every_variant, compare, tp_greedy

from inferd.kernels import native
from inferd.quant.half import HalfLinear

pytestmark = pytest.mark.skipif(native.ops() is None, reason="no native kernels")

ROWS = (1, 2, 7, 16, 33, 128, 512)
# |kernel - exact| <= TOL * (|x| @ |W|^T): fp32 sums of 528 products in another order
TOL = 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_on_every_variant_and_batch(dtype):
    N, K = 83, 528  # 83: 20 tiles of 4 columns and 3 left over; 528 = 33 x 16
    g = torch.Generator().manual_seed(0)
    w = (0.1 * torch.randn(N, K, generator=g)).to(dtype)
    x = torch.randn(max(ROWS), K, generator=g)
    exact = (x.double() @ w.double().T).float()
    check_on_every_variant(HalfLinear(w, None, torch.float32), x, exact, x.abs() @ w.float().abs().T, TOL, ROWS[:-1])


def test_bad_shapes_are_one_line_errors():
    from inferd.errors import InferdError

    with pytest.raises(InferdError, match="multiple of 16"):
        HalfLinear(torch.zeros(4, 40, dtype=torch.float16), None, torch.float32)
    with pytest.raises(InferdError, match="float16 or bfloat16"):
        HalfLinear(torch.zeros(4, 32), None, torch.float32)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.inferd.half_linear(torch.zeros(2, 32), torch.zeros(4, 48, dtype=torch.float16))


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_16_bit_file_serves_from_its_own_bits(tmp_path, qtype):
    """A bare load (--quantization auto) of an F16 / BF16 file: every projection and the head are
    HalfLinear, the embedding reads the file's table in place, the weights held are the file's
    bytes (the dense model holds twice them), decode steps ran fused through the kernel, and the
    greedy tokens are the dense model's reference loop's (fp32 both: a token may differ only where
    the reference's top-2 logits are within 1e-4)."""
    from gguf import GGMLQuantizationType as Q
    from helpers import write_tiny_chat_gguf

    from inferd import LLM, SamplingParams
    from inferd.engine.paths import weight_formats
    from inferd.engine.reference import reference_generate
    from inferd.gguf_file import open_gguf
    from inferd.loading.loader import load_model
    from inferd.model.gguf_embedding import GGUFEmbedding
    from inferd.quant.linear import weight_bytes

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_chat_gguf(path, qtype=Q[qtype])
    lm = load_model(str(path), quantization="auto", with_tokenizer=False)
    dense = load_model(str(path), quantization="none", dtype="float32", with_tokenizer=False)
    assert weight_formats(lm.model) == {"HalfLinear": 9}, weight_formats(lm.model)
    assert lm.model.dtype == torch.float32
    assert isinstance(lm.model.embed_tokens, GGUFEmbedding)  # the file's own table, read in place
    file_bytes = sum(int(t.n_bytes) for t in open_gguf(str(path)).tensors)
    assert weight_bytes(lm.model) <= 1.01 * file_bytes and weight_bytes(dense.model) > 1.9 * file_bytes

    prompts = [[1, 5, 9, 300, 7], [2, 44, 81], list(range(10, 40))]
    llm = LLM(loaded=lm, kv_cache_memory="16MiB")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng = llm.engine
    assert eng.stats.fused_steps > 0 and eng.stats.eager_decode_steps == 0, eng.stats
    assert eng.stats.max_batch_seqs >= 2
    refs = [reference_generate(dense.model, p, 12, keep_logits=True) for p in prompts]  # eos_ids=(): never stops
    compare([o.token_ids for o in outs], [(r.token_ids, r.logits) for r in refs], max_ties=1)


def test_tensor_parallelism_splits_16_bit_layers(tmp_path):
    """TP=2 over an F16 file's HalfLinear layers (cut by rows and columns like any float weight; the
    tied 16-bit table split by vocabulary): the dense model's greedy tokens at TP=1 and TP=2, under
    the near-tie rule."""
    from gguf import GGMLQuantizationType as Q
    from helpers import write_tiny_chat_gguf

    from inferd.engine.reference import reference_generate
    from inferd.loading.loader import load_model

    path = str(tmp_path / "tiny-F16.gguf")
    write_tiny_chat_gguf(path, qtype=Q.F16)
    prompts = [[1, 5, 9, 300, 7], list(range(10, 40))]
    got = {tp: tp_greedy(path, tp, prompts, 10, {"HalfLinear": 9}) for tp in (1, 2)}
    dense = load_model(path, quantization="none", dtype="float32", with_tokenizer=False).model
    refs = [reference_generate(dense, p, 10, keep_logits=True) for p in prompts]
    for tp in (1, 2):
        compare(got[tp], [(r.token_ids, r.logits) for r in refs], max_ties=1, what=f"TP={tp}")

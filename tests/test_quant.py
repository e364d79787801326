"""Weight-only quantization: each packed linear against its dequantized float equivalent."""
import pytest
import torch

from inferd.quant import (Int4Linear, Int8Linear, dequantize_int4, hand_over, quantize, quantize_int4,
                          quantize_int8, weight_bytes)
from inferd.quant.linear import dequantize_int8


@pytest.fixture
def w():
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_dequantized(w, rows, dtype):
    """int8 is Q8_0's form, one scale per 32-block, on inferd's panel kernel; int8-gptq's per-row
    form on PyTorch's. Both against their dequantized weights."""
    for block in (32, None):
        q, s = quantize_int8(w, block=block)
        deq = dequantize_int8(q, s)
        assert q.dtype == torch.int8 and (deq - w).abs().max() <= s.max() / 2 + 1e-6
        assert s.shape == ((96, 4) if block else (96,))
        lin = Int8Linear(q, s, None, dtype)
        x = torch.randn(rows, 128)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
        torch.testing.assert_close(lin(x.to(dtype)).float(), x.to(dtype).float() @ deq.t(), **tol)


def test_block_int8_is_closer_than_per_row(w):
    w = w * torch.logspace(-2, 0, 128)  # columns of very different magnitudes, as in real layers
    err = {b: (dequantize_int8(*quantize_int8(w, block=b)) - w).pow(2).mean() for b in (32, None)}
    assert err[32] < 0.5 * err[None]


def test_the_int8_block_scale_search():
    """Per 32-block the least-squares scale among amax / 127 and the 16-level spacing's fractions:
    never worse than round-to-nearest's, Q8_0 weights kept exactly, 4-bit weights far closer."""
    from inferd.kernels import native as native_kernels
    from inferd.quant.linear import _best_block_scale

    assert native_kernels.load() is not None

    g = torch.Generator().manual_seed(3)

    def err(w, s):
        q = torch.round(w / s[..., None]).clamp(-127, 127)
        return (q * s[..., None] - w).pow(2).sum(-1)

    def rtn_scale(w):
        return (w.abs().amax(-1) / 127).clamp(min=2**-24).half().float()

    # weights on a Q4_1 grid (what the default model's file holds): d * q + m, q in 0..15
    d = torch.rand(64, 18, 1, generator=g) * 0.02 + 1e-3
    m = -(torch.rand(64, 18, 1, generator=g) * 10 + 2) * d
    grid = (torch.randint(0, 16, (64, 18, 32), generator=g).float() * d + m).half().float()
    gauss = torch.randn(64, 18, 32, generator=g)
    for w, most in ((grid, 0.6), (gauss, 1.0)):
        s = _best_block_scale(w)
        native = torch.ops.inferd.int8_block_scales(w.reshape(64, -1))  # the same search, one block at a time
        differ = native != s  # only where two candidates' errors tie within the sums' rounding
        assert differ.float().mean() < 0.01
        torch.testing.assert_close(err(w, native)[differ], err(w, s)[differ], rtol=1e-5, atol=0)
        assert s.dtype == torch.float32 and torch.equal(s, s.half().float())  # fp16 scales, as Q8_0's
        assert (torch.round(w / s[..., None]).abs() <= 127).all()  # no clipping
        assert (err(w, s) <= err(w, rtn_scale(w))).all()
        assert err(w, s).sum() <= most * err(w, rtn_scale(w)).sum()
    # Q8_0 weights: round-to-nearest is exact, and the search keeps it
    q8 = torch.randint(-127, 128, (64, 18, 32), generator=g).float()
    q8[..., 0] = 127
    sc = (torch.rand(64, 18, generator=g) * 0.01 + 1e-4).half().float()
    q, s = quantize_int8((q8 * sc[..., None]).reshape(64, -1))
    assert torch.equal(s, sc) and torch.equal(q.float(), q8.reshape(64, -1))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_equals_dequantized(w, group):
    q, s, z = quantize_int4(w, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    deq = dequantize_int4(q, s, z, group)
    assert (deq - w).abs().max() <= s.max() / 2 + 1e-5  # round to nearest: half a step at most
    bias = torch.randn(96)
    lin = Int4Linear(q, s, z, group, bias, torch.float32)
    x = torch.randn(7, 128)
    torch.testing.assert_close(lin(x), x @ deq.t() + bias, atol=1e-4, rtol=1e-4)


def test_int4_bf16_activations_close(w):
    q, s, z = quantize_int4(w, 32)
    lin = Int4Linear(q, s, z, 32, None, torch.bfloat16)
    x = torch.randn(3, 128).bfloat16()
    ref = x.float() @ dequantize_int4(q, s, z, 32).t()
    assert ((lin(x).float() - ref).abs().max() / ref.abs().max()) < 0.02


def test_group_size_must_divide():
    from inferd.errors import InferdError

    with pytest.raises(InferdError, match="group size"):
        quantize_int4(torch.randn(8, 576), 128)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_is_packed_and_generates(method, tiny_model):
    from conftest import make_tiny_model
    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams

    lm = make_tiny_model()
    lm.model.to(torch.bfloat16)
    lm.model.rope.inv_freq = lm.model.rope.inv_freq.float()
    bf16_linear_bytes = sum(l.weight.numel() * 2 for layer in lm.model.layers
                            for l in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    # group 64: nibbles 0.25x plus fp32 scale+min per group (8 bytes / 128) = 0.31x as inferd's codes;
    # handed to PyTorch's kernel, bf16 scale+zero (4 bytes / 128) = 0.28x. Never both at once.
    quantize(lm.model, method, group_size=64)
    layer = lm.model.layers[0]
    cls = Int8Linear if method == "int8" else Int4Linear
    assert all(isinstance(getattr(layer, n), cls) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))

    def linear_bytes():
        return sum(b.numel() * b.element_size() for layer in lm.model.layers
                   for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                   for b in getattr(layer, n).buffers() if b is not None)

    limit = 0.32 if method == "int4" else 0.55
    assert linear_bytes() <= limit * bf16_linear_bytes, (linear_bytes(), bf16_linear_bytes)
    hand_over(lm.model)
    limit = 0.29 if method == "int4" else 0.55
    assert linear_bytes() <= limit * bf16_linear_bytes, (linear_bytes(), bf16_linear_bytes)
    assert weight_bytes(lm.model) > 0
    llm = LLM(loaded=lm, kv_cache_memory="16MiB")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8


def random_q4k_bytes(rows: int, cols: int, seed: int = 0):
    """Q4_K blocks as any file may hold them (the `gguf` package has no Q4_K quantizer): random codes,
    scales and mins, with finite fp16 super-block scales d and dmin."""
    import numpy as np

    rng = np.random.default_rng(seed)
    blk = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blk[..., 0:4] = rng.uniform(1e-3, 0.05, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    return blk.reshape(rows, -1)


@pytest.mark.parametrize("qt_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_roundtrip_bit_exact(tmp_path, qt_name):
    """Our int4 layout of a GGUF block dequantizes to exactly what `gguf` dequantizes (fp32)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter, quants

    from inferd.quant.gguf_layer import GROUP, int4_blocks

    qt = getattr(Q, qt_name)
    cols = 512
    w = np.random.default_rng(0).standard_normal((16, cols)).astype(np.float32)
    wr = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    wr.add_tensor("x", random_q4k_bytes(16, cols) if qt_name == "Q4_K" else quants.quantize(w, qt), raw_dtype=qt)
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
    t = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    q, s, z = int4_blocks(t)
    want = torch.from_numpy(np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(16, cols))
    assert torch.equal(dequantize_int4(q, s, z, GROUP), want)
    lin = Int4Linear(q, s, z, GROUP, None, torch.float32)
    x = torch.randn(4, cols)
    torch.testing.assert_close(lin(x), x @ want.t(), atol=1e-4, rtol=1e-4)


def test_gguf_native_on_default_model_matches_dequantized():
    """fp32 activations: the file's own blocks through the int4 kernel give the dequantized model's logits."""
    from inferd.model.layers import ContiguousKV
    from inferd.loading.loader import load_model

    ref = load_model(None, dtype="float32", with_tokenizer=False)
    g = load_model(None, dtype="float32", with_tokenizer=False, quantization="gguf")
    assert isinstance(g.model.layers[0].qkv_proj, Int4Linear) and isinstance(g.model.layers[29].down_proj, Int4Linear)
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 2, 99])
    pos = torch.arange(len(ids))
    outs = []
    for lm in (ref, g):
        c = ContiguousKV(lm.config, 16, torch.float32, torch.device("cpu"))
        c.set_positions(pos)
        with torch.no_grad():
            outs.append(lm.model.compute_logits(lm.model(ids, pos, c)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_auto_dtype_with_packed_weights_is_bf16_on_cpu():
    """--dtype auto + a packed method: bf16 activations on any CPU (fp32 ones take the kernels' slow
    path); an explicit --dtype float32 is kept."""
    from inferd.loading.loader import load_model

    lm = load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantization="int8")
    assert lm.model.dtype == torch.bfloat16
    lm = load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantization="int8", dtype="float32")
    assert lm.model.dtype == torch.float32


def test_q8_0_blocks_serve_as_int8_and_w8a8(tmp_path):
    """A GGUF written all in Q8_0 (tiny Llama weights): `--quantization gguf` keeps every Linear in
    the file's own codes and fp16 block scales (int8; W8A8 with --quantize-activations), which
    dequantize bit-exactly to what `gguf` dequantizes; the logits stay the dense model's."""
    import numpy as np
    import transformers
    from gguf import GGMLQuantizationType as Q, GGUFReader, quants
    from hf_to_gguf import write_gguf

    from inferd.loading.loader import load_model
    from inferd.model.layers import ContiguousKV
    from inferd.quant.gguf_layer import q8_blocks
    from inferd.quant.linear import Int8Linear, dequantize_int8
    from inferd.quant.w4a8 import W8A8Linear

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_gguf(transformers.LlamaForCausalLM(cfg), tmp_path / "q8.gguf", "llama", qtype=Q.Q8_0)
    t = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    q, s = q8_blocks(t)
    want = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(q.shape)
    assert torch.equal(dequantize_int8(q, s), torch.from_numpy(want))
    ref = load_model(path, dtype="float32", with_tokenizer=False)
    ids = torch.arange(12) * 7
    pos = torch.arange(12)

    def logits(lm):
        c = ContiguousKV(lm.config, 16, torch.float32, torch.device("cpu"))
        c.set_positions(pos)
        with torch.no_grad():
            return lm.model.compute_logits(lm.model(ids, pos, c))

    want = logits(ref)
    for acts, kind in ((False, Int8Linear), (True, W8A8Linear)):
        lm = load_model(path, dtype="float32", with_tokenizer=False, quantization="gguf", quantize_activations=acts)
        assert all(isinstance(getattr(x, n), kind) for x in lm.model.layers
                   for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        torch.testing.assert_close(logits(lm), want, atol=2e-2 if acts else 1e-4, rtol=0)

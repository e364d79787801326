"""Weight-only quantization: each packed linear against its dequantized float equivalent."""
import pytest
import torch

from inferd.quant import (Int4Linear, Int8Linear, dequantize_int4, quantize, quantize_int4, quantize_int8,
                          weight_bytes)


@pytest.fixture
def w():
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0))


def test_int8_linear_equals_dequantized(w):
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and (q.float() * s[:, None] - w).abs().max() <= s.max() / 2 + 1e-6
    lin = Int8Linear(q, s, None, torch.float32)
    x = torch.randn(5, 128)
    torch.testing.assert_close(lin(x), x @ (q.float() * s[:, None]).t(), atol=1e-4, rtol=1e-4)


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
    from inferd.engine.engine import LLM
    from inferd.engine.request import SamplingParams

    lm = make_tiny_model()
    lm.model.to(torch.bfloat16)
    lm.model.rope.inv_freq = lm.model.rope.inv_freq.float()
    bf16_linear_bytes = sum(l.weight.numel() * 2 for layer in lm.model.layers
                            for l in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    # group 64: packed nibbles 0.25x plus bf16 scale+zero per group (4 bytes / 128) = 0.28x;
    # at group 32 the scales make it 0.31x
    quantize(lm.model, method, group_size=64)
    layer = lm.model.layers[0]
    cls = Int8Linear if method == "int8" else Int4Linear
    assert all(isinstance(getattr(layer, n), cls) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    packed = sum(b.numel() * b.element_size() for layer in lm.model.layers
                 for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                 for b in getattr(layer, n).buffers() if b is not None)
    limit = 0.30 if method == "int4" else 0.55
    assert packed <= limit * bf16_linear_bytes, (packed, bf16_linear_bytes)
    assert weight_bytes(lm.model) > 0
    llm = LLM(loaded=lm, kv_cache_memory="16MiB")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8

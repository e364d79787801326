"""GPTQ rounding: the same int8/int4 formats as round-to-nearest, codes that cost less output error
on the inputs they were calibrated on."""
import pytest
import torch

from inferd.errors import InferdError
from inferd.quant import Int4Linear, Int8Linear, dequantize_int4, quantize_int4, quantize_int8
from inferd.quant.gptq import gptq_int4, gptq_int8, gptq_quantize


def correlated_inputs(k: int, t: int = 2048, seed: int = 0):
    """Inputs with a few heavy channels and correlated directions, like a transformer's."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(t, k, generator=g) @ mix
    x[:, :4] *= 20
    return x


def out_err(d, x):
    return float((x @ d.t()).pow(2).mean())


def test_gptq_int8_keeps_the_format_and_beats_round_to_nearest():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(128)
    h = x.t() @ x / x.shape[0]
    q, s = gptq_int8(w, h)
    q0, s0 = quantize_int8(w, block=None)  # GPTQ's int8 is per row
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    torch.testing.assert_close(s, s0)  # only the codes change
    assert (q != q0).any()
    err_gptq, err_rtn = out_err(q.float() * s[:, None] - w, x), out_err(q0.float() * s0[:, None] - w, x)
    assert err_gptq < 0.7 * err_rtn
    lin = Int8Linear(q, s, None, torch.float32)  # the packed kernel runs the GPTQ codes
    torch.testing.assert_close(lin(x[:5]), x[:5] @ (q.float() * s[:, None]).t(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("group", [32, 64])
def test_gptq_int4_keeps_the_format_and_beats_round_to_nearest(group):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    x = correlated_inputs(128, seed=3)
    h = x.t() @ x / x.shape[0]
    q, s, z = gptq_int4(w, h, group)
    q0, s0, z0 = quantize_int4(w, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    torch.testing.assert_close(s, s0)
    torch.testing.assert_close(z, z0)
    deq = dequantize_int4(q, s, z, group)
    assert out_err(deq - w, x) < 0.7 * out_err(dequantize_int4(q0, s0, z0, group) - w, x)
    lin = Int4Linear(q, s, z, group, None, torch.float32)
    torch.testing.assert_close(lin(x[:5]), x[:5] @ deq.t(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gptq_quantize_rewrites_every_linear_packed(method):
    from conftest import make_tiny_model

    ref = make_tiny_model(seed=4)
    target = make_tiny_model(seed=4)
    calib = torch.randint(0, ref.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(5)).tolist()
    rep = gptq_quantize(target.model, ref.model, calib, method, group_size=32)
    kind = Int8Linear if method == "int8" else Int4Linear
    for layer in target.model.layers:
        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, n)
            assert isinstance(lin, kind) and not lin.dense
    assert rep["linears"] == 4 * ref.config.num_hidden_layers and rep["tokens"] == 8 * 64
    assert rep["rel_output_error_gptq"] < rep["rel_output_error_rtn"]


def test_gptq_needs_a_tokenizer_and_a_known_format():
    from inferd.loading.loader import load_model

    with pytest.raises(InferdError, match="tokenizer"):
        load_model("smollm2-135m", load_format="dummy", with_tokenizer=False, quantization="int8-gptq")
    from conftest import make_tiny_model
    m = make_tiny_model()
    with pytest.raises(InferdError, match="int8 or int4"):
        gptq_quantize(m.model, m.model, [[1, 2, 3]], "gguf")

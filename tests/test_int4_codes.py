"""Every quantized layer the loader makes keeps inferd's own codes, whatever the CPU.

The W4A8/W8A8 kernels read inferd's nibble layout, built from the codes each method computes (round
to nearest, GPTQ, AWQ) or reads (GGUF Q4_0/Q4_1 blocks). PyTorch's `_convert_weight_to_int4pack_for_cpu`
lays its packed int4 out by the CPU's ISA (AVX2 and AVX-512 builds differ), so the path from codes
to W4A8 must never go through it: these tests make it raise, and check that the packed form gives
back the method's codes and its dequantized weights -- the `gguf` package's own dequantization for
GGUF files, the test's hand-made integers for AWQ. The last test runs them again with PyTorch's
kernels held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`), where the layout difference came from.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter, quants

from inferd.loading.loader import load_model
from inferd.model import fused_decode
from inferd.quant import (Int4Linear, dequantize_int4, pack_nibbles, quantize_int4, quantize_int8,
                          unpack_nibbles)
from inferd.quant.w4a8 import W4A8Linear, W8A8Linear

H, FF, NH, NKV, V, L = 64, 128, 4, 2, 96, 2
HD = H // NH
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture
def no_torch_int4_pack(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("PyTorch's int4 packing was called on the path to inferd's own kernels")

    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", refuse)


def write_gguf(path, qt):
    """A tiny llama GGUF whose layer linears are all stored as `qt` (embedding and output F32)."""
    rng = np.random.default_rng(int(qt))
    w = GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, L), (w.add_context_length, 256), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, FF), (w.add_head_count, NH), (w.add_head_count_kv, NKV),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0), (w.add_vocab_size, V)):
        add(v)
    shapes = {"attn_q": (NH * HD, H), "attn_k": (NKV * HD, H), "attn_v": (NKV * HD, H), "attn_output": (H, NH * HD),
              "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
    w.add_tensor("token_embd.weight", (0.2 * rng.standard_normal((V, H))).astype(np.float32))
    w.add_tensor("output.weight", (0.2 * rng.standard_normal((V, H))).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for name, shape in shapes.items():
            arr = (0.2 * rng.standard_normal(shape)).astype(np.float32)
            if qt == Q.F32:
                w.add_tensor(f"blk.{i}.{name}.weight", arr)
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("codes")
    return {qt: write_gguf(d / f"{qt.name}.gguf", qt) for qt in (Q.F32, Q.Q4_0, Q.Q4_1)}


def layer_linears(model, lm_head=False):
    for i, layer in enumerate(model.layers):
        for n in LINEARS:
            yield (i, n), getattr(layer, n)
    if lm_head:
        yield "lm_head", model.lm_head


def dense_weights(model, lm_head=False) -> dict:
    return {k: lin.weight.detach().float() for k, lin in layer_linears(model, lm_head)}


def assert_w4a8_holds(lin, q, scale, mn, group, deq_want):
    """The kernel's packed form gives back these codes (scale/min per 32-block) and these weights."""
    assert isinstance(lin, W4A8Linear)
    got_q, s32, m32 = lin.codes()
    assert torch.equal(got_q, q.to(torch.int32))
    rep = group // 32
    assert torch.equal(s32, scale.float().repeat_interleave(rep, 1))
    assert torch.equal(m32, mn.float().repeat_interleave(rep, 1))
    assert torch.equal(dequantize_int4(got_q, s32, m32, 32), deq_want)
    # the C++ dequantization reads the same bytes; it may fuse the multiply-add (one rounding, so
    # a last-bit difference where q s and min nearly cancel), far below one quantization step
    torch.testing.assert_close(lin.dequantized(), deq_want, rtol=0, atol=float(s32.max()) * 1e-5)


def test_nibbles_roundtrip_and_layout():
    q = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0))
    nib = pack_nibbles(q)
    assert nib.shape == (5, 48) and nib.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(nib), q.to(torch.int32))
    assert int(nib[2, 1]) == int(q[2, 1]) | int(q[2, 17]) << 4  # byte j of a 32-block: q[j], q[j + 16]
    assert int(nib[2, 16 + 3]) == int(q[2, 32 + 3]) | int(q[2, 32 + 19]) << 4


@pytest.mark.parametrize("group", [32, 64])
def test_int4_rtn_codes_survive_to_w4a8(gguf_files, group, no_torch_int4_pack):
    ref = dense_weights(load_model(gguf_files[Q.F32], dtype="float32", with_tokenizer=False).model, lm_head=True)
    lm = load_model(gguf_files[Q.F32], with_tokenizer=False, quantization="int4", quant_group_size=group,
                    quantize_lm_head=True, quantize_activations=True)
    assert lm.model.dtype == torch.float32 and fused_decode.build(lm.model) is not None  # auto: the fused fp32 path
    for k, lin in layer_linears(lm.model, lm_head=True):
        q, s, m = quantize_int4(ref[k], group)
        assert_w4a8_holds(lin, q, s, m, group, dequantize_int4(q, s, m, group))


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q4_1])
def test_gguf_blocks_survive_to_w4a8_as_gguf_dequantizes_them(gguf_files, qt, no_torch_int4_pack):
    """The oracle is the `gguf` package: the dense model loads through its dequantization."""
    from gguf import GGUFReader

    from inferd.gguf_file import unpermute_qk
    from inferd.quant.gguf_layer import int4_blocks

    path = gguf_files[qt]
    want = dense_weights(load_model(path, dtype="float32", with_tokenizer=False).model)
    lm = load_model(path, with_tokenizer=False, quantization="gguf", quantize_activations=True)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    parts = {"qkv_proj": ["attn_q", "attn_k", "attn_v"], "o_proj": ["attn_output"],
             "gate_up_proj": ["ffn_gate", "ffn_up"], "down_proj": ["ffn_down"]}
    heads = {"attn_q": NH, "attn_k": NKV}
    for (i, n), lin in layer_linears(lm.model):
        blocks = []
        for p in parts[n]:
            b = int4_blocks(tensors[f"blk.{i}.{p}.weight"])
            blocks.append([unpermute_qk(x, heads[p]) for x in b] if p in heads else b)
        q, s, m = (torch.cat(x) for x in zip(*blocks))
        assert_w4a8_holds(lin, q, s, m, 32, want[(i, n)])


@pytest.mark.parametrize("group", [32, 64])
def test_awq_checkpoint_codes_survive_to_w4a8(tmp_path, group, no_torch_int4_pack):
    """The oracle: the integers the test wrote into an AutoAWQ-layout folder (exact in fp32)."""
    from helpers import FUSED, TINY, build_hf_awq_checkpoint

    from inferd.loading.loader import load_safetensors_folder
    from inferd.quant.awq_checkpoint import read_quant_config, take_awq_linears

    want, _ = build_hf_awq_checkpoint(tmp_path / "awq", group)
    lm = load_model(str(tmp_path / "awq"), with_tokenizer=False, quantization="awq", quantize_activations=True)
    assert lm.model.dtype == torch.float32
    codes = take_awq_linears(load_safetensors_folder(str(tmp_path / "awq")), lm.config,
                             read_quant_config(str(tmp_path / "awq"))["group_size"])
    hf = {"qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o_proj": ["self_attn.o_proj"],
          "gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "down_proj": ["mlp.down_proj"]}
    assert set(FUSED) == set(hf) and TINY["num_hidden_layers"] == len(lm.model.layers)
    for (i, n), lin in layer_linears(lm.model):
        deq = torch.cat([want[f"{i}.{name}"] for name in hf[n]]).float()
        assert_w4a8_holds(lin, *codes[(i, n)], group, deq)


def test_gptq_codes_survive_to_w4a8(no_torch_int4_pack):
    from conftest import make_tiny_model

    from inferd.quant.gptq import attach_codes, gptq_codes
    from inferd.quant.w4a8 import quantize_activations

    ref = make_tiny_model(seed=4)
    target = make_tiny_model(seed=4)
    calib = torch.randint(0, ref.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(5)).tolist()
    codes, _ = gptq_codes(ref.model, calib, "int4", 64)
    attach_codes(target.model, codes, "int4", 64)  # the loader's route for int4-gptq
    quantize_activations(target.model)
    for k, lin in layer_linears(target.model):
        q, s, m = codes[k]
        assert_w4a8_holds(lin, q, s, m, 64, dequantize_int4(q, s, m, 64))


def test_int8_codes_survive_to_w8a8(gguf_files, no_torch_int4_pack):
    ref = dense_weights(load_model(gguf_files[Q.F32], dtype="float32", with_tokenizer=False).model, lm_head=True)
    lm = load_model(gguf_files[Q.F32], with_tokenizer=False, quantization="int8", quantize_lm_head=True,
                    quantize_activations=True)
    for k, lin in layer_linears(lm.model, lm_head=True):
        assert isinstance(lin, W8A8Linear)
        q, s = quantize_int8(ref[k])
        got_q, got_s = lin.codes()
        assert torch.equal(got_q, q) and torch.equal(got_s, s)  # fp32 block scales, not a bf16 copy


def test_torch_kernel_gets_the_codes_only_at_hand_over(monkeypatch):
    """Int4Linear hands its codes to PyTorch once, at its first forward, and then holds one copy."""
    q, s, m = quantize_int4(torch.randn(64, 96, generator=torch.Generator().manual_seed(1)), 32)
    lin = Int4Linear(q, s, m, 32, None, torch.bfloat16)
    calls = []
    real = torch._convert_weight_to_int4pack_for_cpu
    monkeypatch.setattr(torch, "_convert_weight_to_int4pack_for_cpu", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(lin.codes()[0], q) and not calls
    x = torch.randn(3, 96).bfloat16()
    lin(x), lin(x)
    assert calls == [1] and lin.qweight is None and lin.handed_over
    from inferd.errors import InferdError

    with pytest.raises(InferdError, match="before its first forward"):
        lin.codes()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "avx2", reason="already the AVX2-held run")
def test_the_same_under_pytorch_held_to_avx2():
    """PyTorch's kernels and inferd's held to AVX2 on whatever CPU this is (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA, INFERD_ISA): the codes' path, the packed int4/int8 kernels (tests/test_quant.py),
    W4A8 and the fused decode step agree with the dequantized weights and the eager forward there too."""
    from inferd.kernels import native

    if native.load() is not None and torch.backends.cpu.get_cpu_capability() == "AVX2" \
            and list(torch.ops.inferd.runnable_isas())[-1] == "avx2":
        pytest.skip("an AVX2-only CPU: the main run already is the AVX2-held run")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "INFERD_ISA": "avx2"}
    probe = subprocess.run([sys.executable, "-c", "import torch; from inferd.kernels import native; native.load(); "
                            "print(torch.backends.cpu.get_cpu_capability(), torch.ops.inferd.isa())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "AVX2 avx2", probe.stdout + probe.stderr
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, "test_int4_codes.py"), os.path.join(here, "test_quant.py"),
                        os.path.join(here, "test_w4a8.py"), os.path.join(here, "test_fused_decode.py"),
                        "-k", "not default_model and not eval_rejects and not speculative"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(here))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


@pytest.mark.parametrize("has_bf16", [False, True])
def test_auto_dtype_takes_each_methods_fast_path_on_every_cpu(gguf_files, has_bf16, monkeypatch):
    """AVX2-only or AVX512-BF16: W4A8 gets the fp32 glue its fused decode step needs, PyTorch's
    packed kernels get bf16 activations, dense weights bf16 only where the CPU has bf16 dot products."""
    from inferd.loading import loader

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: has_bf16)
    path = gguf_files[Q.Q4_1]
    a8 = load_model(path, with_tokenizer=False, quantization="gguf", quantize_activations=True)
    assert a8.model.dtype == torch.float32 and fused_decode.build(a8.model) is not None
    packed = load_model(path, with_tokenizer=False, quantization="gguf")
    assert packed.model.dtype == torch.bfloat16
    dense = load_model(path, with_tokenizer=False)
    assert dense.model.dtype == (torch.bfloat16 if has_bf16 else torch.float32)
    forced = load_model(path, with_tokenizer=False, quantization="gguf", quantize_activations=True, dtype="bfloat16")
    assert forced.model.dtype == torch.bfloat16  # an explicit dtype is kept (and decode runs eager)

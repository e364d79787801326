"""GGUF tensors into the kernels' records and GGUF rows dequantized, in C++ (csrc/cpu/repack.cpp),
held to the Python route they replace: repack_blocks == gguf_blocks.pack(decode(...)), repack_w4a8 ==
w4a8.pack4(*int4_blocks(...)), repack_w8a8 == w4a8.pack8(*q8_blocks(...)) byte for byte, whatever
the parts, their row orders and row counts; dequant_rows == gguf.quants.dequantize bit for bit, for
every type inferd serves. Inputs as the loader hands them: several parts of one type, permuted or
cut rows, strided views, a read-only memmap (never copied, never written). The wrappers' fallbacks
(no native code) give the same bytes."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from inferd.errors import InferdError
from inferd.gguf_file import unpermute_qk
from inferd.kernels import native
from inferd.kernels.repack import NATIVE_TYPES, dequantize_rows, raw_bytes
from inferd.quant import gguf_blocks as GB
from inferd.quant import gguf_layer as GL
from inferd.quant import w4a8

needs_native = pytest.mark.skipif(native.ops() is None, reason="no native kernels")

# where each type keeps its fp16 scales in a block (for random blocks of the types gguf cannot quantize)
F16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,),
          "IQ4_XS": (0,)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16", "F32")


def blocks(type_name: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """A GGUF tensor's bytes [N, row bytes]: gguf's own quantization of normal weights where it has
    one, else random codes and bit planes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    if type_name in QUANTIZABLE:
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        return np.ascontiguousarray(quantize(w, Q[type_name])).view(np.uint8).reshape(N, -1)
    f = GB.FORMATS[type_name]
    raw = rng.integers(0, 256, (N, K // f.block_weights, f.block_bytes), dtype=np.uint8)
    for at in F16_AT[type_name]:
        raw[..., at:at + 2] = rng.uniform(1e-3, 0.02, (N, K // f.block_weights, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(N, -1)


def gguf_rows(raw: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, Q[type_name]), dtype=np.float32)).reshape(raw.shape[0], -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def stacked(parts, orders) -> np.ndarray:
    return np.concatenate([p if o is None else p[np.asarray(o)] for p, o in zip(parts, orders)])


def k_of(type_name: str, mult: int) -> int:
    return mult * (256 if GB.FORMATS[type_name].ks else 32)


# -- the block kernel's records ----------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("type_name", GB.TYPES)
def test_repack_blocks_equals_decode_then_pack(type_name):
    """One part, then three of one type (q, k, v's shapes in miniature) with q and k un-interleaved
    as the loader does, and a cut share of rows with repeats; row counts off the 32-row pairs."""
    gen = torch.Generator().manual_seed(0)
    for K in (k_of(type_name, 1), k_of(type_name, 3)):
        one = blocks(type_name, 33, K, seed=K)
        assert torch.equal(GB.repack(type_name, [one]), GB.pack(GB.decode(type_name, one)))
        q, k, v = (blocks(type_name, n, K, seed=K + i) for i, n in enumerate((64, 16, 17)))
        orders = [unpermute_qk(torch.arange(64), 4), unpermute_qk(torch.arange(16), 2), torch.randperm(17, generator=gen)]
        want = GB.pack(GB.decode(type_name, stacked([q, k, v], orders)))
        assert torch.equal(GB.repack(type_name, [q, k, v], orders), want)
        share = [torch.tensor([5, 0, 63, 5]), None, torch.tensor([16])]
        want = GB.pack(GB.decode(type_name, stacked([q, k, v], share)))
        assert torch.equal(GB.repack(type_name, [q, k, v], share), want)


@needs_native
def test_packed_block_layers_compute_what_their_codes_do():
    raw = blocks("Q6_K", 80, 512, seed=3)
    codes = GB.decode("Q6_K", raw)
    ref = GB.BlocksLinear(codes, None, torch.float32)
    ref.pack_()
    lin = GB.BlocksLinear.from_packed("Q6_K", GB.repack("Q6_K", [raw]), 80, 512, None, torch.float32)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lin(x), ref(x))
    with pytest.raises(InferdError, match="do not match"):
        GB.BlocksLinear.from_packed("Q6_K", ref.packed, 81 + 32, 512, None, torch.float32)


# -- W4A8 / W8A8 records ------------------------------------------------------------------------------

def int4_records(type_name: str, raw: np.ndarray, half=None) -> torch.Tensor:
    from types import SimpleNamespace

    return w4a8.pack4(*GL.int4_blocks(SimpleNamespace(data=raw, tensor_type=Q[type_name])), half=half)


@needs_native
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_repack_w4a8_equals_int4_blocks_then_pack4(type_name):
    K = 512
    parts = [blocks(type_name, n, K, seed=n) for n in (40, 8, 9)]
    orders = [unpermute_qk(torch.arange(40), 5), None, torch.tensor([8, 0, 1])]
    got = GL.repack_w4a8(type_name, parts, orders)
    want = int4_records(type_name, stacked(parts, orders))
    assert torch.equal(got, want)
    cells = (40 + 8 + 3 + 31) // 32 * (K // 32)
    # GGUF's fp16 scales stay fp16; random Q4_K's d * sc are not fp16 values: fp32 records
    assert got.numel() == cells * (768 if type_name == "Q4_K" else 640)


@needs_native
def test_w4a8_records_fall_back_to_fp32_exactly_when_pack4_would():
    """A Q4_0 block with |d| > 8188 (-8 d past fp16's range): every scale in fp32, as pack4 decides;
    subnormal fp16 d (-8 d exact): fp16; Q4_K with d * sc and dmin * m all fp16 values: fp16."""
    tiny = blocks("Q4_0", 40, 256).copy()
    tiny.reshape(40, -1, 18)[:, :, 0:2] = (np.arange(40 * 8, dtype=np.uint16).reshape(40, 8, 1) % 1024 + 1).view(np.uint8)
    got = GL.repack_w4a8("Q4_0", [tiny])
    assert got.numel() == 2 * 8 * 640 and torch.equal(got, int4_records("Q4_0", tiny))
    raw = blocks("Q4_0", 33, 256).copy()
    raw.reshape(33, -1, 18)[20, 3, 0:2] = np.array([10000.0], np.float16).view(np.uint8)
    got = GL.repack_w4a8("Q4_0", [raw])
    assert got.numel() == 2 * 8 * 768 and torch.equal(got, int4_records("Q4_0", raw, half=False))
    k = blocks("Q4_K", 40, 512).copy()
    k.reshape(40, -1, 144)[..., 0:4] = np.array([2.0 ** -10, 2.0 ** -12], np.float16).view(np.uint8)
    got = GL.repack_w4a8("Q4_K", [k])
    assert got.numel() == 2 * 16 * 640 and torch.equal(got, int4_records("Q4_K", k, half=True))


@needs_native
def test_repack_w8a8_equals_q8_blocks_then_pack8():
    from types import SimpleNamespace

    parts = [blocks("Q8_0", n, 288, seed=n) for n in (50, 7)]
    orders = [torch.randperm(50, generator=torch.Generator().manual_seed(1)), None]
    got = GL.repack_w8a8(parts, orders)
    want = w4a8.pack8(*GL.q8_blocks(SimpleNamespace(data=stacked(parts, orders), tensor_type=Q.Q8_0)))
    assert torch.equal(got, want) and got.numel() == 2 * 9 * 1088


@needs_native
def test_packed_w4a8_and_w8a8_layers_compute_what_their_codes_do():
    from types import SimpleNamespace

    raw = blocks("Q4_1", 70, 256, seed=5)
    q, s, m = GL.int4_blocks(SimpleNamespace(data=raw, tensor_type=Q.Q4_1))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    ref = w4a8.W4A8Linear(q, s, m, 32, None, torch.float32)
    assert torch.equal(w4a8.W4A8Linear.from_packed(GL.repack_w4a8("Q4_1", [raw]), 70, 256, None, torch.float32)(x), ref(x))
    raw8 = blocks("Q8_0", 70, 256, seed=6)
    ref8 = w4a8.W8A8Linear(*GL.q8_blocks(SimpleNamespace(data=raw8, tensor_type=Q.Q8_0)), None, torch.float32)
    assert torch.equal(w4a8.W8A8Linear.from_packed(GL.repack_w8a8([raw8]), 70, 256, None, torch.float32)(x), ref8(x))
    with pytest.raises(InferdError, match="do not match"):
        w4a8.W8A8Linear.from_packed(ref8.packed, 70, 512, None, torch.float32)


# -- dequantized rows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", NATIVE_TYPES)
def test_dequant_rows_equals_ggufs_dequantize(type_name):
    """A step's few ids (repeats, first and last), then the whole tensor (enough rows to split
    between threads) and ids of another shape."""
    K = 512 if type_name not in GB.FORMATS or GB.FORMATS[type_name].ks else 96
    raw = blocks(type_name, 600, K, seed=1)
    want = gguf_rows(raw, type_name)
    ids = torch.tensor([599, 0, 7, 7, 123])
    assert same_bits(dequantize_rows(raw, ids, type_name), want[ids])
    assert same_bits(dequantize_rows(raw, None, int(Q[type_name])), want)
    grid = torch.tensor([[1, 2], [3, 599]])
    assert same_bits(dequantize_rows(raw, grid, Q[type_name]), want[grid])


@pytest.mark.parametrize("type_name", ["F16", "BF16", "F32"])
def test_dequant_rows_keeps_every_float_bit(type_name):
    """Every fp16 / bf16 bit pattern (subnormals, infinities, NaN payloads) widened as numpy does."""
    if type_name == "F32":
        raw = np.random.default_rng(0).integers(0, 2 ** 32, (64, 1024), dtype=np.uint32).view(np.uint8)
    else:
        raw = np.arange(2 ** 16, dtype=np.uint16).reshape(64, 1024).view(np.uint8)
    assert same_bits(dequantize_rows(raw, None, type_name), gguf_rows(raw, type_name))


def test_the_files_tensors(default_gguf_path):
    """The default model's own Q4_1 projections (q un-interleaved) and Q8_0 embedding."""
    from inferd.gguf_file import open_gguf

    ts = {t.name: t for t in open_gguf(default_gguf_path).tensors}
    q, k = ts["blk.0.attn_q.weight"], ts["blk.0.attn_k.weight"]
    orders = [unpermute_qk(torch.arange(q.data.shape[0]), 9), unpermute_qk(torch.arange(k.data.shape[0]), 3)]
    want = int4_records("Q4_1", stacked([np.asarray(q.data), np.asarray(k.data)], orders))
    assert torch.equal(GL.repack_w4a8("Q4_1", [q, k], orders), want)
    emb = ts["token_embd.weight"]
    ids = torch.tensor([0, 1, 49151, 17, 17, 30000])
    assert same_bits(dequantize_rows(emb, ids), gguf_rows(np.asarray(emb.data)[ids.numpy()], "Q8_0"))


def test_k_quant_files_tensors(gemma_path):
    """Gemma 3 270M Q4_K_M's Q5_0, Q4_K and Q6_K tensors as llama-quantize wrote them (64 rows each)."""
    from inferd.gguf_file import open_gguf

    seen = set()
    for t in open_gguf(gemma_path).tensors:
        name = t.tensor_type.name
        if name in GB.FORMATS and name not in seen:
            seen.add(name)
            rows = torch.arange(64)
            raw = np.asarray(t.data)[:64]
            assert torch.equal(GB.repack(name, [t], [rows]), GB.pack(GB.decode(name, raw))), t.name
            assert same_bits(dequantize_rows(t, rows), gguf_rows(raw, name)), t.name
    assert seen == {"Q5_0", "Q4_K", "Q6_K"}


# -- inputs as the loader hands them --------------------------------------------------------------------

@needs_native
def test_strided_views_are_read_in_place():
    """Rows of a wider buffer (stride > row bytes) and every other row: read through their strides."""
    raw = blocks("Q4_K", 70, 512, seed=2)
    wide = np.zeros((70, raw.shape[1] + 40), np.uint8)
    wide[:, 8:8 + raw.shape[1]] = raw
    view = wide[:, 8:8 + raw.shape[1]]
    assert not view.flags.c_contiguous
    assert raw_bytes(view).data_ptr() == view.ctypes.data
    assert torch.equal(GB.repack("Q4_K", [view, view[::2]]), GB.repack("Q4_K", [raw, raw[::2].copy()]))
    assert same_bits(dequantize_rows(view[::3], None, "Q4_K"), gguf_rows(raw[::3].copy(), "Q4_K"))
    assert torch.equal(GL.repack_w4a8("Q4_K", [view]), GL.repack_w4a8("Q4_K", [raw]))


def test_a_read_only_memmap_is_neither_copied_nor_written(tmp_path):
    """A file mapped read-only (as inferd.gguf_file maps a GGUF): no copy, no warning about torch's
    missing read-only tensors, and a write would fault the process rather than pass unseen."""
    raw = blocks("Q8_0", 64, 256, seed=4)
    path = tmp_path / "t.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = raw_bytes(mm)
        rows = dequantize_rows(mm, torch.tensor([3, 63]), "Q8_0")
        if native.ops() is not None:
            records = GL.repack_w8a8([mm, mm[:32]])
    assert t.data_ptr() == mm.ctypes.data
    assert same_bits(rows, gguf_rows(raw[[3, 63]], "Q8_0"))
    if native.ops() is not None:
        assert torch.equal(records, GL.repack_w8a8([raw, raw[:32]]))
    assert np.array_equal(np.fromfile(path, dtype=np.uint8).reshape(raw.shape), raw)


def test_typed_and_stacked_data_are_viewed_as_bytes():
    """F32/F16 data typed as the reader types it, a 1-D tensor (one row), an expert stack [E, N, bytes]."""
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float16)
    assert same_bits(dequantize_rows(w, torch.tensor([5]), "F16"), torch.from_numpy(w[5:].astype(np.float32)))
    assert same_bits(dequantize_rows(w[0], None, "F16"), torch.from_numpy(w[:1].astype(np.float32)))
    experts = blocks("Q4_K", 24, 256).reshape(3, 8, -1)
    assert same_bits(dequantize_rows(experts, None, "Q4_K"), gguf_rows(experts.reshape(24, -1), "Q4_K"))


# -- errors --------------------------------------------------------------------------------------------

@needs_native
def test_bad_input_is_a_clear_error():
    ops = native.ops()
    raw = torch.from_numpy(blocks("Q4_K", 40, 512))
    q6 = GB.FORMATS["Q6_K"].id
    cases = [
        (lambda: ops.repack_blocks([raw.float()], [None], 0), "uint8"),
        (lambda: ops.repack_blocks([raw], [None], 99), "unknown GGUF block type"),
        (lambda: ops.repack_blocks([raw], [None], q6), "not whole Q6_K blocks"),
        (lambda: ops.repack_blocks([raw[:, :143]], [None], 0), "not whole Q4_K blocks"),
        (lambda: ops.repack_blocks([raw, raw[:, :144]], [None, None], 0), "disagree on their row bytes"),
        (lambda: ops.repack_blocks([raw], [], 0), "one entry"),
        (lambda: ops.repack_blocks([], [], 0), "no parts"),
        (lambda: ops.repack_blocks([raw], [torch.tensor([40])], 0), "names row 40"),
        (lambda: ops.repack_blocks([raw], [torch.tensor([-1])], 0), "names row -1"),
        (lambda: ops.repack_blocks([raw], [torch.tensor([0], dtype=torch.int32)], 0), "int64"),
        (lambda: ops.repack_blocks([raw[:, ::2]], [None], 0), "contiguous bytes"),
        (lambda: ops.repack_w4a8([raw], [None], int(Q.Q8_0)), "not Q4_0, Q4_1 or Q4_K"),
        (lambda: ops.repack_w8a8([raw], [None]), "not whole Q8_0 blocks"),
        (lambda: ops.dequant_rows(raw, torch.tensor([40]), int(Q.Q4_K)), "id 40"),
        (lambda: ops.dequant_rows(raw, torch.tensor([-1]), int(Q.Q4_K)), "id -1"),
        (lambda: ops.dequant_rows(raw, torch.tensor([0.0]), int(Q.Q4_K)), "int64"),
        (lambda: ops.dequant_rows(raw, torch.tensor([0]), int(Q.IQ2_XXS)), "not one inferd dequantizes"),
        (lambda: ops.dequant_rows(raw, torch.tensor([0]), int(Q.Q6_K)), "not whole Q6_K blocks"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    with pytest.raises(InferdError, match="one call repacks one type"):
        from inferd.gguf_file import GGUFTensor
        GB.repack("Q4_K", [GGUFTensor("t", Q.Q6_K, np.array([256, 4]), 1024, 840, 0, blocks("Q6_K", 4, 256))])
    with pytest.raises(InferdError, match="outside"):
        GB.repack("Q4_K", [raw], [[40]])


# -- without native code ------------------------------------------------------------------------------

def test_the_fallbacks_give_the_same_bytes(monkeypatch):
    """The wrappers' decode + pack / int4_blocks + pack4 / gguf routes (INFERD_NO_NATIVE) against the
    native ops: the same records and floats."""
    cases = [("Q3_K", 512), ("Q5_1", 96)]
    parts = {name: [blocks(name, 40, K, seed=1), blocks(name, 9, K, seed=2)] for name, K in cases}
    orders = [torch.randperm(40, generator=torch.Generator().manual_seed(0)), torch.tensor([8, 1])]
    raw4, raw8 = blocks("Q4_0", 33, 256), blocks("Q8_0", 33, 256)
    ids = torch.tensor([32, 0, 5])

    def run():
        out = [GB.repack(name, parts[name], orders) for name, _ in cases]
        out += [GL.repack_w4a8("Q4_0", [raw4]), GL.repack_w8a8([raw8], [ids])]
        return out + [dequantize_rows(raw4, ids, "Q4_0"), dequantize_rows(parts["Q3_K"][0], ids, "Q3_K")]

    native_out = run() if native.ops() is not None else None
    monkeypatch.setattr(native, "ops", lambda: None)
    fallback = run()
    assert torch.equal(fallback[0], GB.pack(GB.decode("Q3_K", stacked(parts["Q3_K"], orders))))
    if native_out is not None:
        for a, b in zip(native_out, fallback):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

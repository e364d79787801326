"""GGUF files written here with the `gguf` package's writer load back to gguf's own dequantization."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter, quants

from hf_to_gguf import finish
from inferd.errors import InferdError
from inferd.gguf_file import unpermute_qk
from inferd.loading.loader import load_model

H, FF, NH, NKV, V, L = 64, 128, 4, 2, 96, 2
HD = H // NH


def _tensors(rng):
    t = {"token_embd.weight": (rng.standard_normal((V, H)), Q.Q8_0),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(H), Q.F32),
         "output.weight": (rng.standard_normal((V, H)), Q.Q4_1)}
    for i in range(L):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(H), Q.F32)
        t[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(H), Q.F32)
        t[p + "attn_q.weight"] = (rng.standard_normal((NH * HD, H)), Q.Q4_0)
        t[p + "attn_k.weight"] = (rng.standard_normal((NKV * HD, H)), Q.Q4_1)
        t[p + "attn_v.weight"] = (rng.standard_normal((NKV * HD, H)), Q.Q8_0)
        t[p + "attn_output.weight"] = (rng.standard_normal((H, NH * HD)), Q.F32)
        t[p + "ffn_gate.weight"] = (rng.standard_normal((FF, H)), Q.Q4_0)
        t[p + "ffn_up.weight"] = (rng.standard_normal((FF, H)), Q.Q4_1)
        t[p + "ffn_down.weight"] = (rng.standard_normal((H, FF)), Q.Q8_0)
    return t


def write_tiny_gguf(path, arch="llama"):
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    finish(w, {name: (0.2 * arr, qt) for name, (arr, qt) in _tensors(rng).items()})
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_tensors_equal_gguf_dequantization(tiny_gguf):
    lm = load_model(str(tiny_gguf), dtype="float32", quantization="none", with_tokenizer=False)
    params = dict(lm.model.named_parameters())
    # the token table stays in the file's type, read in place: every row looked up
    assert type(lm.model.embed_tokens).__name__ == "GGUFEmbedding"
    params["embed_tokens.weight"] = lm.model.embed_tokens(torch.arange(V))
    for i in range(L):  # view the fused projections under the checkpoint's names
        qkv, gu = params[f"layers.{i}.qkv_proj.weight"], params[f"layers.{i}.gate_up_proj.weight"]
        q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD])
        params.update({f"layers.{i}.q_proj.weight": q, f"layers.{i}.k_proj.weight": k,
                       f"layers.{i}.v_proj.weight": v, f"layers.{i}.gate_proj.weight": gu[:FF],
                       f"layers.{i}.up_proj.weight": gu[FF:]})
    reader = GGUFReader(str(tiny_gguf))
    types = set()
    for t in reader.tensors:
        types.add(t.tensor_type)
        ref = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        ref = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
        if t.name.endswith("attn_q.weight"):
            ref = unpermute_qk(ref, NH)
        elif t.name.endswith("attn_k.weight"):
            ref = unpermute_qk(ref, NKV)
        ours = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}.get(t.name)
        if ours is None:
            _, i, rest = t.name.split(".", 2)
            rest = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                    "attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight",
                    "attn_output.weight": "o_proj.weight", "ffn_gate.weight": "gate_proj.weight",
                    "ffn_up.weight": "up_proj.weight", "ffn_down.weight": "down_proj.weight"}[rest]
            ours = f"layers.{i}.{rest}"
        assert torch.equal(params[ours], ref), t.name
    assert {Q.F32, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= types
    assert lm.config.num_key_value_heads == NKV and not lm.config.tie_word_embeddings


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert script: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    w = torch.arange(8 * 3).reshape(8, 3).float()
    permuted = w.reshape(2, 2, 2, 3).transpose(1, 2).reshape(8, 3)
    assert torch.equal(unpermute_qk(permuted, 2), w)


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_other_types_dequantize(tmp_path, qt):
    """Random blocks (K-quants have no Python quantizer in `gguf`; Q4_0/Q4_1/Q8_0 take our whole-tensor
    call of its block maths) against its dequantizer."""
    from inferd.loading.gguf import dequantize_tensor

    rng = np.random.default_rng(1)
    rows, cols = 4, 256
    if qt in (Q.F16,):
        data = rng.standard_normal((rows, cols)).astype(np.float16)
        raw = data
    elif qt == Q.BF16:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt)
    else:
        from gguf.constants import GGML_QUANT_SIZES
        bs, ts = GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(rows, cols // bs * ts), dtype=np.uint8)
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("x", raw, raw_dtype=qt if qt != Q.F16 else None)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    t = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    got = dequantize_tensor(t)
    want = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols)
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


def test_a_reused_reader_never_outlives_a_rewrite(tmp_path):
    """open_gguf keeps the last reader; a file rewritten in place to the same size and mtime (one
    coarse clock tick) must still be read anew."""
    import os

    import numpy as np
    from gguf import GGUFWriter

    from inferd.gguf_file import open_gguf, read_metadata

    path = tmp_path / "m.gguf"

    def write(name: str):
        w = GGUFWriter(str(path), "llama")
        w.add_name(name)
        w.add_tensor("t", np.zeros(32, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write("aaaa")
    st = os.stat(path)
    assert read_metadata(open_gguf(str(path)))["general.name"] == "aaaa"
    assert open_gguf(str(path)) is open_gguf(str(path))  # unchanged: the same reader
    write("bbbbbbbb")  # 4 bytes longer, absorbed by the tensor data's alignment: the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_ino == st.st_ino
    # a stale reader's field views would still cut the name at its old length
    assert read_metadata(open_gguf(str(path)))["general.name"] == "bbbbbbbb"


def test_the_fast_reader_equals_the_gguf_package(tmp_path, default_gguf_path):
    """GGUFFile (what open_gguf gives: metadata, tensor table, mapped data) and read_gguf_metadata
    against the gguf package's own reader on the default model, field for field and byte for byte;
    one clear error for truncated or lying files."""
    from inferd.gguf_file import GGUFFile, read_gguf_metadata, read_metadata

    path = default_gguf_path
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert read_metadata(ours) == read_metadata(theirs) == read_gguf_metadata(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
    data = open(path, "rb").read(4 << 20)
    for name, blob in [("cut.gguf", data[:300_000]), ("lying.gguf", data[:24] + b"\xff" * 8 + data[32:4096])]:
        bad = tmp_path / name
        bad.write_bytes(blob)
        for read in (read_gguf_metadata, GGUFFile):
            with pytest.raises(InferdError, match=f"invalid GGUF file .*{name}") as e:
                read(str(bad))
            assert "\n" not in str(e.value)

"""--lm-head-quantization: a GGUF's output layer rounded again to Q4_K / Q5_K for decode. The blocks
are read back by the `gguf` package (the oracle: ggml's layout as someone else wrote it down), the
served head computes what those blocks hold, and where it cannot apply it says so in one line."""
import logging

import numpy as np
import pytest
import torch

from inferd.errors import InferdError


def _gguf_dequant(blocks: np.ndarray, type_name: str, shape) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(blocks, GGMLQuantizationType[type_name]).reshape(shape)


@pytest.mark.parametrize("type_name,bound", [("Q4_K", 0.09), ("Q5_K", 0.045)])
def test_blocks_read_back_by_gguf(type_name, bound):
    """Random rows (a zero row, an all-positive one, one with an outlier) -> blocks gguf reads back
    within the rounding's error: relative RMS under the bound, a zero row exactly zero, every weight
    within about half a code step of the original (the outlier's super-block too: its sub-blocks'
    scales are rounded up, so none of their weights is clipped)."""
    from inferd.quant.kquants import BLOCK_BYTES, quantize_blocks

    rng = np.random.default_rng(1)
    w = (0.05 * rng.standard_normal((48, 768))).astype(np.float32)
    w[3] = 0
    w[5] = np.abs(w[5])
    w[7, 100] = 2.0
    blocks = quantize_blocks(w, type_name)
    assert blocks.dtype == np.uint8 and blocks.shape == (48, 768 // 256 * BLOCK_BYTES[type_name])
    back = _gguf_dequant(blocks, type_name, w.shape)
    assert np.all(back[3] == 0)
    rel = np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean())
    assert rel < bound, rel
    top = 15 if type_name == "Q4_K" else 31
    sub = w.reshape(-1, 32)
    step = (sub.max(1) - np.minimum(sub.min(1), 0)) / top
    err = np.abs(back - w).reshape(-1, 32).max(1)
    assert np.all(err <= 0.75 * step + 1e-7), (err / np.maximum(step, 1e-9)).max()


def test_a_served_head_in_q4_k(tmp_path, caplog):
    """A tiny Q8_0 GGUF (hidden 256, the tied token table its head) with --lm-head-quantization q4_k:
    the head is a Q4_K block layer whose records are the file's table rounded again, its output
    what gguf reads those blocks to hold (int8-rounded activations: within 2 %), the embedding
    still the file's Q8_0 table; one log line says what was done."""
    from helpers import write_tiny_chat_gguf

    from gguf import GGUFReader
    from inferd.loading.loader import load_model
    from inferd.quant.gguf_blocks import BlocksLinear, record_bytes
    from inferd.quant.kquants import requantize_rows

    path = write_tiny_chat_gguf(tmp_path / "h256.gguf", hidden=256)
    with caplog.at_level(logging.INFO, logger="inferd"):
        lm = load_model(path, quantization="auto", lm_head_quantization="q4_k")
    head = lm.model.lm_head
    assert isinstance(head, BlocksLinear) and head.type == "Q4_K"
    V = head.out_features
    assert head.packed.numel() == record_bytes("Q4_K", V, 256)
    assert any("--lm-head-quantization q4_k: the output layer Q8_0 -> Q4_K" in r.getMessage() for r in caplog.records)
    table = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    w = _gguf_dequant(requantize_rows(np.asarray(table.data), "Q8_0", "Q4_K"), "Q4_K", (V, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    got = head(x)
    want = x @ torch.from_numpy(w).T
    assert ((got - want).norm() / want.norm()).item() < 0.02
    plain = load_model(path, quantization="auto")
    assert type(plain.model.lm_head).__name__ != "BlocksLinear"  # the file's own head: Q8_0, W8A8
    ids = torch.tensor([5, 17, 300])
    assert torch.equal(lm.model.embed_tokens(ids), plain.model.embed_tokens(ids))


def test_where_it_cannot_apply(tmp_path, caplog):
    """Not a GGUF served from its blocks, or a name it does not know: one line. A head whose rows are
    not whole 256-weight super-blocks (the default model's: 576 wide, Q8_0) stays, and the log says so."""
    from helpers import write_tiny_chat_gguf

    from inferd.loading.loader import load_model

    path = write_tiny_chat_gguf(tmp_path / "h64.gguf")
    with pytest.raises(InferdError, match="needs --quantization auto"):
        load_model(path, quantization="none", lm_head_quantization="q4_k")
    with pytest.raises(InferdError, match="choose none, q4_k, q5_k"):
        load_model(path, quantization="auto", lm_head_quantization="q3_k")
    with caplog.at_level(logging.INFO, logger="inferd"):
        lm = load_model(path, quantization="auto", lm_head_quantization="q5_k")  # hidden 64: no 256-weight rows
    assert type(lm.model.lm_head).__name__ != "BlocksLinear"
    assert any("the output layer stays Q8_0 (rows of 64 weights)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inferd"):
        load_model(None, quantization="auto", lm_head_quantization="q4_k")
    assert any("the output layer stays Q8_0 (rows of 576 weights)" in r.getMessage() for r in caplog.records)

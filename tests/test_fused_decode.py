"""The fused decode step (inferd.model.fused_decode): the same kernels as the eager forward, called
from one C++ loop, must give the eager forward's hidden states and KV writes bit for bit, and must
really run where it applies (W4A8/W8A8 models, decode-only steps) and nowhere else."""
import logging
import random

import pytest
import torch

from inferd.worker.attention import PagedAttention
from inferd.worker.kv_pool import KVPool, quantize_rows
from inferd.model import fused_decode
from inferd.quant import quantize
from inferd.quant import w4a8


def _tiny_a8(method="int4", **over):
    from conftest import make_tiny_model

    lm = make_tiny_model(**over)
    quantize(lm.model, method, group_size=32, include_lm_head=True)
    w4a8.quantize_activations(lm.model)
    return lm


def _tiny_blocks(**over):
    """A tiny model (hidden 256, so the K-quants fit) whose linears are GGUF block layers of random
    blocks: Q6_K / IQ4_XS / Q4_K / Q5_K layers, and q/k/v as parts of two kinds side by side (Q5_0
    q and k, Q8_0-like W8A8 v), as a Q4_K_M file's attention often is."""
    import numpy as np
    from conftest import make_tiny_model
    from test_gguf_blocks import random_blocks

    from inferd.quant.gguf_blocks import BlocksLinear, decode, pack_all
    from inferd.quant.gguf_layer import FusedParts

    lm = make_tiny_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, **over)
    rng = np.random.default_rng(0)

    def blocks(t, lin, seed, rows=None):
        n = rows or lin.out_features
        b = None if lin.bias is None or rows else lin.bias
        return BlocksLinear(decode(t, random_blocks(t, n, lin.in_features, seed)), b, torch.float32)

    for i, layer in enumerate(lm.model.layers):
        q = layer.qkv_proj
        nq, nkv = 4 * 64, 2 * 64
        v = w4a8.W8A8Linear(torch.from_numpy(rng.integers(-127, 128, (nkv, 256), dtype=np.int8)),
                            torch.rand(nkv, 256 // 32, generator=torch.Generator().manual_seed(i)) * 0.01 + 1e-3,
                            None, torch.float32)
        layer.qkv_proj = FusedParts([blocks("Q5_0", q, 10 * i, nq + nkv), v])
        layer.o_proj = blocks("Q6_K" if i % 2 else "IQ4_XS", layer.o_proj, 10 * i + 1)
        layer.gate_up_proj = blocks("Q4_K", layer.gate_up_proj, 10 * i + 2)
        layer.down_proj = blocks("Q5_K", layer.down_proj, 10 * i + 3)
    pack_all(lm.model)
    return lm


def _step(lm, pool, tables, ctx, ids, fused=None):
    """One decode step (one new token per sequence at position ctx-1) on a copy of the pool, through
    the fused step where given, else the eager forward."""
    pool2 = KVPool(lm.config.num_hidden_layers, pool.num_blocks, pool.block_size, lm.config.num_key_value_heads,
                   lm.config.head_dim, pool.k.dtype, "cpu")
    pool2.k.copy_(pool.k)
    pool2.v.copy_(pool.v)
    attn = PagedAttention(pool2, lm.config.head_dim, sliding_window=lm.config.sliding_window)
    positions = attn.prepare(tables, [c - 1 for c in ctx], [1] * len(ctx))
    with torch.inference_mode():
        h = fused(torch.tensor(ids), positions, attn) if fused else lm.model(torch.tensor(ids), positions, attn)
    assert h is not None  # a decode-only step through the paged kernel: the fused step takes it
    return h, pool2, attn


@pytest.mark.parametrize("method,n_seq,over,kv", [
    ("int4", 1, {}, torch.float32),
    ("int4", 7, {}, torch.float32),
    ("int4", 20, {}, torch.float32),  # 20 rows: four 4-row tiles and a 4-row tail per panel
    ("int4", 5, {"sliding_window": 6, "architecture": "mistral"}, torch.float32),
    ("int8", 6, {"attention_bias": True, "architecture": "qwen2"}, torch.float32),  # W8A8 layers, a q/k/v bias
    # a bf16 cache: K/V rounded once on their way in, as the eager forward rounds them, attention in fp32
    ("int4", 7, {}, torch.bfloat16),
    ("int8", 6, {"attention_bias": True, "architecture": "qwen2"}, torch.bfloat16),
    # an int8 cache: K/V quantized as written, attention by the split decode kernel, in both paths
    ("int4", 7, {}, torch.int8),
    ("int4", 5, {"sliding_window": 6, "architecture": "mistral"}, torch.int8),
    # GGUF block layers of several types, and a layer of two kinds of parts
    ("gguf-blocks", 1, {}, torch.float32),
    ("gguf-blocks", 7, {}, torch.float32),
])
def test_fused_step_equals_eager_bit_for_bit(method, n_seq, over, kv):
    lm = _tiny_blocks(**over) if method == "gguf-blocks" else _tiny_a8(method, **over)
    fused = fused_decode.build(lm.model)
    assert fused is not None
    cfg = lm.config
    rng = random.Random(n_seq)
    bs = 4
    pool = KVPool(cfg.num_hidden_layers, 256, bs, cfg.num_key_value_heads, cfg.head_dim, kv, "cpu")
    g = torch.Generator().manual_seed(n_seq)
    for c in (pool.k, pool.v):  # stands in for earlier prefills
        x = torch.randn(c.shape[:3] + (cfg.head_dim,), generator=g)
        c.copy_(quantize_rows(x) if kv == torch.int8 else x)
    free = list(range(256))
    rng.shuffle(free)
    ctx = [rng.randint(1, 40) for _ in range(n_seq)]
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    ids = [rng.randrange(cfg.vocab_size) for _ in range(n_seq)]

    h_eager, pool_eager, attn_eager = _step(lm, pool, tables, ctx, ids)
    h_fused, pool_fused, attn_fused = _step(lm, pool, tables, ctx, ids, fused)
    assert fused.steps == 1  # the fused path ran, not the eager one
    assert attn_fused.kernel_calls == attn_eager.kernel_calls == cfg.num_hidden_layers
    n_split = cfg.num_hidden_layers if kv == torch.int8 else 0
    assert attn_fused.split_decode_calls == attn_eager.split_decode_calls == n_split
    assert h_fused.shape == (n_seq, cfg.hidden_size)
    assert torch.equal(h_fused, h_eager)
    assert torch.equal(pool_fused.k, pool_eager.k) and torch.equal(pool_fused.v, pool_eager.v)


def test_engine_with_fused_steps_gives_the_eager_engines_tokens():
    """24 mixed requests: prefill chunks run eagerly, decode-only steps fused, batches of >= 8
    sequences; the tokens equal an --enforce-eager engine's exactly, and no block leaks."""
    from helpers import make_requests, run_engine

    lm = _tiny_a8()
    reqs = make_requests(seed=3, n=24)
    outs, eng = run_engine(lm, reqs, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=700)
    assert eng.runner.fused.steps >= 10 and eng.stats.max_batch_seqs >= 8
    eager, eager_eng = run_engine(lm, reqs, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=700,
                                  enforce_eager=True)
    assert eager_eng.runner.fused is None  # the engine flag, read by the runner alone
    assert outs == eager


def test_fuse_decode_applies_only_where_it_can():
    from conftest import make_tiny_model

    from inferd.loading.loader import load_model

    assert fused_decode.build(make_tiny_model().model) is None  # dense layers
    lm = make_tiny_model()
    quantize(lm.model, "int4", group_size=32, include_lm_head=True)
    assert fused_decode.build(lm.model) is None  # weight-only int4: the eager bf16 path
    kw = dict(load_format="dummy", with_tokenizer=False, quantization="int4", quantize_activations=True)
    assert fused_decode.build(load_model("smollm2-135m", **kw).model) is not None
    assert fused_decode.build(load_model("smollm2-135m", dtype="bfloat16", **kw).model) is None  # fp32 glue only


@pytest.mark.slow
def test_speculative_verify_rows_run_fused_and_change_nothing():
    """n-gram speculation on a W4A8 model: verify chunks reach the kernel as single-query rows, so
    they run fused too, and every row computes what a plain decode of it computes."""
    from helpers import run_engine
    from helpers import assert_speculated, mixed_requests, run_spec

    lm = _tiny_a8()
    reqs = mixed_requests(n=6)
    plain, plain_eng = run_engine(lm, reqs, max_num_seqs=1)
    assert plain_eng.runner.fused.max_rows == 1
    got, _, eng = run_spec(lm, reqs, max_num_seqs=1, speculative_method="ngram", num_speculative_tokens=4)
    assert_speculated(eng)
    assert eng.runner.fused.max_rows > 1  # one sequence at a time: rows > 1 are a verify chunk, served fused
    assert got == plain


# -- the announcement and the counter agree --------------------------------------------------------

def _announced(caplog) -> str:
    """The runner's one line about decode-only steps."""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode-only steps:")]
    assert len(lines) == 1, lines
    return lines[0]


def _assert_log_matches_counter(line: str, fused_steps: int):
    if "fused C++ call" in line:
        assert fused_steps > 0, line
    else:
        assert line.startswith("decode-only steps: eager (") and fused_steps == 0, (line, fused_steps)


@pytest.fixture(scope="module")
def gguf_w4a8(default_gguf_path):
    from inferd.loading.loader import load_model

    return load_model(default_gguf_path, with_tokenizer=False, quantization="gguf", quantize_activations=True)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
def test_engine_says_fused_and_counts_fused_steps_for_each_kv_dtype(gguf_w4a8, kv, caplog):
    """The default GGUF as W4A8, its KV cache in fp32 (auto: the model's dtype), bf16 or int8: the runner
    announces the fused step, EngineStats.fused_steps counts the steps it served, the paths record
    reports that count, and the tokens are an --enforce-eager engine's."""
    from helpers import run_engine

    from inferd.engine.paths import engine_paths

    reqs = [([1, 9, 400, 27, 3000], 6), ([5, 77, 12, 900, 4, 61, 2048, 8], 5), ([1200, 31], 7)]
    opts = {"kv_cache_dtype": kv, "max_num_seqs": 4, "num_kv_blocks": 32}
    with caplog.at_level(logging.INFO, logger="inferd"):
        outs, eng = run_engine(gguf_w4a8, reqs, **opts)
    line = _announced(caplog)
    assert "fused C++ call" in line and eng.runner.fused is not None
    _assert_log_matches_counter(line, eng.stats.fused_steps)
    assert eng.stats.fused_steps == eng.runner.fused.steps < eng.stats.steps  # prompt steps ran eagerly
    assert eng.stats.eager_decode_steps == 0  # and no decode-only step fell back
    paths = engine_paths(eng)
    assert paths["fused_steps"] == eng.stats.fused_steps
    assert paths["kv_dtype"] == ("float32" if kv == "auto" else kv)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inferd"):
        eager, eager_eng = run_engine(gguf_w4a8, reqs, enforce_eager=True, **opts)
    assert _announced(caplog) == "decode-only steps: eager (--enforce-eager)"
    assert eager_eng.stats.fused_steps == 0 and eager_eng.stats.eager_decode_steps > 0
    assert outs == eager


def _decode_plan():
    """Three sequences decoding one token each (context 3, 9, 14 in blocks of 4)."""
    from inferd.worker.runner import StepPlan

    ctx, tables, ids = [3, 9, 14], [[5], [1, 8, 2], [0, 3, 6, 7]], [4, 17, 30]
    return StepPlan(ids, tables, [c - 1 for c in ctx], [1] * 3, [0, 1, 2], [0, 1, 2])


@pytest.mark.parametrize("kv,use_kernel,why", [
    (torch.float16, True, "a float32, bfloat16 or int8 KV cache; this one is float16"),
    (torch.float32, False, "without the native paged-decode kernel"),
])
def test_runner_says_eager_where_the_fused_step_cannot_run(kv, use_kernel, why, caplog):
    """A model the fused step qualifies for, given an attention it cannot serve: one line says
    eager and why, runner.fused is None (nothing claims the path), and a decode step counts as eager."""
    from inferd.worker.runner import ModelRunner

    lm = _tiny_a8()
    assert fused_decode.build(lm.model) is not None
    cfg = lm.config
    pool = KVPool(cfg.num_hidden_layers, 16, 4, cfg.num_key_value_heads, cfg.head_dim, kv, "cpu")
    with caplog.at_level(logging.INFO, logger="inferd"):
        runner = ModelRunner(lm.model, PagedAttention(pool, cfg.head_dim, use_kernel=use_kernel))
    line = _announced(caplog)
    assert why in line and runner.fused is None
    logits, idx, _ = runner.run(_decode_plan())
    assert logits.shape == (3, cfg.vocab_size) and idx == [0, 1, 2]
    _assert_log_matches_counter(line, runner.fused_steps)
    assert runner.eager_decode_steps == 1

"""The fused decode step (inferd.model.fused_decode): the same kernels as the eager forward, called
from one C++ loop, must give the eager forward's hidden states and KV writes bit for bit, and must
really run where it applies (W4A8/W8A8 models, decode-only steps) and nowhere else."""
import random

import pytest
import torch

from inferd.worker.attention import PagedAttention
from inferd.worker.kv_pool import KVPool
from inferd.model import fused_decode
from inferd.quant import quantize
from inferd.quant import w4a8


def _tiny_a8(method="int4", **over):
    from conftest import make_tiny_model

    lm = make_tiny_model(**over)
    quantize(lm.model, method, group_size=32, include_lm_head=True)
    w4a8.quantize_activations(lm.model)
    return lm


def _step(lm, pool, tables, ctx, ids, fused=None):
    """One decode step (one new token per sequence at position ctx-1) on a copy of the pool, through
    the fused step where given, else the eager forward."""
    pool2 = KVPool(lm.config.num_hidden_layers, pool.num_blocks, pool.block_size, lm.config.num_key_value_heads,
                   lm.config.head_dim, torch.float32, "cpu")
    pool2.k.copy_(pool.k)
    pool2.v.copy_(pool.v)
    attn = PagedAttention(pool2, lm.config.head_dim, sliding_window=lm.config.sliding_window)
    positions = attn.prepare(tables, [c - 1 for c in ctx], [1] * len(ctx))
    with torch.inference_mode():
        h = fused(torch.tensor(ids), positions, attn) if fused else lm.model(torch.tensor(ids), positions, attn)
    assert h is not None  # a decode-only step through the paged kernel: the fused step takes it
    return h, pool2, attn


@pytest.mark.parametrize("method,n_seq,over", [
    ("int4", 1, {}),
    ("int4", 7, {}),
    ("int4", 20, {}),  # 20 rows: four 4-row tiles and a 4-row tail per panel
    ("int4", 5, {"sliding_window": 6, "architecture": "mistral"}),
    ("int8", 6, {"attention_bias": True, "architecture": "qwen2"}),  # W8A8 layers and a q/k/v bias
])
def test_fused_step_equals_eager_bit_for_bit(method, n_seq, over):
    lm = _tiny_a8(method, **over)
    fused = fused_decode.build(lm.model)
    assert fused is not None
    cfg = lm.config
    rng = random.Random(n_seq)
    bs = 4
    pool = KVPool(cfg.num_hidden_layers, 256, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(n_seq)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))  # stands in for earlier prefills
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    free = list(range(256))
    rng.shuffle(free)
    ctx = [rng.randint(1, 40) for _ in range(n_seq)]
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    ids = [rng.randrange(cfg.vocab_size) for _ in range(n_seq)]

    h_eager, pool_eager, attn_eager = _step(lm, pool, tables, ctx, ids)
    h_fused, pool_fused, attn_fused = _step(lm, pool, tables, ctx, ids, fused)
    assert fused.steps == 1  # the fused path ran, not the eager one
    assert attn_fused.kernel_calls == attn_eager.kernel_calls == cfg.num_hidden_layers
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

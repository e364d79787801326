"""Paged attention: the compiled decode kernel against the torch gather + SDPA path, and against a
dense causal attention written out longhand."""
import os
import random

import pytest
import torch

from inferd.kernels import native
from inferd.model.layers import attend
from inferd.worker.attention import PagedAttention
from inferd.worker.kv_pool import INT8, KVPool, dequantize_rows, quantize_rows, row_width


def test_kernel_builds():
    # a silent fallback would pass every equality test and lose the speed: demand the kernel
    if os.environ.get("INFERD_NO_NATIVE"):
        pytest.skip("native kernels disabled by INFERD_NO_NATIVE")
    assert native.load() is not None


def _setup(dtype, block_size, seed=0, n_seq=7, window=None, all_decode=False):
    rng = random.Random(seed)
    H, Hkv, D = 6, 2, 16
    pool = KVPool(1, 64, block_size, Hkv, D, dtype, "cpu")
    free = list(range(64))
    rng.shuffle(free)
    tables, starts, lens = [], [], []
    for i in range(n_seq):
        ctx = rng.randint(1, 12 * block_size // 2)
        need = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(need)])
        n = 1 if i % 2 == 0 or all_decode else rng.randint(1, ctx)  # decodes and prefill chunks mixed
        starts.append(ctx - n)
        lens.append(n)
    # fill the cache with keys for the already-computed positions
    g = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g).to(dtype))
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)
    return pool, tables, starts, lens, q, k, v, (H, Hkv, D)


def _dense_reference(pool, tables, starts, lens, q, k, v, dims, window):
    """Contiguous per-sequence K/V, plain softmax(QK^T)V with a causal (and window) mask."""
    H, Hkv, D = dims
    bs = pool.block_size
    out, row = [], 0
    for bt, s, n in zip(tables, starts, lens):
        ctx = s + n
        slots = torch.tensor([bt[p // bs] * bs + p % bs for p in range(ctx)])
        K = pool.k[0][slots].float().clone()
        V = pool.v[0][slots].float().clone()
        K[s:ctx] = k[row:row + n].to(pool.k.dtype).float()
        V[s:ctx] = v[row:row + n].to(pool.v.dtype).float()
        K = K.repeat_interleave(H // Hkv, dim=1)
        V = V.repeat_interleave(H // Hkv, dim=1)
        Q = q[row:row + n].to(pool.k.dtype).float()
        scores = torch.einsum("qhd,khd->hqk", Q, K) / D ** 0.5
        qpos = torch.arange(s, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), V).reshape(n, H * D))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_paged_attention_matches_dense(dtype, block_size, window, use_kernel):
    if use_kernel and native.load() is None:
        pytest.skip("no kernel")
    pool, tables, starts, lens, q, k, v, dims = _setup(dtype, block_size, window=window)
    want = _dense_reference(pool, tables, starts, lens, q, k, v, dims, window)
    attn = PagedAttention(pool, dims[2], sliding_window=window, use_kernel=use_kernel)
    attn.prepare(tables, starts, lens)
    got = attn(0, q, k, v).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert attn.kernel_calls == (1 if use_kernel else 0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_decode_only_step_matches_dense(window, use_kernel):
    """Every sequence decoding one token: the kernel gets its own lean metadata (no gather indices)."""
    if use_kernel and native.load() is None:
        pytest.skip("no kernel")
    pool, tables, starts, lens, q, k, v, dims = _setup(torch.float32, 4, seed=1, n_seq=9, window=window,
                                                       all_decode=True)
    assert set(lens) == {1}
    want = _dense_reference(pool, tables, starts, lens, q, k, v, dims, window)
    attn = PagedAttention(pool, dims[2], sliding_window=window, use_kernel=use_kernel)
    pos = attn.prepare(tables, starts, lens)
    assert pos.tolist() == starts
    assert (attn.decode_args() is not None) == use_kernel
    torch.testing.assert_close(attn(0, q, k, v).float(), want, atol=1e-5, rtol=1e-5)
    assert attn.kernel_calls == (1 if use_kernel else 0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("start", [0, 3])
def test_a_fresh_prompt_runs_causal_sdpa_and_matches_dense(window, start):
    """On the torch path, one prompt from position 0 takes SDPA's is_causal (its kernel skips the
    blocks above the diagonal); a chunk after earlier keys, or a sliding window, keeps the explicit
    mask. Both against the dense reference."""
    rng_pool = KVPool(1, 16, 4, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(7)
    rng_pool.k.copy_(torch.randn(rng_pool.k.shape, generator=g))
    rng_pool.v.copy_(torch.randn(rng_pool.v.shape, generator=g))
    tables, starts, lens = [[3, 1, 4, 0, 2]], [start], [19 - start]
    q, k, v = torch.randn(lens[0], 6, 16), torch.randn(lens[0], 2, 16), torch.randn(lens[0], 2, 16)
    want = _dense_reference(rng_pool, tables, starts, lens, q, k, v, (6, 2, 16), window)
    attn = PagedAttention(rng_pool, 16, sliding_window=window, use_kernel=False)
    attn.prepare(tables, starts, lens)
    assert [gr.causal for gr in attn.groups] == [start == 0 and window is None]
    torch.testing.assert_close(attn(0, q, k, v).float(), want, atol=1e-5, rtol=1e-5)


# -- the kernels that read the cache in place at any length (csrc/cpu/flash_attention_impl.h) ------

def _need_kernels():
    if native.load() is None:
        pytest.skip("no native kernels")
    return torch.ops.inferd


def _counters() -> dict:
    c = torch.ops.inferd.attention_counters()
    return dict(zip(("prefill_calls", "prefill_tiles", "decode_calls", "decode_splits", "q8_rows"), c))


def _variants():
    """Each kernel variant this CPU runs, made active in turn (the caller's restored after)."""
    before = torch.ops.inferd.isa()
    try:
        for isa in torch.ops.inferd.runnable_isas():
            native.use_isa(isa)
            yield isa
    finally:
        native.use_isa(before)


def _as_float(pool, c):
    return dequantize_rows(c, pool.head_dim) if pool.quantized else c.float()


def _attend_reference(pool, tables, starts, lens, q, dims, window, softcap):
    """model.layers.attend per sequence over what the cache holds (read back after the layer wrote this
    step's keys: an int8 cache's quantized rows, dequantized), with the explicit causal/window mask."""
    H, Hkv, D = dims
    bs = pool.block_size
    out, row = [], 0
    for bt, s, n in zip(tables, starts, lens):
        ctx = s + n
        slots = torch.tensor([bt[p // bs] * bs + p % bs for p in range(ctx)])
        K, V = _as_float(pool, pool.k[0][slots]), _as_float(pool, pool.v[0][slots])
        qpos, kpos = torch.arange(s, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        o = attend(q[row:row + n].float().transpose(0, 1)[None], K.transpose(0, 1)[None], V.transpose(0, 1)[None],
                   mask=mask, scale=D ** -0.5, softcap=softcap)
        out.append(o[0].transpose(0, 1).reshape(n, H * D))
        row += n
    return torch.cat(out)


def _long_steps(dtype, seed=0):
    """A cache filled at random and a mixed step over long sequences: decodes over 600-1300 keys
    (several splits of 512), prefill chunks of up to 300 queries after up to 900 keys (several tiles of
    128 keys and of queries), a fresh prompt among them."""
    rng = random.Random(seed)
    H, Hkv, D, bs = 8, 2, 32, 16
    pool = KVPool(1, 512, bs, Hkv, D, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pool.k.shape[:3] + (D,), generator=g) * 2
    pool.k.copy_(quantize_rows(x) if dtype == INT8 else x.to(dtype))
    x = torch.randn(pool.k.shape[:3] + (D,), generator=g)
    pool.v.copy_(quantize_rows(x) if dtype == INT8 else x.to(dtype))
    free = list(range(512))
    rng.shuffle(free)
    tables, starts, lens = [], [], []
    for kind in ("decode", "chunk", "decode", "fresh", "chunk", "decode"):
        if kind == "decode":
            ctx = rng.randint(600, 1300)
            n = 1
        elif kind == "fresh":
            n = ctx = rng.randint(150, 300)
        else:
            n = rng.randint(100, 300)
            ctx = n + rng.randint(200, 900)
        tables.append([free.pop() for _ in range(-(-ctx // bs))])
        starts.append(ctx - n)
        lens.append(n)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    return pool, tables, starts, lens, q, k, v, (H, Hkv, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, INT8])
@pytest.mark.parametrize("window", [None, 200])
def test_tiled_prefill_and_split_decode_equal_attend_on_every_variant(dtype, window):
    """A mixed step over long sequences through the kernels that read the cache in place, under every
    kernel variant this CPU runs: equal to model.layers.attend over what the cache holds, the counters
    showing several key tiles per prefill call and (int8) several splits per decode."""
    _need_kernels()
    pool, tables, starts, lens, q, k, v, dims = _long_steps(dtype)
    want = None
    for isa in _variants():
        before = _counters()
        attn = PagedAttention(pool, dims[2], sliding_window=window)
        attn.prepare(tables, starts, lens)
        assert all(g.masks is None and g.kv_slots is None for g in attn.groups)  # nothing gathered, no mask
        got = attn(0, q, k, v).float()
        if want is None:  # every variant writes the same rows (write_kv_q8's are held bit for bit below)
            want = _attend_reference(pool, tables, starts, lens, q, dims, window, None)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{isa}: {m}")
        after = _counters()
        assert attn.fallback_calls == 0 and attn.prefill_kernel_calls == 1 and attn.kernel_calls == 1
        assert after["prefill_calls"] - before["prefill_calls"] == 1
        assert after["prefill_tiles"] - before["prefill_tiles"] > 3 * 2  # per kv head, more than one tile
        if dtype == INT8:
            assert attn.split_decode_calls == 1
            # 3 decodes over 600-1300 keys, each in several splits (a window of 200: one each)
            assert after["decode_splits"] - before["decode_splits"] == (3 if window else sum(
                -(-(s + n) // 512) for s, n in zip(starts, lens) if n == 1))
            assert after["q8_rows"] - before["q8_rows"] == sum(lens) * dims[1]


@pytest.mark.parametrize("dtype", [torch.float32, INT8])
def test_softcapped_attention_through_the_kernels(dtype):
    """Gemma 2's soft-capping, per tile in the prefill kernel and per split in the decode one (the
    older decode kernel has none: a capped model decodes through the split kernel whatever its
    cache), against attend's explicit tanh."""
    _need_kernels()
    pool, tables, starts, lens, q, k, v, dims = _long_steps(dtype, seed=3)
    q = q * 4  # scores well past the cap, where tanh bends them
    want = None
    for isa in _variants():
        attn = PagedAttention(pool, dims[2], sliding_window=300, softcap=2.0)
        attn.prepare(tables, starts, lens)
        got = attn(0, q, k, v).float()
        if want is None:
            want = _attend_reference(pool, tables, starts, lens, q, dims, 300, 2.0)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{isa}: {m}")
        assert attn.split_decode_calls == 1 and attn.prefill_kernel_calls == 1 and attn.fallback_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, INT8])
def test_split_decode_of_one_long_sequence(dtype):
    """One sequence of 2,100 keys: five splits of 512 run as separate tasks and merged, equal to
    attend; the same row's result whether it decodes alone or beside others (the cut depends on its
    own length only)."""
    ops = _need_kernels()
    D, H, Hkv, bs = 64, 8, 2, 16
    g = torch.Generator().manual_seed(5)
    pool = KVPool(1, 160, bs, Hkv, D, dtype, "cpu")
    x = torch.randn(pool.k.shape[:3] + (D,), generator=g)
    pool.k.copy_(quantize_rows(x) if dtype == INT8 else x.to(dtype))
    x = torch.randn(pool.k.shape[:3] + (D,), generator=g)
    pool.v.copy_(quantize_rows(x) if dtype == INT8 else x.to(dtype))
    tables = [list(range(0, 132)), list(range(132, 140)), list(range(140, 160))]
    ctx = torch.tensor([2100, 100, 300])
    bt = torch.zeros(3, 132, dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    q = torch.randn(3, H, D, generator=g)
    K, V = _as_float(pool, pool.k[0]), _as_float(pool, pool.v[0])
    for isa in _variants():
        before = _counters()
        out = ops.paged_decode_split(q, pool.k[0], pool.v[0], bt, ctx, bs, D ** -0.5, 0, 0.0)
        assert _counters()["decode_splits"] - before["decode_splits"] == 5 + 1 + 1
        for i in range(3):
            slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(int(ctx[i]))])
            want = attend(q[i][None, :, None], K[slots].transpose(0, 1)[None], V[slots].transpose(0, 1)[None],
                          scale=D ** -0.5)
            torch.testing.assert_close(out[i], want[0, :, 0], atol=2e-5, rtol=1e-4, msg=lambda m: f"{isa}: {m}")
        alone = ops.paged_decode_split(q[:1], pool.k[0], pool.v[0], bt[:1], ctx[:1], bs, D ** -0.5, 0, 0.0)
        assert torch.equal(alone[0], out[0]), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, INT8])
def test_verify_rows_sharing_a_table_decode_as_each_row_alone(dtype):
    """A sequence verifying 8 guesses is 9 decode rows over one block table (contexts 1500..1508),
    beside another sequence: the kernels take such rows split by split (so a split's keys come from
    memory once for all 9, softmax_impl.h's split_order); each row's result is bit for bit the one it
    gets decoded alone, through both decode kernels, on every variant."""
    ops = _need_kernels()
    D, H, Hkv, bs = 64, 6, 2, 16
    g = torch.Generator().manual_seed(9)
    pool = KVPool(1, 120, bs, Hkv, D, dtype, "cpu")
    for c in (pool.k, pool.v):
        x = torch.randn(c.shape[:3] + (D,), generator=g)
        c.copy_(quantize_rows(x) if dtype == INT8 else x.to(dtype))
    rows = 9
    ctx = torch.tensor([1500 + i for i in range(rows)] + [300])
    bt = torch.zeros(rows + 1, 95, dtype=torch.long)
    bt[:rows] = torch.arange(95)
    bt[rows, :19] = torch.arange(95, 114)
    q = torch.randn(rows + 1, H, D, generator=g)
    kernels = [lambda q, bt, ctx: ops.paged_decode_split(q, pool.k[0], pool.v[0], bt, ctx, bs, D ** -0.5, 0, 0.0)]
    if dtype != INT8:
        kernels.append(lambda q, bt, ctx: ops.paged_decode(q, pool.k[0], pool.v[0], bt, ctx, bs, D ** -0.5, 0))
    for isa in _variants():
        for run in kernels:
            out = run(q, bt, ctx)
            for i in range(rows + 1):
                alone = run(q[i:i + 1], bt[i:i + 1], ctx[i:i + 1])
                assert torch.equal(alone[0], out[i]), (isa, i)


def test_int8_rows_are_written_as_torch_quantizes_them():
    """write_kv_q8 (every variant) makes the rows quantize_rows makes, bit for bit: per group of 32 the
    fp16 scale amax / 127 after the codes, codes round(x / scale); each value within half a step of its
    group's scale of its original."""
    ops = _need_kernels()
    g = torch.Generator().manual_seed(2)
    T, Hkv, D = 37, 3, 48
    qkv = torch.randn(T, 6 + 2 * Hkv, D, generator=g) * torch.rand(T, 6 + 2 * Hkv, 1, generator=g) * 5
    qkv[3, 6] = 0  # a row of zeros: scale 0, codes 0
    k, v = qkv[:, 6:6 + Hkv], qkv[:, 6 + Hkv:]  # strided views, as the model hands them
    slots = torch.randperm(64, generator=g)[:T]
    for dt in (torch.float32, torch.bfloat16):
        kk, vv = (k, v) if dt == torch.float32 else (k.to(dt), v.to(dt))
        for isa in _variants():
            kc, vc = (torch.zeros(64, Hkv, row_width(INT8, D), dtype=torch.int8) for _ in range(2))
            ops.write_kv_q8(kk, vv, slots, kc, vc)
            assert torch.equal(kc[slots], quantize_rows(kk)) and torch.equal(vc[slots], quantize_rows(vv)), isa
    rows = quantize_rows(k)
    assert rows.shape[-1] == D + 2 * 2  # 48 values: a group of 32 and one of 16, an fp16 scale each
    scale = rows[..., D:].contiguous().view(torch.float16).float()  # [T, Hkv, 2]
    per_value = torch.cat([scale[..., :1].expand(T, Hkv, 32), scale[..., 1:].expand(T, Hkv, 16)], -1)
    # half a step of the group's own scale (a scale per row would allow the row's largest)
    assert ((dequantize_rows(rows, D) - k).abs() <= per_value / 2 * (1 + 2 ** -10) + 1e-6).all()
    assert not dequantize_rows(rows, D)[3, 0].any()


def test_an_int8_block_holds_about_half_a_bf16_block():
    """An int8 row is head_dim bytes and an fp16 scale per 32 values: at head_dim 64, 68 bytes where
    bf16 takes 128 (1.88x the tokens in the same memory)."""
    bf16 = KVPool.bytes_per_block(16, 16, 8, 64, torch.bfloat16)
    q8 = KVPool.bytes_per_block(16, 16, 8, 64, INT8)
    assert q8 == 2 * 16 * 16 * 8 * 68 and bf16 / q8 > 1.85
    pool = KVPool(2, 4, 16, 8, 64, INT8, "cpu")
    assert pool.k.shape == (2, 64, 8, 68) and pool.k.dtype == INT8 and pool.quantized


def test_the_torch_fallback_is_said_once_and_counted(caplog):
    """Where the kernels cannot run (here a head_dim the vector loops do not take), the attention says
    why in one log line and counts every call it serves; an int8 cache still works, dequantized as
    gathered, equal to attend over its rows."""
    import logging

    pool, tables, starts, lens, q, k, v, dims = _setup(torch.float32, 4, seed=4)
    q8 = KVPool(1, 64, 4, 2, 8, INT8, "cpu")
    q8.k.copy_(quantize_rows(torch.randn(q8.k.shape[:3] + (8,))))
    q8.v.copy_(quantize_rows(torch.randn(q8.k.shape[:3] + (8,))))
    with caplog.at_level(logging.WARNING, logger="inferd"):
        attn = PagedAttention(q8, 8)
    lines = [r.getMessage() for r in caplog.records if "torch fallback" in r.getMessage()]
    assert len(lines) == 1 and "head_dim 8 is not a multiple of 16" in lines[0]
    assert attn.kernel is None and attn.fallback_why == "head_dim 8 is not a multiple of 16"
    q, k, v = q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous()
    attn.prepare(tables, starts, lens)
    got = attn(0, q, k, v).float()
    want = _attend_reference(q8, tables, starts, lens, q, (6, 2, 8), None, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert attn.fallback_calls == 1

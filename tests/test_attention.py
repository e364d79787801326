"""Paged attention: the compiled decode kernel against the torch gather + SDPA path, and against a
dense causal attention written out longhand."""
import os
import random

import pytest
import torch

from inferd.kernels import native
from inferd.worker.attention import PagedAttention
from inferd.worker.kv_pool import KVPool


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
    """One prompt from position 0 takes SDPA's is_causal (its kernel skips the blocks above the
    diagonal); a chunk after earlier keys, or a sliding window, keeps the explicit mask. Both against
    the dense reference."""
    rng_pool = KVPool(1, 16, 4, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(7)
    rng_pool.k.copy_(torch.randn(rng_pool.k.shape, generator=g))
    rng_pool.v.copy_(torch.randn(rng_pool.v.shape, generator=g))
    tables, starts, lens = [[3, 1, 4, 0, 2]], [start], [19 - start]
    q, k, v = torch.randn(lens[0], 6, 16), torch.randn(lens[0], 2, 16), torch.randn(lens[0], 2, 16)
    want = _dense_reference(rng_pool, tables, starts, lens, q, k, v, (6, 2, 16), window)
    attn = PagedAttention(rng_pool, 16, sliding_window=window)
    attn.prepare(tables, starts, lens)
    assert [gr.causal for gr in attn.groups] == [start == 0 and window is None]
    torch.testing.assert_close(attn(0, q, k, v).float(), want, atol=1e-5, rtol=1e-5)

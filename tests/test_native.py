"""The native kernels (csrc/cpu, inferd.kernels.native): every ISA variant this CPU executes is
tested here, in one process, against the same oracles; the variants are shown to be different code;
and a variant the CPU lacks is refused with one line, never run.

On an AVX-512 machine this covers generic, avx2, avx512 and (with VNNI) avx512_vnni; an AVX2-only
machine runs the first two and says why it skips the others. PyTorch's own dispatch held to AVX2
alongside INFERD_ISA=avx2 is tests/test_int4_codes.py::test_the_same_under_pytorch_held_to_avx2.
"""
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels import native
from inferd.quant import dequantize_int4, quantize_int4, quantize_int8
from inferd.quant import w4a8

pytestmark = pytest.mark.skipif(bool(os.environ.get("INFERD_NO_NATIVE")), reason="INFERD_NO_NATIVE is set")


def runnable() -> list[str]:
    assert native.load() is not None  # the project installs a compiler: no silent fallback
    return list(torch.ops.inferd.runnable_isas())


@pytest.fixture(params=native.ISAS)
def variant(request):
    if request.param not in runnable():
        pytest.skip(f"this CPU cannot run the {request.param} variant ({', '.join(runnable())} only)")
    before = torch.ops.inferd.isa()
    assert native.use_isa(request.param) == request.param
    yield request.param
    native.use_isa(before)


def test_the_best_variant_is_chosen_and_the_generic_one_always_runs():
    r = runnable()
    assert r[0] == "generic"
    if not os.environ.get("INFERD_ISA"):
        assert torch.ops.inferd.isa() == r[-1]
    feats = set(torch.ops.inferd.cpu_features())
    assert ("avx2" in r) == ({"avx2", "fma", "f16c"} <= feats)
    assert ("avx512_vnni" in r) == ("avx512" in r and "avx512vnni" in feats)
    # AMX needs the CPU's tiles and Linux's permission to use them (arch_prctl)
    assert ("avx512_amx" in r) == ("avx512_vnni" in r and {"amx-tile", "amx-int8", "amx-os"} <= feats)


def w8_block_codes(N, K, seed):
    """int8 codes with one scale per (row, 32-block), Q8_0's form; a few -128s (the one int8 whose
    magnitude is not an int8, which the sign-trick variants must handle)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K // 32, 32, generator=g) * torch.rand(N, K // 32, 1, generator=g) * 3
    s = w.abs().amax(-1) / 127
    q = torch.round(w / s[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K)
    q[0, :5] = -128
    return q, s


@pytest.mark.parametrize("K", [32, 96, 160])  # 1, 3 and 5 blocks
@pytest.mark.parametrize("N", [1, 40, 70])  # 40, 70: a group of 16 columns partly padding; 1: nothing else
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 128, 512])
def test_int8_activation_kernels_in_each_variant(variant, K, N, rows):
    torch.manual_seed(rows * K + N)
    q, s, z = quantize_int4(torch.randn(N, K), 32)
    lin = w4a8.W4A8Linear(q, s, z, 32, None, torch.float32)
    x = torch.randn(rows, K) * 3
    xr = w4a8.fake_quant_activations(x)
    assert torch.equal(torch.ops.inferd.fake_quant(x), xr)  # the rounding is torch's, bit for bit
    calls, done = torch.ops.inferd.gemm_counters()
    torch.testing.assert_close(lin(x), xr @ dequantize_int4(q, s, z, 32).t(), atol=1e-4, rtol=1e-5)
    assert torch.ops.inferd.gemm_counters() == [calls + 1, done + rows]  # the integer GEMM, for any M
    q8, s8 = w8_block_codes(N, K, rows + K)
    lin8 = w4a8.W8A8Linear(q8, s8, None, torch.float32)
    want8 = xr @ (q8.float().reshape(N, -1, 32) * s8[..., None]).reshape(N, K).t()
    torch.testing.assert_close(lin8(x), want8, atol=1e-4, rtol=1e-5)
    qc, sc = quantize_int8(torch.randn(N, K), block=None)  # one scale per row: the same kernel, repeated
    lin_c = w4a8.W8A8Linear(qc, sc, None, torch.float32)
    torch.testing.assert_close(lin_c(x), xr @ (qc.float() * sc[:, None]).t(), atol=1e-4, rtol=1e-5)


def test_the_packed_layouts_round_trip():
    g = torch.Generator().manual_seed(3)
    for N, K in ((1, 32), (17, 64), (48, 96), (70, 160)):
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
        for half in (False, True):  # fp32 scales, or fp16 ones (GGUF's) stored in 2 bytes
            s, m = torch.rand(N, K // 32, generator=g), torch.randn(N, K // 32, generator=g)
            if half:
                s, m = s.half().float(), m.half().float()
            p = w4a8.pack4(q, s, m)
            assert p.numel() == -(-N // 32) * (K // 32) * (640 if half else 768)
            got = w4a8.unpack4(p, N, K)
            assert all(torch.equal(a, b) for a, b in zip(got, (q, s, m)))
            q8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
            p8 = w4a8.pack8(q8, s)
            assert p8.numel() == -(-N // 32) * (K // 32) * (1088 if half else 1152)
            got8 = w4a8.unpack8(p8, N, K)
            assert torch.equal(got8[0], q8) and torch.equal(got8[1], s)
    # the layout itself, for one 32-block of the first group: chunk c, lane l, byte p; then the scales
    q = torch.arange(32 * 32).reshape(32, 32) % 16
    s = torch.arange(32.0)[:, None] + 0.1  # not fp16 values: fp32 records
    rec = w4a8.pack4(q, s, -s).reshape(768)
    for c, l, j in ((0, 0, 0), (2, 5, 3), (3, 15, 1)):
        assert int(rec[64 * c + 4 * l + j]) == int(q[l, 4 * c + j]) | int(q[l, 16 + 4 * c + j]) << 4
    assert torch.equal(rec[512:640].view(torch.float32), s[:, 0])  # both groups' scales
    assert torch.equal(rec[640:].view(torch.float32), -s[:, 0])  # then their mins


def test_every_variant_computes_the_same_floats():
    """The integer block sums are exact on every ISA and the float steps after them are the same
    fma's in the same order: generic, avx2, avx512 and avx512_vnni agree bit for bit."""
    torch.manual_seed(0)
    q, s, z = quantize_int4(torch.randn(70, 160), 32)
    q8, s8 = w8_block_codes(70, 160, 1)
    lins = [w4a8.W4A8Linear(q, s, z, 32, None, torch.float32), w4a8.W8A8Linear(q8, s8, None, torch.float32),
            # fp16 records: the same floats as fp32 ones holding the same (fp16) values
            w4a8.W4A8Linear(q, s.half().float(), z.half().float(), 32, None, torch.float32),
            w4a8.W8A8Linear(q8, s8.half().float(), None, torch.float32)]
    assert [w4a8.exactly_half(lin.codes()[1]) for lin in lins] == [False, False, True, True]
    x = torch.randn(37, 160) * 3
    # a block whose scale is 1.0 exactly, so x / d lands on .5: every variant rounds half to even
    x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * 4)
    got = {}
    for v in runnable():
        native.use_isa(v)
        got[v] = [lin(x) for lin in lins]
    native.use_isa("auto")
    first = got[runnable()[0]]
    for v, outs in got.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, first)), v
    for i, pack in ((2, w4a8.pack4), (3, w4a8.pack8)):  # fp32 records of the same values: the same floats
        full = pack(*lins[i].codes(), half=False)
        assert full.numel() > lins[i].packed.numel()
        lins[i].packed = full
        assert torch.equal(lins[i](x), first[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_silu_in_each_variant(variant, dtype):
    torch.manual_seed(1)
    x, w, d = torch.randn(5, 64, dtype=dtype), torch.randn(64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(torch.ops.inferd.rms_norm(x, w, 1e-5), want, **tol)
    x2 = x.clone()
    got = torch.ops.inferd.add_rms_norm(x2, d, w, 1e-5)
    assert torch.equal(x2, x + d)  # the residual, updated in place with torch's rounding
    torch.testing.assert_close(got, torch.ops.inferd.rms_norm(x + d, w, 1e-5), atol=0, rtol=0)
    gu = torch.randn(4, 2 * 48, dtype=dtype)
    torch.testing.assert_close(torch.ops.inferd.silu_mul(gu), F.silu(gu[:, :48]) * gu[:, 48:], **tol)
    T, H, D = 3, 4, 16
    qk = torch.randn(T, H, D, dtype=dtype)
    ang = torch.randn(T, D // 2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([-ang.sin(), ang.sin()], -1)
    swap = torch.cat([qk[..., D // 2:], qk[..., :D // 2]], -1)
    want_r = qk * cos.to(dtype)[:, None] + swap * sin.to(dtype)[:, None]
    got_r = qk.clone()
    torch.ops.inferd.rope_(got_r, H, cos.contiguous(), sin.contiguous())
    torch.testing.assert_close(got_r, want_r, **tol)


@pytest.mark.parametrize("D", [16, 64, 128])  # 64, 128: the paths that score 8 (AVX2) or 16 (AVX-512) keys at once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_in_each_variant(variant, dtype, D):
    torch.manual_seed(2)
    B, H, Hkv, bs = 4, 6, 2, 4
    ctx = [5, 1, 11, 83]  # 83: two 64-key chunks, whole groups of 8 and 16 keys and a remainder
    nblk = [(c + bs - 1) // bs for c in ctx]
    perm = torch.randperm(sum(nblk) + 3).tolist()  # the blocks scattered over the pool
    tables = [perm[sum(nblk[:b]):sum(nblk[:b + 1])] for b in range(B)]
    kc, vc = (torch.randn(len(perm) * bs, Hkv, D).to(dtype) for _ in range(2))
    q = torch.randn(B, H, D)
    bt = torch.tensor([t + [0] * (max(nblk) - len(t)) for t in tables])
    out = torch.ops.inferd.paged_decode(q, kc, vc, bt, torch.tensor(ctx), bs, D ** -0.5, 0)
    for b in range(B):
        slots = torch.tensor([tables[b][t // bs] * bs + t % bs for t in range(ctx[b])])
        k = kc[slots].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)  # [H, n, D]
        v = vc[slots].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        p = torch.softmax(q[b][:, None] @ k.transpose(1, 2) * D ** -0.5, -1)
        torch.testing.assert_close(out[b], (p @ v)[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,over", [("int4", {}), ("int8", {"attention_bias": True, "architecture": "qwen2"})])
def test_fused_step_equals_eager_in_each_variant(variant, method, over):
    from test_fused_decode import _step, _tiny_a8

    from inferd.worker.kv_pool import KVPool
    from inferd.model import fused_decode

    lm = _tiny_a8(method, **over)
    fused = fused_decode.build(lm.model)
    cfg = lm.config
    pool = KVPool(cfg.num_hidden_layers, 64, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    ctx, tables, ids = [3, 9, 14], [[5], [1, 8, 2], [0, 3, 6, 7]], [4, 17, 30]
    h_eager, pool_eager, _ = _step(lm, pool, tables, ctx, ids)
    h_fused, pool_fused, _ = _step(lm, pool, tables, ctx, ids, fused)
    assert fused.steps == 1 and torch.ops.inferd.isa() == variant
    assert torch.equal(h_fused, h_eager)
    assert torch.equal(pool_fused.k, pool_eager.k) and torch.equal(pool_fused.v, pool_eager.v)


def _instructions_by_variant() -> dict[str, Counter]:
    lib = native.library_path()
    assert lib is not None and lib.exists()
    dis = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    stats: dict[str, Counter] = defaultdict(Counter)
    where = None
    for line in dis.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            # the innermost inferd::<variant>:: namespace of the function (lambdas included)
            found = re.findall(r"inferd::(generic|avx2|avx512|avx512_vnni|avx512_amx)::", m.group(1))
            where = found[0] if found else None
            continue
        if where and "\t" in line:
            stats[where]["insn"] += 1
            for what in ("zmm", "ymm", "vpdpbusd", "vpmaddubsw", "tdpbsud", "tdpbssd", "prefetcht2"):
                stats[where][what] += what in line
    return stats


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_the_variants_are_different_code():
    s = _instructions_by_variant()
    assert set(s) == set(native.ISAS) and all(c["insn"] > 1000 for c in s.values())
    assert s["generic"]["ymm"] == s["generic"]["zmm"] == 0  # baseline x86-64: SSE only
    assert s["avx2"]["ymm"] > 0 and s["avx2"]["vpmaddubsw"] > 0 and s["avx2"]["zmm"] == 0
    assert s["avx512"]["zmm"] > 0 and s["avx512"]["vpdpbusd"] == 0
    assert s["avx512_vnni"]["zmm"] > 0 and s["avx512_vnni"]["vpdpbusd"] > 0
    assert s["avx512_vnni"]["tdpbsud"] == s["avx512_vnni"]["tdpbssd"] == 0
    assert s["avx512_amx"]["tdpbssd"] > 0  # W8 tiles
    assert s["avx512_amx"]["vpdpbusd"] > 0  # W4, and steps of fewer than 16 rows, stay on VNNI
    assert s["avx2"]["vpdpbusd"] == 0
    # the weight tiles' prefetch is an instruction in every vector variant (the prefetch builtin
    # there once compiled to nothing: decode read half of DRAM speed)
    assert all(s[v]["prefetcht2"] > 0 for v in native.ISAS if v != "generic")


def _inferd_env(**env):
    return subprocess.run([sys.executable, "-m", "inferd", "env"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_inferd_env_names_the_variant_and_forcing_one_the_cpu_lacks_is_exit_2():
    r = _inferd_env(INFERD_ISA="avx2", INFERD_CPU_HIDE="")
    if r.returncode == 2 and "lacks" in r.stderr:
        pytest.skip("this CPU has no AVX2: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert re.search(r"^kernel variant\s+avx2$", r.stdout, re.M) and "cpu features" in r.stdout
    # what an AVX2-only machine says when told to run AVX-512 (the features hidden from CPUID here;
    # all four, so that the line is the same on an AVX2 machine, which lacks them all)
    r = _inferd_env(INFERD_ISA="avx512", INFERD_CPU_HIDE="avx512f,avx512bw,avx512vl,avx512dq")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "inferd: error: INFERD_ISA=avx512: this CPU lacks avx512f, avx512bw, avx512vl, avx512dq (it runs: generic, avx2)"]
    assert r.stdout == ""
    r = _inferd_env(INFERD_ISA="sse9")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not a kernel variant" in r.stderr


def test_the_build_is_named_by_its_content_and_place(tmp_path, monkeypatch):
    name = native.build_name()
    assert native.build_name() == name  # the same sources: the same library, no rebuild
    copy = tmp_path / "cpu"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    # the same sources in another checkout: a library of its own (torch's build file names sources by
    # absolute path, so a shared one was rebuilt whenever the other checkout had loaded it)
    elsewhere = native.build_name()
    assert elsewhere != name
    (copy / "ops.cpp").write_text((copy / "ops.cpp").read_text() + "\n// an edit\n")
    assert native.build_name() not in (name, elsewhere)  # any edit: a new library, no version to bump by hand


@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_a_rows_result_does_not_depend_on_its_batch(variant, kind):
    """Batch invariance: row i's output is bit-identical whatever the number of rows in the step
    (M = 1, 2, 7, 16, 33, 128, 512: every tile shape and its tails) and wherever the row sits among
    them; N = 70 leaves a partly padded group."""
    torch.manual_seed(4)
    K, N = 160, 70
    if kind == "w4a8":
        q, s, z = quantize_int4(torch.randn(N, K), 32)
        lin = w4a8.W4A8Linear(q, s, z, 32, None, torch.float32)
    else:
        lin = w4a8.W8A8Linear(*w8_block_codes(N, K, 2), None, torch.float32)
    x = torch.randn(512, K) * 3
    full = lin(x)
    for m in (1, 2, 7, 16, 33, 128):
        assert torch.equal(lin(x[:m]), full[:m]), m
        assert torch.equal(lin(x[-m:]), full[-m:]), m
    perm = torch.randperm(512)
    assert torch.equal(lin(x[perm]), full[perm])

"""Tensor parallelism (inferd.distributed, inferd.distributed.tensor_parallel): real ranks in real
processes, the real default model for equality, tiny random models for the shapes that need
replicated KV heads and uneven splits, and proof that the split ran (each rank's bytes, the
collectives counted)."""
import dataclasses
import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_tiny_model
from helpers import (assert_no_leaks, compare, compare_texts, make_requests, reference_outputs, run_recording,
                     stream_then_kill, wait_for_log)

from inferd.engine.engine import LLMEngine
from inferd.distributed.comm import CollectiveError
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError
from inferd.loading.loader import load_model
from inferd.distributed.tensor_parallel import apply_tp, plan, split_evenly
from inferd.quant.linear import weight_bytes

SMALL_KV = "64MiB"  # the default pool (20 % of memory, up to 2 GiB) is zeroed on every rank: seconds


# -- the split, as arithmetic ----------------------------------------------------------------------

def test_split_evenly_and_aligned():
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert split_evenly(96, 2, 32) == [(0, 64), (64, 96)]  # 3 units of 32: 2 + 1
    assert split_evenly(100, 3, 32) == split_evenly(100, 3)  # not a multiple: no alignment


def test_the_default_model_splits_by_kv_group_unevenly():
    r0, r1 = plan(9, 3, 1536, 49152, 2)
    assert (r0.kv_heads, r0.q_heads) == ((0, 1), tuple(range(6)))
    assert (r1.kv_heads, r1.q_heads) == ((2,), (6, 7, 8))
    assert (r0.ff, r1.ff) == ((0, 768), (768, 1536))
    assert (r0.vocab, r1.vocab) == ((0, 24576), (24576, 49152))


def test_fewer_kv_heads_than_ranks_replicate_them():
    shards = plan(8, 2, 256, 1001, 4)
    assert [s.kv_heads for s in shards] == [(0,), (0,), (1,), (1,)]
    assert [s.q_heads for s in shards] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.vocab for s in shards] == [(0, 251), (251, 501), (501, 751), (751, 1001)]


@pytest.mark.parametrize("heads,kv,world,msg", [(6, 2, 3, "multiple of the KV heads"),
                                                 (2, 1, 4, "without a query head")])
def test_splits_that_cannot_be_made_are_clear_errors(heads, kv, world, msg):
    with pytest.raises(InferdError, match=msg):
        plan(heads, kv, 128, 512, world)


def test_a_cut_inside_a_quantization_group_is_a_clear_error():
    lm = make_tiny_model(intermediate_size=192)  # halves of 96 columns: not a multiple of the group
    from inferd.quant import quantize

    quantize(lm.model, "int4", group_size=64)
    with pytest.raises(InferdError, match="inside a quantization group of 64"):
        apply_tp(lm.model, plan(4, 2, 192, 512, 2)[1], comm=None)


def test_each_rank_holds_its_share_of_the_bytes(default_gguf_path):
    """Rewritten in this process (no collective runs): the ranks' bytes add up to the whole model,
    plus the norms every rank keeps."""
    import copy

    full = load_model(default_gguf_path, dtype="float32", with_tokenizer=False).model
    whole = weight_bytes(full)
    replicated = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n) + full.rope.inv_freq.numel() * 4
    cfg = full.cfg
    shares = [weight_bytes(apply_tp(copy.deepcopy(full), shard, comm=None))
              for shard in plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                                cfg.vocab_size, 2)]
    assert sum(shares) == whole + replicated
    # rank 0 holds 2 of the 3 KV groups (6 query heads), rank 1 one (3); the MLP and vocab split evenly:
    # the difference is 3 heads' q rows and o columns and one head's k and v rows, in every layer
    head = 4 * cfg.hidden_size * cfg.head_dim  # fp32 bytes of one head's rows (or columns) of a projection
    assert shares[0] - shares[1] == cfg.num_hidden_layers * head * (3 + 3 + 2)


# -- the shared-memory collectives, alone -----------------------------------------------------------

PEER = """
import sys, torch
from inferd.distributed.comm import ShmComm
c = ShmComm(1, 2, sys.argv[1], slot_bytes=4096)
g = torch.Generator().manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(3000, generator=g).to(dtype)  # 3 chunks of a 4 KiB slot in fp32, 2 in bf16
    c.all_reduce_(x)
c.gather_cols(torch.full((5, 3), 7.0), [2, 3])
assert c.recv_obj() == {"plan": list(range(3000))}  # larger than a slot
c.all_reduce_(torch.zeros(1))
"""


def test_shared_memory_collectives_across_two_processes():
    """All-reduce (fp32 and bf16, chunked through small slots), the logits gather with uneven widths,
    and an object larger than a slot, between this process and a real second one."""
    import subprocess
    import sys

    from inferd.distributed.comm import ShmComm

    c = ShmComm(0, 2, slot_bytes=4096)
    peer = subprocess.Popen([sys.executable, "-c", PEER, c.path])
    try:
        g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(3000, generator=g0).to(dtype), torch.randn(3000, generator=g1).to(dtype)
            x = a.clone()
            c.all_reduce_(x)
            # rank order, in fp32, rounded once: what every rank gets
            assert torch.equal(x, (a.float() + b.float()).to(dtype)), dtype
        got = c.gather_cols(torch.full((5, 2), 3.0), [2, 3])
        assert torch.equal(got, torch.cat([torch.full((5, 2), 3.0), torch.full((5, 3), 7.0)], 1))
        c.send_obj({"plan": list(range(3000))})
        c.all_reduce_(torch.zeros(1))
        assert peer.wait(60) == 0
        assert c.counts["all_reduce"] == 3 and c.counts["gather"] == 1
    finally:
        peer.kill()
        c.close()


# -- tiny models in real ranks ---------------------------------------------------------------------

def write_tiny_folder(path, seed=0, **over):
    """A tiny random Llama as a Hugging Face folder (every rank loads it from disk)."""
    lm = make_tiny_model(seed=seed, **over)
    cfg = lm.config
    sd = {}
    D, nq, nk, ff = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    for k, v in lm.model.state_dict().items():
        if k.startswith("rope") or (k == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if "qkv_proj" in k:
            q, kk, vv = v.split([nq * D, nk * D, nk * D])
            for n, t in (("q", q), ("k", kk), ("v", vv)):
                sd[k.replace("qkv_proj", f"self_attn.{n}_proj")] = t.contiguous()
        elif "gate_up_proj" in k:
            g, u = v.split([ff, ff])
            sd[k.replace("gate_up_proj", "mlp.gate_proj")] = g.contiguous()
            sd[k.replace("gate_up_proj", "mlp.up_proj")] = u.contiguous()
        else:
            sd[k] = v.contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, "model.safetensors"))
    d = dataclasses.asdict(cfg)
    d["model_type"] = "llama"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return str(path)


def generate(eng, reqs):
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in reqs]
    outs = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r] for r in rids]


TINY_SHAPES = {
    # 1 KV head on 2 ranks: replicated, each rank 2 of its 4 query heads; vocab 509 = 255 + 254
    "replicated-kv": dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=509, tie_word_embeddings=True),
    # 3 KV groups on 2 ranks (2 + 1, as the default model), MLP 96 = 64 + 32, vocab 511
    "uneven": dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96,
                   vocab_size=511),
}


@pytest.mark.parametrize("shape,backend", [("replicated-kv", "shm"), ("uneven", "shm")])
def test_tiny_models_split_give_the_reference_tokens(tmp_path, shape, backend):
    folder = write_tiny_folder(tmp_path / "m", **TINY_SHAPES[shape])
    ref_model = load_model(folder, dtype="float32").model
    reqs = make_requests(seed=3, n=16, vocab=ref_model.cfg.vocab_size)
    reqs = [(p[:100], min(n, 24)) for p, n in reqs]
    ref = reference_outputs(ref_model, reqs)
    eng = LLMEngine(model=folder, dtype="float32", tensor_parallel_size=2, tensor_parallel_backend=backend,
                    kv_cache_memory=SMALL_KV, max_num_batched_tokens=256)
    try:
        eng.keep_history = True
        got = generate(eng, reqs)
        compare(got, ref, max_ties=1)
        assert_no_leaks(eng)
        # the split ran: 2 all-reduces a layer + 1 for the embedding per step; the logits gathered
        # once per step that samples; batches of several sequences
        L = ref_model.cfg.num_hidden_layers
        counts = eng.runner.comm.counts
        assert counts["all_reduce"] == (2 * L + 1) * eng.stats.steps
        assert 0 < counts["gather"] <= eng.stats.steps
        assert max(s.num_seqs for s in eng.stats.history) > 1
        assert eng.model.layers[0].n_heads == (2 if shape == "replicated-kv" else 4)
        assert len(eng.tp.rank_weight_bytes) == 2 and min(eng.tp.rank_weight_bytes) > 0
    finally:
        eng.close()


def test_three_ranks_over_gloo_with_chunked_prefill_prefix_caching_and_preemption(tmp_path):
    folder = write_tiny_folder(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, vocab_size=500)
    ref_model = load_model(folder, dtype="float32").model
    reqs = make_requests(seed=5, n=12, vocab=500, shared_prefixes=2)
    reqs = [(p[:160], min(n, 40)) for p, n in reqs]
    ref = reference_outputs(ref_model, reqs)
    # 40 blocks of 16 for 12 sequences of up to 200 tokens: preemptions; 64-token chunks
    eng = LLMEngine(model=folder, dtype="float32", tensor_parallel_size=3, tensor_parallel_backend="gloo",
                    num_kv_blocks=40, max_num_batched_tokens=64)
    try:
        got = generate(eng, reqs)
        compare(got, ref, max_ties=1)
        assert eng.stats.preemptions > 0 and eng.block_manager.hits > 0 and eng.stats.max_prefill_chunks > 1
        assert eng.runner.comm.counts["all_reduce"] == 5 * eng.stats.steps  # 2 layers: 2 x 2 + the embedding
        assert_no_leaks(eng)
        # the rendezvous file's directory: private to this process, and gone with the group
        store_dir = eng.tp._dir
        assert os.path.basename(store_dir).startswith(f"inferd-tp-{os.getpid()}-") and os.path.isdir(store_dir)
    finally:
        eng.close()
    assert not os.path.exists(store_dir)


def step_after_killing_rank_1(tmp_path) -> tuple[pytest.ExceptionInfo, float]:
    """A TP=2 engine mid-request, rank 1 SIGKILLed, then stepped: the CollectiveError it raised and
    the seconds from the kill to it."""
    folder = write_tiny_folder(tmp_path / "m")
    eng = LLMEngine(model=folder, dtype="float32", tensor_parallel_size=2, kv_cache_memory=SMALL_KV)
    try:
        eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=200, temperature=0))
        eng.step()
        os.kill(eng.tp.executor.procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="rank 1|a rank stopped") as err:
            while eng.has_unfinished():
                eng.step()
        return err, time.monotonic() - t0
    finally:
        eng.close()


def test_a_rank_that_dies_is_an_engine_fault_not_a_hang(tmp_path):
    """Not a hang: the fault is the watchdog's, naming the rank and how it ended, not the collective's
    timeout (INFERD_TP_TIMEOUT, 120 s) running out."""
    err, _ = step_after_killing_rank_1(tmp_path)
    assert "tensor-parallel rank 1 exited with -9" in str(err.value), err.value


@pytest.mark.integration
def test_a_rank_that_dies_is_an_engine_fault_within_seconds(tmp_path):
    _, seconds = step_after_killing_rank_1(tmp_path)
    assert seconds < 30


def test_options_that_do_not_combine_are_clear_errors():
    with pytest.raises(InferdError, match="disaggregated"):
        LLMEngine(dtype="float32", tensor_parallel_size=2, role="decode")
    with pytest.raises(InferdError, match="self-draft"):
        LLMEngine(dtype="float32", tensor_parallel_size=2, speculative_method="draft", draft_model="self:layers=4")


# -- the real default model ------------------------------------------------------------------------

PROMPTS = [f"{q} {i}" for i, q in enumerate([
    "The history of the Roman empire begins", "def fibonacci(n):", "Write a haiku about autumn.",
    "The three primary colours are", "In 1969, the first person to walk on the moon", "import numpy as np\n",
    "My favourite recipe for pancakes", "The capital of Australia is", "Explain photosynthesis simply:",
    "SELECT name FROM users WHERE", "Once upon a time, in a small village,", "The speed of light is",
    "A good night's sleep helps", "The largest ocean on Earth is", "To be or not to be,",
    "List three prime numbers:"])]



@pytest.fixture(scope="module")
def one_rank(default_gguf_path):
    """TP=1 at 2 threads, fp32: one prompt's prefill and 32 decode steps, and 16 requests in one
    batch, with the logits each token came from; and the reference loop's run of the one prompt."""
    from inferd.engine.reference import reference_generate

    eng = LLMEngine(model=default_gguf_path, quantization="none", dtype="float32", kv_cache_memory=SMALL_KV, threads=2)
    tok = eng.tokenizer
    ids = tok.encode(PROMPTS[0])
    out = {"tok": tok, "ids": ids, "batch_in": [(tok.encode(p), 24) for p in PROMPTS]}
    out["trace"] = run_recording(eng, [(ids, 33)])[0]
    out["batch"] = run_recording(eng, out["batch_in"])
    out["loop"] = reference_generate(eng.model, ids, 33, keep_logits=True)
    eng.close()
    return out


def test_real_model_two_ranks_against_one(default_gguf_path, one_rank):
    """fp32, the default model.
    1. One prompt's prefill and 32 decode steps: the largest logit difference of TP=2 against TP=1
       is at most 4x what two correct fp32 orders of the same sums differ by: TP=1 at 1 against 2
       threads (on some CPUs exactly 0: the GEMV splits output rows over threads, no sum is
       reordered), and TP=1 against the reference loop (SDPA, unpaged, unfused).
    2. 16 requests in one batch: TP=2's greedy tokens are TP=1's under the near-tie cut.
    3. The split ran: 61 all-reduces a step (2 x 30 layers + the vocab-parallel embedding), one
       logits gather a step, and each rank holds its share of the weights (as that rank counts them)."""
    ids = one_rank["ids"]
    eng = LLMEngine(model=default_gguf_path, quantization="none", dtype="float32", kv_cache_memory=SMALL_KV, threads=1)
    t1, l1 = run_recording(eng, [(ids, 33)])[0]
    eng.close()
    eng = LLMEngine(model=default_gguf_path, quantization="none", dtype="float32", kv_cache_memory=SMALL_KV,
                    tensor_parallel_size=2)
    try:
        tp, ltp = run_recording(eng, [(ids, 33)])[0]
        assert eng.runner.comm.counts["all_reduce"] == 61 * eng.stats.steps
        assert eng.runner.comm.counts["gather"] == eng.stats.steps
        b0, b1 = eng.tp.rank_weight_bytes  # rank 0: 6 query heads (2 KV groups), rank 1: 3 (1)
        assert b0 - b1 == 30 * (4 * 576 * 64) * (3 + 3 + 2)
        eng.keep_history = True
        batch = run_recording(eng, one_rank["batch_in"])
        assert max(s.num_seqs for s in eng.stats.history) == 16
        assert_no_leaks(eng)
    finally:
        eng.close()
    (t2, l2), ref = one_rank["trace"], one_rank["loop"]
    assert t1 == t2 == tp == ref.token_ids
    lref = torch.stack(list(ref.logits))
    threads, loop = float((l1 - l2).abs().max()), float((l2 - lref).abs().max())
    d = float((ltp - l2).abs().max())
    print(f"max |logit diff|: TP2 vs TP1 {d:.2e}; TP1 1 vs 2 threads {threads:.2e}; TP1 vs reference loop {loop:.2e}")
    assert 0 < d <= 4 * max(threads, loop)
    compare([t for t, _ in batch], one_rank["batch"], max_ties=2)


@pytest.mark.parametrize("quant", [dict(quantization="gguf", dense_quant=True), dict(quantization="int8")],
                         ids=["gguf", "int8"])
def test_real_model_quantized_with_ngram_speculation(default_gguf_path, quant):
    """The quantized layers shard on their codes (int8: on inferd's Q8_0 kernel) or, for gguf, on
    the file's exact 4-bit values (PyTorch's int4 kernel takes ~40 ms a layer with fp32 activations:
    minutes a test; its codes' split is checked bit for bit below). n-gram guesses are verified by
    the split model. Reference: the same quantized model at TP=1 without speculation."""
    one = LLMEngine(model=default_gguf_path, dtype="float32", kv_cache_memory=SMALL_KV, **quant)
    prompts = [one.tokenizer.encode(p + " " + p) for p in PROMPTS[:6]]  # repeated text: n-gram hits
    ref = run_recording(one, [(p, 12) for p in prompts])
    one.close()
    eng = LLMEngine(model=default_gguf_path, dtype="float32", tensor_parallel_size=2, kv_cache_memory=SMALL_KV,
                    speculative_method="ngram", num_speculative_tokens=3, **quant)
    try:
        got = generate(eng, [(p, 12) for p in prompts])
        assert eng.spec.stats.num_draft_tokens > 0 and eng.spec.stats.num_accepted_tokens > 0
        assert_no_leaks(eng)
    finally:
        eng.close()
    compare(got, ref, max_ties=1)


def test_suffix_decoding_across_ranks(default_gguf_path):
    """Suffix decoding at TP=2: the cost model's timed steps run on both ranks (a rank that missed
    one would hang the next collective), the guesses are verified by the split model; outputs equal
    TP=1 without speculation. The same prompts twice: the second pass drafts from the first's
    outputs."""
    quant = dict(quantization="int8")
    one = LLMEngine(model=default_gguf_path, dtype="float32", kv_cache_memory=SMALL_KV, **quant)
    prompts = [one.tokenizer.encode(p) for p in PROMPTS[:4]]
    ref = run_recording(one, [(p, 12) for p in prompts])
    one.close()
    eng = LLMEngine(model=default_gguf_path, dtype="float32", tensor_parallel_size=2, kv_cache_memory=SMALL_KV,
                    max_num_seqs=4, speculative_config={"method": "suffix", "num_speculative_tokens": 4}, **quant)
    try:
        assert eng.spec.cost is not None and len(eng.spec.cost.rows) >= 2
        got = generate(eng, [(p, 12) for p in prompts])
        again = generate(eng, [(p, 12) for p in prompts])
        assert eng.spec.stats.num_cache_drafts > 0
        assert_no_leaks(eng)
    finally:
        eng.close()
    assert compare(got, ref, max_ties=1) <= 1 and compare(again, ref, max_ties=1) <= 1


class Summed:
    """An all-reduce that does nothing: each rank's partial sums, looked at alone."""
    def all_reduce_(self, x):
        pass


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_packed_layers_shard_exactly(method):
    """With --quantize-activations the split layers are the unsplit ones' rows and column blocks bit
    for bit (the int8 activation blocks of 32 are never cut). Token equality with TP=1 is not
    asked of this path: its activation rounding turns the all-reduce's reordered fp32 sums (~1e-7)
    into flipped int8 codes (on the default model a 1e-7 relative nudge of the embedding moves
    logits by ~0.5), as any change of summation order would."""

    from inferd.quant import quantize
    from inferd.quant.w4a8 import quantize_activations

    def model():  # the same random model, quantized the same way, each call
        lm = make_tiny_model(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=128)
        quantize(lm.model, method, group_size=32)
        return lm

    lm = model()
    full = lm.model
    for shard in plan(6, 3, 128, lm.config.vocab_size, 2):  # the codes PyTorch's kernels get, cut
        f, r = full.layers[0].down_proj, apply_tp(model().model, shard, Summed()).layers[0].down_proj.inner
        a, b = shard.ff
        for x, y in zip(f.codes(), r.codes()):
            assert torch.equal(x[:, a * x.shape[1] // 128: b * x.shape[1] // 128], y) if x.dim() == 2 else torch.equal(x, y)
    quantize_activations(full)
    cfg = lm.config
    D, nq, nk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h = torch.randn(7, cfg.hidden_size)
    for shard in plan(nq, nk, cfg.intermediate_size, cfg.vocab_size, 2):
        m = apply_tp(model().model, shard, Summed())
        quantize_activations(m)
        f, r = full.layers[0], m.layers[0]
        q0, q1 = shard.q_heads[0], shard.q_heads[-1] + 1
        k0, k1 = shard.kv_heads[0], shard.kv_heads[-1] + 1
        cols = list(range(q0 * D, q1 * D)) + list(range((nq + k0) * D, (nq + k1) * D)) \
            + list(range((nq + nk + k0) * D, (nq + nk + k1) * D))
        assert torch.equal(r.qkv_proj(h), f.qkv_proj(h)[:, cols])
        a, b = shard.ff
        ff = cfg.intermediate_size
        assert torch.equal(r.gate_up_proj(h), f.gate_up_proj(h)[:, list(range(a, b)) + list(range(ff + a, ff + b))])
        x = torch.randn(7, ff)
        xr = torch.zeros_like(x)
        xr[:, a:b] = x[:, a:b]
        assert torch.equal(r.down_proj(x[:, a:b].contiguous()), f.down_proj(xr))
        o = torch.randn(7, nq * D)
        orr = torch.zeros_like(o)
        orr[:, q0 * D:q1 * D] = o[:, q0 * D:q1 * D]
        assert torch.equal(r.o_proj(o[:, q0 * D:q1 * D].contiguous()), f.o_proj(orr))


# -- through `inferd serve` -------------------------------------------------------------------------

def rank_pids(core: int) -> list[int]:
    """The tensor-parallel ranks an engine core process started."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == core and b"inferd.distributed.tp_worker" in cmd:
            out.append(int(d))
    return out


def test_served_with_the_openai_client_then_a_rank_killed_under_a_stream(one_rank, tmp_path):
    """`inferd serve --tensor-parallel-size 2`:
    1. 16 concurrent requests from the official client get the texts of TP=1's greedy tokens (cut
       where TP=1's top-2 logits are within 1e-4);
    2. then a rank killed under a stream: the stream ends with an error naming the rank, /health is
       503, and the server exits non-zero by itself, with no traceback."""
    import threading

    import httpx
    import openai

    from conftest import ServerProc
    from test_engine_process import core_pid

    srv = ServerProc(["--quantization", "none", "--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-memory", SMALL_KV,
                      "--max-num-seqs", "16"], log_path=tmp_path / "serve.log")
    try:
        tok = one_rank["tok"]
        ref = [(ids[:16], logits[:16]) for ids, logits in one_rank["batch"]]
        srv.wait_ready()
        wait_for_log(lambda: srv.log_text(100_000), "tensor parallel: 2 ranks over shm")
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        texts: dict = {}

        def ask(i):
            r = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=16, temperature=0)
            texts[i] = r.choices[0].text
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        compare_texts(texts, ref, tok, max_ties=2)

        ranks = rank_pids(core_pid(srv))
        assert len(ranks) == 1
        body = {"prompt": "Count to a thousand:", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = stream_then_kill(srv.base, body, ranks[0])
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert "tensor-parallel rank 1 exited with -9" in err["error"]["message"], events[-3:]
        assert httpx.get(srv.base + "/health", timeout=5).status_code == 503
        srv.proc.wait(30)  # bounded: the server exits by itself, non-zero
        assert srv.proc.returncode == 3
        assert "Traceback" not in srv.log_text(100_000)
    finally:
        srv.stop()


def test_torchrun_starts_the_ranks_instead_of_inferd(tmp_path):
    """`torchrun --nproc-per-node 2 -m inferd generate -tp 2`: rank 0 is the engine, rank 1 the
    worker loop, over gloo (env:// rendezvous on loopback); the text is TP=1's."""
    import subprocess
    import sys

    from helpers import write_tiny_chat_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_chat_gguf(path)
    from inferd.engine.llm import LLM

    gen = ["-m", "inferd", "generate", "--model", path, "--dtype", "float32", "--prompt", "Hello there",
           "--max-tokens", "12", "--temperature", "0"]
    # torchrun's agent keeps a run directory (torchelastic_*) in TMPDIR it does not remove: the test's own
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(tmp_path)}
    with LLM(model=path, dtype="float32") as llm:
        want = llm.generate(["Hello there"], SamplingParams(max_tokens=12, temperature=0))[0].text.strip()
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *gen, "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    # one copy of the text: rank 1 ran the worker loop, not a generate of its own
    assert two.stdout.strip() == want and want

"""Tensor parallelism (inferd.engine.parallel, inferd.model.tensor_parallel): real ranks in real
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
from helpers import assert_no_leaks, compare, make_requests, reference_outputs

from inferd.engine.engine import LLMEngine
from inferd.engine.parallel.comm import CollectiveError
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError
from inferd.loader import load_model
from inferd.model.tensor_parallel import apply_tp, plan, split_evenly
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
    full = load_model(default_gguf_path, dtype="float32", with_tokenizer=False).model
    whole = weight_bytes(full)
    replicated = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n) + full.rope.inv_freq.numel() * 4
    cfg = full.cfg
    shares = []
    for shard in plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size, 2):
        m = load_model(default_gguf_path, dtype="float32", with_tokenizer=False).model
        shares.append(weight_bytes(apply_tp(m, shard, comm=None)))
    assert sum(shares) == whole + replicated
    # rank 0 holds 2 of the 3 KV groups (6 query heads), rank 1 one (3); the MLP and vocab split evenly:
    # the difference is 3 heads' q rows and o columns and one head's k and v rows, in every layer
    head = 4 * cfg.hidden_size * cfg.head_dim  # fp32 bytes of one head's rows (or columns) of a projection
    assert shares[0] - shares[1] == cfg.num_hidden_layers * head * (3 + 3 + 2)


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


@pytest.mark.parametrize("shape,backend", [("replicated-kv", "shm"), ("uneven", "shm"), ("uneven", "gloo")])
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
        assert compare(got, ref) <= 1
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


def test_three_ranks_with_chunked_prefill_prefix_caching_and_preemption(tmp_path):
    folder = write_tiny_folder(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, vocab_size=500)
    ref_model = load_model(folder, dtype="float32").model
    reqs = make_requests(seed=5, n=12, vocab=500, shared_prefixes=2)
    reqs = [(p[:160], min(n, 40)) for p, n in reqs]
    ref = reference_outputs(ref_model, reqs)
    # 40 blocks of 16 for 12 sequences of up to 200 tokens: preemptions; 64-token chunks
    eng = LLMEngine(model=folder, dtype="float32", tensor_parallel_size=3, num_kv_blocks=40,
                    max_num_batched_tokens=64)
    try:
        got = generate(eng, reqs)
        assert compare(got, ref) <= 1
        assert eng.stats.preemptions > 0 and eng.block_manager.hits > 0 and eng.stats.max_prefill_chunks > 1
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_a_rank_that_dies_is_an_engine_fault_not_a_hang(tmp_path):
    folder = write_tiny_folder(tmp_path / "m")
    eng = LLMEngine(model=folder, dtype="float32", tensor_parallel_size=2, kv_cache_memory=SMALL_KV)
    try:
        eng.add_request(list(range(1, 30)), SamplingParams(max_tokens=200, temperature=0))
        eng.step()
        os.kill(eng.tp.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="rank 1|a rank stopped"):
            while eng.has_unfinished():
                eng.step()
        assert time.monotonic() - t0 < 30
    finally:
        eng.close()


def test_options_that_do_not_combine_are_clear_errors():
    with pytest.raises(InferdError, match="disaggregated"):
        LLMEngine(dtype="float32", tensor_parallel_size=2, role="decode")
    with pytest.raises(InferdError, match="self-draft"):
        LLMEngine(dtype="float32", tensor_parallel_size=2, speculative_method="draft", draft_model="self:layers=4")

"""The engine against the reference loop: every lossless optimisation must give its greedy tokens.

Sweeps run on a tiny random model; each test also asserts that the machinery it is about really ran
(a mixed batch, a preemption, a chunked prompt, prefix-cache hits) and that no KV block leaked.
"""
import random

import pytest

from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.engine.reference import reference_generate
from helpers import N_REQ, assert_no_leaks, compare, make_requests, reference_outputs, run_engine  # noqa: F401

@pytest.fixture(scope="module")
def workload(tiny_model):
    reqs = make_requests()
    return reqs, reference_outputs(tiny_model.model, reqs)


def test_default_settings(tiny_model, workload):
    reqs, ref = workload
    got, eng = run_engine(tiny_model, reqs, keep_history=True)
    print("near ties:", compare(got, ref, max_ties=1))
    s = eng.stats
    assert s.max_mixed_batch_seqs >= 8, "no step mixed prefill and decode across >= 8 sequences"
    assert s.max_batch_seqs >= 16
    assert s.prefill_tokens == sum(len(p) for p, _ in reqs) - eng.block_manager.hits


def test_preemption_under_a_small_pool(tiny_model, workload):
    reqs, ref = workload
    got, eng = run_engine(tiny_model, reqs, num_kv_blocks=48, block_size=16)
    print("near ties:", compare(got, ref, max_ties=1), "preemptions:", eng.stats.preemptions)
    assert eng.stats.preemptions >= 1
    assert eng.stats.recompute_tokens > 0


def test_chunked_prefill_small_budget(tiny_model, workload):
    reqs, ref = workload
    got, eng = run_engine(tiny_model, reqs, max_num_batched_tokens=24)
    print("near ties:", compare(got, ref, max_ties=1))
    assert eng.stats.max_prefill_chunks >= 3


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(tiny_model, workload, block_size):
    reqs, ref = workload
    got, eng = run_engine(tiny_model, reqs, block_size=block_size)
    print("near ties:", compare(got, ref, max_ties=1))
    assert eng.stats.max_batch_seqs >= 8


def test_static_scheduling(tiny_model, workload):
    reqs, ref = workload
    eng = LLMEngine(loaded=tiny_model, dtype="float32", scheduling="static", max_num_seqs=16)
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in reqs]
    outs = {rid: [] for rid in rids}
    batches, finished = [], set()
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        batch = eng.scheduler.static_batch
        if batch and (not batches or not batch <= batches[-1]):
            # a new batch forms only once every member of the previous one has finished
            assert not batches or batches[-1] <= finished
            batches.append(set(batch))
        assert {r.request_id for r in eng.scheduler.running} <= batch
    assert_no_leaks(eng)
    print("near ties:", compare([outs[r] for r in rids], ref, max_ties=1))
    assert len(batches) == N_REQ // 16 and all(len(b) == 16 for b in batches)


def test_prefix_caching_shared_prefixes(tiny_model):
    reqs = make_requests(seed=1, n=48, shared_prefixes=4)
    ref = reference_outputs(tiny_model.model, reqs)
    got, eng = run_engine(tiny_model, reqs, max_num_seqs=8)
    print("near ties:", compare(got, ref, max_ties=1))
    bm = eng.block_manager
    prompt_tokens = sum(len(p) for p, _ in reqs)
    assert bm.hits > prompt_tokens // 3, (bm.hits, prompt_tokens)
    assert eng.stats.prefill_tokens == prompt_tokens - bm.hits
    # and off: nothing is reused
    got2, eng2 = run_engine(tiny_model, reqs, max_num_seqs=8, enable_prefix_caching=False)
    compare(got2, ref, max_ties=1)
    assert eng2.block_manager.hits == 0 and eng2.stats.prefill_tokens == prompt_tokens


def test_preemption_with_prefix_caching_and_chunking(tiny_model):
    reqs = make_requests(seed=2, n=32, shared_prefixes=3)
    ref = reference_outputs(tiny_model.model, reqs)
    got, eng = run_engine(tiny_model, reqs, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64)
    print("near ties:", compare(got, ref, max_ties=1))
    assert eng.stats.preemptions >= 1
    bm = eng.block_manager
    assert eng.stats.prefill_tokens == sum(len(p) for p, _ in reqs) - bm.hits


def test_seeded_sampling_alone_and_in_batch(tiny_model):
    prompt = [5, 9, 33, 100, 7]
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone, _ = run_engine(tiny_model, [], max_num_seqs=32) if False else (None, None)
    eng = LLMEngine(loaded=tiny_model, dtype="float32")
    rid = eng.add_request(prompt, SamplingParams(**params))
    toks = []
    while eng.has_unfinished():
        for o in eng.step():
            toks.extend(o.new_token_ids)
    eng2 = LLMEngine(loaded=tiny_model, dtype="float32")
    rng = random.Random(3)
    for i in range(16):
        other = [rng.randrange(512) for _ in range(rng.randint(1, 80))]
        eng2.add_request(other, SamplingParams(max_tokens=rng.randint(1, 40), temperature=1.0, seed=i))
    rid2 = eng2.add_request(prompt, SamplingParams(**params))
    toks2 = []
    max_batch = 0
    while eng2.has_unfinished():
        for o in eng2.step():
            if o.request_id == rid2:
                toks2.extend(o.new_token_ids)
        max_batch = max(max_batch, eng2.stats.max_batch_seqs)
    assert max_batch >= 17
    assert toks == toks2
    # the reference loop draws the same tokens from the same seed
    ref = reference_generate(tiny_model.model, prompt, 24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    assert ref.token_ids == toks
    # another seed gives another sample
    eng3 = LLMEngine(loaded=tiny_model, dtype="float32")
    eng3.add_request(prompt, SamplingParams(**{**params, "seed": 99}))
    toks3 = []
    while eng3.has_unfinished():
        for o in eng3.step():
            toks3.extend(o.new_token_ids)
    assert toks3 != toks


def test_abort_frees_blocks(tiny_model):
    eng = LLMEngine(loaded=tiny_model, dtype="float32")
    ids = [eng.add_request(list(range(1, 100)), SamplingParams(max_tokens=50, temperature=0)) for _ in range(4)]
    eng.step()
    eng.step()
    assert eng.block_manager.num_used > 0
    for rid in ids:
        assert eng.abort(rid)
    assert_no_leaks(eng)


def test_admission_errors(tiny_model):
    from inferd.errors import InferdError

    eng = LLMEngine(loaded=tiny_model, dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(InferdError, match="KV blocks"):
        eng.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(InferdError, match="context"):
        eng.add_request(list(range(500)), SamplingParams(max_tokens=100))
    with pytest.raises(InferdError, match="token ids"):
        eng.add_request([1, 2, 9999], SamplingParams(max_tokens=1))
    assert_no_leaks(eng)

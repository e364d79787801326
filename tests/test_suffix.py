"""Suffix decoding (inferd.engine.speculative.suffix) and the cost model (cost.py): the structures
by themselves, the shared cache's bound and isolation, the choice of draft lengths, vLLM's
--speculative-config spelling; then the engine: lossless greedy at batch 1 and 16 with preemption,
prefix caching, a grammar and LoRA rows in the batch, the distribution kept under sampling, the
cost model skipping rows that do not pay, and the counters that prove each path ran."""
from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from inferd.config import EngineConfig, parse_speculative_config
from inferd.engine.engine import LLMEngine
from inferd.engine.request import Request, SamplingParams
from inferd.engine.speculative.cost import Calibration, StepCost, choose_lengths
from inferd.engine.speculative.suffix import SuffixCache, SuffixProposer, TokenIndex, walk
from inferd.errors import InferdError
from helpers import assert_speculated, compare, make_requests, mixed_requests, reference_outputs


# -- the structures -----------------------------------------------------------------------------

def _req(rid, prompt, out=(), **params):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64, temperature=0, **params))
    r.output_ids = list(out)
    return r


def test_index_finds_the_longest_context_and_counts_continuations():
    idx = TokenIndex(vocab=100)
    idx.extend(0, [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 7, 1, 2, 3, 4])
    ctx = idx.seqs[0]
    cands = idx.candidates(ctx)  # the last three tokens (2 3 4) occurred twice before with a token after
    assert sorted(p for _, p in cands) == [4, 9]
    prop = SuffixProposer(vocab=100, max_cached_requests=0)
    d = prop.draft(_req("a", [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 7, 1, 2, 3, 4]), 8)
    # "1 2 3 4" is the longest context that occurred before (at 0): its continuation, share 1
    assert d.match_len == 4 and d.tokens[:4] == [9, 9, 2, 3] and d.probs[:4] == [1.0] * 4
    assert d.source == "request"
    # a draft is at most spec_factor x the context's length (vLLM's max_spec_factor)
    prop = SuffixProposer(vocab=100, spec_factor=0.5, max_cached_requests=0)
    assert len(prop.draft(_req("a", [1, 2, 3, 4, 9, 9, 2, 3, 4, 5, 7, 1, 2, 3, 4]), 8).tokens) == 2


def test_a_copy_goes_on_past_the_models_own_tokens():
    """A request copying its prompt: a token of its own in place of the source's (a renamed word)
    gives an edit draft past the replaced token; a few tokens added, then the copy resumed, realign
    at once on the source's nearest occurrence; exact copying never needs one."""
    src = list(range(100, 160))
    prop = SuffixProposer(vocab=1000, max_cached_requests=0)
    r = _req("a", src + [1], src[:6])
    d = prop.draft(r, 8)
    assert d.tokens == src[6:12] and not d.edit  # 6 tokens of context: 6 guesses (spec factor 1)
    r.output_ids = src[:10] + [999]  # 4 accepted, then its own token in place of src[10]
    d = prop.draft(r, 8)
    assert d.edit and d.tokens == src[11:17] and d.match_len == 6
    r.output_ids += src[11:13] + [998]  # 2 accepted, then a token added: nothing to go on
    assert prop.draft(r, 8) is None
    r.output_ids += [src[13]]  # the copy resumes: realigned on the source's src[13]
    d = prop.draft(r, 8)
    assert d.edit and d.tokens == src[14:20]
    r.output_ids += src[14:20]
    d = prop.draft(r, 8)
    assert not d.edit and d.tokens[:4] == src[20:24]


def test_walk_follows_the_majority_and_stops_below_min_prob():
    s1, s2, s3 = [5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 1, 2]
    occ = [(s1, 1), (s2, 1), (s3, 1)]  # all three after "5"
    toks, probs, support, score, live = walk(occ, 3, min_prob=0.1)
    assert toks == [6, 7, 8] and probs == [1.0, 2 / 3, 0.5] and support == [3, 3, 2]
    assert score == pytest.approx(1 + 2 / 3 + 1 / 3) and live == [(s1, 1)]
    toks, *_ = walk(occ, 3, min_prob=0.5)  # 1 * 2/3 = 0.67 >= 0.5, then 0.33 < 0.5: stop
    assert toks == [6, 7]


def test_drop_removes_exactly_a_sequences_entries():
    rng = random.Random(0)
    idx = TokenIndex(vocab=20)
    seqs = {sid: [rng.randrange(20) for _ in range(rng.randint(1, 60))] for sid in range(8)}
    for sid, s in seqs.items():
        idx.extend(sid, s[:len(s) // 2])
        idx.extend(sid, s[len(s) // 2:])  # in two pieces: the entry across the seam too
    assert idx.num_entries() == sum(max(0, len(s) - 1) + max(0, len(s) - 2) for s in seqs.values())
    for sid in (3, 0, 7):
        assert idx.drop(sid) == len(seqs.pop(sid))
    assert idx.num_tokens == sum(len(s) for s in seqs.values())
    assert idx.num_entries() == sum(max(0, len(s) - 1) + max(0, len(s) - 2) for s in seqs.values())
    for sid in list(seqs):
        idx.drop(sid)
    assert not idx.bi and not idx.tri and idx.num_tokens == 0


def test_shared_cache_drafts_across_requests_within_a_namespace_only():
    prop = SuffixProposer(vocab=1000)
    text = list(range(100, 160))
    first = _req("a", [1, 2, 3], text)
    prop.draft(first, 8)  # indexes its output into the shared cache
    prop.free("a")
    # another request that starts writing the same text drafts its continuation from the cache
    d = prop.draft(_req("b", [7, 8], text[:5]), 8)
    assert d is not None and d.source == "cache" and d.tokens == text[5:10]
    assert prop.from_cache == 1
    # another tenant (cache_salt) or adapter sees nothing of it; nor does a request that opted out
    assert prop.draft(_req("c", [7, 8], text[:5], cache_salt="tenant-2"), 8) is None
    lora = _req("d", [7, 8], text[:5])
    lora.lora = "adapter-1"
    assert prop.draft(lora, 8) is None
    assert prop.draft(_req("e", [7, 8], text[:5], suffix_cache=False), 8) is None
    # ... and an opted-out request's output is not kept
    prop.draft(_req("f", [9], list(range(500, 540)), suffix_cache=False), 4)
    prop.free("f")
    assert prop.draft(_req("g", [7], list(range(500, 505))), 4) is None


def test_shared_cache_stays_within_its_bound():
    """Fed five times its bound in tokens: it keeps at most the bound, drops the least recently used
    first, its index holds exactly the entries of what it keeps, and its memory stops growing."""
    bound = 5_000
    cache = SuffixCache(vocab=50_000, max_requests=10_000, max_tokens=bound)
    rng = random.Random(1)

    def feed(n_tokens):
        fed = 0
        while fed < n_tokens:
            sid = cache.new_seq((None, rng.choice([None, "t1", "t2"])))
            n = rng.randint(50, 400)
            for i in range(0, n, 37):  # as a running request grows
                cache.extend(sid, [rng.randrange(50_000) for _ in range(min(37, n - i))])
            fed += n
            assert cache.num_tokens <= bound
    gc.collect()
    tracemalloc.start()
    feed(bound)
    gc.collect()
    at_bound = tracemalloc.get_traced_memory()[0]
    feed(4 * bound)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert cache.evicted > 0 and cache.num_tokens <= bound
    kept = sum(len(s) for idx in cache.spaces.values() for s in idx.seqs.values())
    assert kept == cache.num_tokens
    assert cache.num_entries() == sum(max(0, len(s) - 1) + max(0, len(s) - 2)
                                      for idx in cache.spaces.values() for s in idx.seqs.values())
    print(f"memory at the bound {at_bound / 2**20:.1f} MiB, after 5x {after / 2**20:.1f} MiB "
          f"({after / bound:.0f} bytes a token)")
    assert after < 1.5 * at_bound
    # least recently used first: a sequence touched (drafted from) survives one that was not
    c = SuffixCache(vocab=100, max_requests=2, max_tokens=1000)
    a, b = c.new_seq(()), c.new_seq(())
    c.extend(a, [1, 2, 3])
    c.extend(b, [4, 5, 6])
    c.touch([a])
    c.new_seq(())
    assert c.alive(a) and not c.alive(b)
    # a count bound of requests too (vLLM's suffix_decoding_max_cached_requests)
    assert len(c.lru) == 2


# -- the cost model -----------------------------------------------------------------------------

def test_step_cost_is_monotone_and_bounded_by_single_rows():
    c = StepCost([(1, 1.0), (2, 5.0), (4, 1.2), (8, 2.0)])
    assert c(1) == 1.0 and c(2) == 1.2  # a noisy 5.0: no more than the larger step after it
    c = StepCost([(1, 1.0), (2, 1.5), (4, 9.0)])
    assert c(4) == 4.0  # never above four one-row steps
    c = StepCost([(1, 1.0), (2, 1.5), (4, 1.2)])
    c.seen[1] = 1
    c._fit()
    assert c(4) == 1.5  # never below a smaller step that steps have confirmed
    c = StepCost([(1, 1.0), (4, 1.3), (8, 2.0)])
    assert c(16) == pytest.approx(4.0)  # past the last point: proportional to the rows
    assert StepCost([(1, 1.0), (4, 1.3), (8, 2.1)])(6) == pytest.approx(1.7)


def test_step_cost_learns_from_the_steps_that_ran():
    """A curve measured while the machine was busy (rows dearer than they are) moves toward what
    the engine's steps take, where they take it; the points no step came near stay as measured."""
    c = StepCost([(1, 1.0), (4, 2.0), (16, 8.0), (64, 32.0)])
    for _ in range(200):
        c.observe(4, 1.1)
        c.observe(16, 1.4)
    assert c(4) == pytest.approx(1.1, rel=0.05) and c(16) == pytest.approx(1.4, rel=0.05)
    assert c(1) == 1.0 and c(64) == 32.0
    c.observe(10, 1.2)  # between points: the nearest one learns
    assert c(16) == pytest.approx(1.4, rel=0.1)


def test_choose_lengths_pays_for_rows():
    flat = StepCost([(1, 1.0), (64, 1.0)])  # rows are free: verify everything with a chance
    assert choose_lengths([[0.9, 0.5, 0.01], [0.2]], 2, 2, flat) == [3, 1]
    linear = StepCost([(1, 1.0), (64, 64.0)])  # every row costs a decode row: nothing pays
    assert choose_lengths([[0.9, 0.8], [0.7]], 16, 16, linear) == [0, 0]
    # batch 1, an extra row costs 5 %: a guess pays when it is accepted more than ~5 % of the time
    b1 = StepCost([(1, 1.0), (2, 1.05), (17, 1.8)])
    ks = choose_lengths([[0.99, 0.97, 0.9, 0.02]], 1, 1, b1)
    assert ks == [3]
    assert choose_lengths([[0.01]], 1, 1, b1) == [0]


def test_calibration_learns_from_verification():
    from inferd.engine.speculative.suffix import Draft

    cal = Calibration()
    d = Draft([1, 2, 3], [1.0, 1.0, 1.0], [1, 1, 1], 3, "request")
    first = cal.expected("r", d)
    assert 0 < first[2] < first[1] < first[0] < 1
    for _ in range(30):  # such drafts are never accepted: their expectation falls
        cal.update("r", d, 3, 0)
    low = cal.expected("r", d)
    assert low[0] < 0.2 * first[0]
    cal = Calibration()
    for _ in range(30):  # ... always accepted: it rises
        cal.update("s", d, 3, 3)
    assert cal.expected("s", d)[0] > 0.9


# -- configuration ------------------------------------------------------------------------------

def test_speculative_config_in_vllms_spelling():
    cfg = EngineConfig(speculative_config='{"method": "suffix", "num_speculative_tokens": 16, '
                                          '"suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_spec_factor": 2,'
                                          ' "suffix_decoding_min_token_prob": 0.2, '
                                          '"suffix_decoding_max_cached_requests": 500}').validate()
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.suffix_max_tree_depth, cfg.suffix_max_spec_factor,
            cfg.suffix_min_token_prob, cfg.suffix_max_cached_requests) == ("suffix", 16, 32, 2.0, 0.2, 500)
    # vLLM: suffix guesses as many tokens as the tree is deep unless told
    assert parse_speculative_config({"method": "suffix"})["num_speculative_tokens"] == 24
    ng = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                          "prompt_lookup_max": 3}).validate()
    assert (ng.speculative_method, ng.num_speculative_tokens, ng.ngram_min, ng.ngram_max) == ("ngram", 5, 2, 3)
    dm = EngineConfig(speculative_config='{"method": "draft_model", "model": "self:layers=1", '
                                         '"num_speculative_tokens": 2}').validate()
    assert (dm.speculative_method, dm.draft_model) == ("draft", "self:layers=1")


@pytest.mark.parametrize("value, msg", [
    ("{not json", "not valid JSON"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "suffix", "draft_tensor_parallel_size": 2}', "unknown or unsupported key"),
    ('{"method": "suffix", "num_speculative_tokens": "16"}', "num_speculative_tokens must be int"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "min_token_prob must be in"),
    ('{"method": "suffix", "num_speculative_tokens": 1000}', "at most 64"),
    ('[1]', "must be a JSON object"),
])
def test_bad_speculative_config_is_one_error(value, msg):
    with pytest.raises(InferdError, match=msg):
        EngineConfig(speculative_config=value).validate()


def test_speculative_config_and_method_together_are_refused():
    with pytest.raises(InferdError, match="not both"):
        EngineConfig(speculative_config='{"method": "suffix"}', speculative_method="ngram").validate()


# -- the engine: lossless, and the machinery proven to have run ---------------------------------

FLAT = StepCost([(1, 1.0), (1024, 1.0)], learn=False)  # rows for free: every guess with a chance is verified
STEEP = StepCost([(1, 1.0), (1024, 1024.0)], learn=False)  # every row costs a decode row: few guesses pay


def suffix_engine(loaded, cost=FLAT, k=8, **opts):
    """A suffix engine whose cost model is given (the one measured at start depends on the machine's
    load: a test that needs guesses verified, or skipped, says which costs it assumes)."""
    eng = LLMEngine(loaded=loaded, dtype="float32", speculative_method="suffix", num_speculative_tokens=k,
                    spec_cost_model=False, **opts)
    eng.spec.cost = cost
    return eng


def assert_guesses_accounted(sp):
    """Every guess proposed went somewhere: verified, skipped by the cost model, cut by a grammar or
    by the token budget."""
    assert sp.num_proposed_tokens == (sp.num_draft_tokens + sp.num_cost_skipped_tokens + sp.num_grammar_cut_tokens
                                      + sp.num_budget_cut_tokens), sp.as_dict()


def run_waves(eng, reqs, waves=2, params=None, lora=None):
    """The same requests `waves` times, each wave after the last finished (so later waves can draft
    from earlier outputs); every step checks the block pool. -> outputs per wave."""
    out = []
    for _ in range(waves):
        rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0) if params is None else params(i, n),
                                lora=lora(i) if lora else None) for i, (p, n) in enumerate(reqs)]
        got = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id].extend(o.new_token_ids)
            eng.block_manager.check_invariants(eng.scheduler.running)
        out.append([got[r] for r in rids])
    assert not eng.spec.pending and not eng.spec.proposer.seqs  # nothing of a finished request is kept
    return out


@pytest.fixture(scope="module")
def mixed16(tiny_model):
    reqs = mixed_requests(seed=5, n=16)
    return reqs, reference_outputs(tiny_model.model, reqs)


@pytest.mark.parametrize("batch", [1, 16])
def test_suffix_greedy_equals_the_reference(tiny_model, mixed16, batch):
    """Batch 1 and 16: two waves of the same 16 requests give the reference loop's tokens (near-tie
    rule); the second wave drafts the first one's outputs from the shared cache and accepts them."""
    reqs, ref = mixed16
    if batch == 1:  # a few requests suffice one at a time
        reqs, ref = reqs[:4], ref[:4]
    eng = suffix_engine(tiny_model, max_num_seqs=batch)
    w1, w2 = run_waves(eng, reqs)
    print("near ties:", compare(w1, ref, max_ties=1), compare(w2, ref, max_ties=1))
    assert eng.stats.max_batch_seqs == batch
    sp = eng.spec.stats
    assert_speculated(eng, min_rate=0.5)
    assert sp.num_cache_drafts > 0 and eng.spec.proposer.from_cache == sp.num_cache_drafts
    assert sp.num_verified_rows == sp.num_draft_tokens + sp.num_drafts
    assert sum(sp.accepted_per_pos) == sp.num_accepted_tokens and sp.accepted_per_pos[0] <= sp.num_drafts
    assert_guesses_accounted(sp)


def test_suffix_under_preemption_prefix_caching_and_a_small_budget(tiny_model):
    reqs = make_requests(seed=2, n=12, shared_prefixes=3)
    ref = reference_outputs(tiny_model.model, reqs)
    eng = suffix_engine(tiny_model, num_kv_blocks=40, block_size=8, max_num_batched_tokens=24)
    w1, w2 = run_waves(eng, reqs)
    print("near ties:", compare(w1, ref, max_ties=1), compare(w2, ref, max_ties=1), "preemptions:", eng.stats.preemptions)
    assert eng.stats.preemptions >= 1 and eng.block_manager.hits > 0
    assert_speculated(eng)
    assert_guesses_accounted(eng.spec.stats)
    assert eng.spec.stats.num_budget_cut_tokens > 0  # a 24-token budget trims guesses
    # a preempted request keeps its one sequence in the shared cache (none written twice)
    cache = eng.spec.proposer.cache
    assert len(cache.lru) == 2 * len(reqs)
    assert cache.num_tokens == sum(len(o) for o in w1 + w2)


def test_cost_model_skips_guesses_that_do_not_pay(tiny_model, mixed16):
    """With every row priced as a decode row, a batch of 16 verifies only guesses near certain: the
    guesses it skipped are counted, the outputs are the same."""
    reqs, ref = mixed16
    eng = suffix_engine(tiny_model, cost=STEEP)
    w1, w2 = run_waves(eng, reqs)
    compare(w1, ref, max_ties=1)
    compare(w2, ref, max_ties=1)
    sp = eng.spec.stats
    print(sp.as_dict())
    assert sp.num_cost_skipped_tokens > 0 and sp.num_cost_skipped_drafts > 0
    assert_guesses_accounted(sp)


def test_cache_salt_keeps_tenants_apart(tiny_model, mixed16):
    import itertools

    reqs, ref = mixed16
    reqs, ref = reqs[:6], ref[:6]
    eng = suffix_engine(tiny_model)
    tenant = itertools.count()
    salted = run_waves(eng, reqs, waves=2, params=lambda i, n: SamplingParams(
        max_tokens=n, temperature=0, cache_salt=f"tenant-{next(tenant)}"))
    for w in salted:
        compare(w, ref, max_ties=1)
    assert eng.spec.stats.num_cache_drafts == 0  # each request its own tenant: no one drafts from another


def test_the_measured_cost_model_runs_at_start(tiny_model, caplog):
    """Without a given curve the engine measures one (a few rows' steps through the runner) and logs
    it; the runner's path counters still count requests' steps only."""
    import logging

    with caplog.at_level(logging.INFO, logger="inferd"):
        eng = LLMEngine(loaded=tiny_model, dtype="float32", speculative_config='{"method": "suffix"}',
                        max_num_seqs=4, num_kv_blocks=64)
    cost = eng.spec.cost
    assert cost is not None and cost.rows[0] == 1 and cost.rows[-1] >= 2 and cost(1) > 0
    assert eng.runner.eager_decode_steps == 0 and eng.runner.attn.kernel_calls == 0
    assert "speculative cost model" in caplog.text
    assert eng.runner.attn.max_rows_per_chunk == 25  # 24 guesses (vLLM's default) + 1, through the decode kernel


def _tiny_adapter(path, cfg, seed=0, r=4):
    """A PEFT-format LoRA folder for every projection of a small model, random A and B."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    from inferd.loading.peft import projection_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (n_in, n_out) in projection_shapes(cfg).items():
            part = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}, f)
    return str(path)


def test_grammar_and_lora_rows_in_the_batch(tiny_chat_gguf, tmp_path):
    """A tokenizer-bearing tiny model: requests with a grammar, with a LoRA adapter and plain ones in
    one batch, three waves. Wave 2 adds grammars to wave 1's prompts, so the cache's drafts (wave 1's
    free outputs) break them: those guesses are cut before verification, never verified. Every wave
    equals the engine without speculation, token for token (fp32 greedy)."""
    from inferd.engine.request import StructuredOutputs
    from inferd.loading.loader import load_model

    lm = load_model(tiny_chat_gguf, dtype="float32")
    adapter = _tiny_adapter(tmp_path / "ad", lm.config)
    tok = lm.tokenizer
    texts = ["Tell me about the sea.", "List three colours.", "Count to ten.", "Name a city.", "What is two plus two?",
             "Say hello.", "Describe a cat.", "Spell the word dog."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    reqs = [(p, 24) for p in prompts]
    grammar = [None, {"regex": r"[a-z ]{4,30}\."}, None, {"choice": ["alpha beta gamma", "delta"]},
               None, {"json_object": True}, None, {"regex": r"(yes|no), [a-z]{2,12}"}]

    def params(wave):
        def make(i, n):
            g = grammar[i] if wave else None
            return SamplingParams(max_tokens=n, temperature=0, structured_outputs=StructuredOutputs(**g) if g else None)
        return make

    def lora(i):
        return "ad" if i % 4 == 2 else None

    opts = dict(lora_modules=[f"ad={adapter}"], max_loras=2, max_num_seqs=8)
    plain = LLMEngine(loaded=lm, dtype="float32", **opts)
    want = [run_waves_plain(plain, reqs, params(w), lora) for w in (0, 1, 1)]
    eng = suffix_engine(lm, **opts)
    got = [run_waves(eng, reqs, waves=1, params=params(w), lora=lora)[0] for w in (0, 1, 1)]
    assert got == want
    sp = eng.spec.stats
    print(sp.as_dict(), "lora steps", eng.lora.lora_steps)
    assert sp.num_grammar_cut_tokens > 0 and sp.num_accepted_tokens > 0 and sp.num_cache_drafts > 0
    assert eng.lora.lora_steps > 0
    assert_guesses_accounted(sp)


def run_waves_plain(eng, reqs, params, lora):
    rids = [eng.add_request(p, params(i, n), lora=lora(i)) for i, (p, n) in enumerate(reqs)]
    got = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    return [got[r] for r in rids]


# -- served -------------------------------------------------------------------------------------

def test_served_with_vllms_config_spelling_and_its_metrics(tiny_chat_gguf):
    """`inferd serve --speculative-config '{"method": "suffix", ...}'`: the same chat request twice
    gives the same text, the second drafted from the first's output in the shared cache; /metrics
    carries vLLM's spec-decode series (and inferd's), the dashboard state the counters it shows."""
    import json

    import httpx
    from conftest import running_server

    conf = json.dumps({"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 16,
                       "suffix_decoding_max_cached_requests": 100, "cost_model": False})
    args = ["--model", tiny_chat_gguf, "--dtype", "float32", "--kv-cache-memory", "32MiB",
            "--speculative-config", conf]
    with running_server(args) as base:
        body = {"messages": [{"role": "user", "content": "Tell me a story about the sea."}], "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}
        texts = [httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
                 ["content"] for _ in range(2)]
        assert texts[0] == texts[1]
        other = httpx.post(base + "/v1/chat/completions", json={**body, "cache_salt": "tenant-b"}, timeout=120)
        assert other.status_code == 200
        metrics = httpx.get(base + "/metrics", timeout=30).text
        state = httpx.get(base + "/v1/engine/state?steps=0", timeout=30).json()
    spec = state["engines"][0]["speculative"]
    assert spec["method"] == "suffix" and spec["num_cache_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert state["engines"][0]["config"]["speculative_method"] == "suffix"
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "inferd:spec_decode_num_cost_skipped_tokens_total",
                 "inferd:spec_decode_num_verified_rows_total"):
        assert name + "{" in metrics, name
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in metrics
    assert 'position="0"' in metrics


def test_bad_speculative_config_on_the_command_line_exits_2():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "inferd", "serve", "--load-format", "dummy", "--speculative-config",
                        '{"method": "suffix", "suffix_decoding_max_tree_depth": "deep"}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("inferd: error:") and "suffix_decoding_max_tree_depth must be int" in last
    assert "Traceback" not in r.stderr


def test_a_curve_cut_short_by_its_budget_still_has_every_point():
    """Measured on a machine too slow for the budget: the counts not reached are points too
    (proportional to the last one reached), which steps near them then correct one by one."""
    from inferd.engine.speculative.cost import measure

    calls = []

    def run(R):
        calls.append(R)
        import time as _t
        _t.sleep(0.002)

    c = measure(run, 64, reps=1, budget_s=0.001)
    assert set(calls) == {1, 2} and c.rows == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert c(64) == pytest.approx(32 * c(2), rel=0.01)
    c.observe(16, c(2))  # a step of 16 rows costs what 2 did: that point learns it at once
    assert c(16) == pytest.approx(c(2), rel=0.01)


def test_a_short_prompt_tail_after_a_prefix_hit_stays_on_the_prefill_path():
    """The default model as served (W4A8: int8 activations), a prompt sent twice: the second time a
    prefix hit leaves an 8-token tail. Speculation must compute it as plain decoding does, through
    the prefill kernel, not as 8 decode rows (which sum in another order: with int8 activations a
    last-bit difference flips roundings, and a code-edit answer once parted from plain decoding's
    at its first token so). The logits that tail's step samples from are plain decoding's bit for
    bit, and the whole outputs equal."""
    import torch

    from inferd.loading.loader import load_model

    lm = load_model(None, quantization="auto", with_tokenizer=False)
    prompt = [1] + [random.Random(3).randrange(200, 9000) for _ in range(39)]  # 2 whole blocks, then 8
    got = {}
    for name, opts in (("plain", {}), ("suffix", {"speculative_config": {"method": "suffix",
                                                                         "num_speculative_tokens": 8}})):
        eng = LLMEngine(loaded=lm, kv_cache_memory="64MiB", **opts)
        firsts, execute = [], eng.runner.execute

        def keep(requests, num_new, execute=execute, firsts=firsts):
            out = execute(requests, num_new)
            if any(r.num_computed < r.num_prompt for r in requests):
                firsts.append(out[0][0].clone())
            return out
        eng.runner.execute = keep
        outs = []
        for _ in range(2):
            rid = eng.add_request(prompt, SamplingParams(max_tokens=24, temperature=0))
            req = eng.requests[rid]
            while eng.has_unfinished():
                eng.step()
            outs.append(req.output_ids)
        prefills = eng.runner.attn.prefill_kernel_calls
        got[name] = (outs, firsts, prefills, eng)
    (p_out, p_first, p_pre, _), (s_out, s_first, s_pre, s_eng) = got["plain"], got["suffix"]
    assert len(s_first) == 2 and torch.equal(p_first[1], s_first[1])
    assert s_out == p_out and s_pre == p_pre
    assert s_eng.spec.stats.num_accepted_tokens > 0, "the second request drafted nothing from the first"

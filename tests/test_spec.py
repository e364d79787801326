"""Speculative decoding: lossless by test.

Greedy: with speculation the engine must reproduce the reference loop's tokens (near-tie rule as
in test_engine) on concurrent mixed batches, for prompt lookup and for draft models, and the
speculation must really have happened (fewer target forwards per sequence than tokens).
Sampling: on a tiny model with a 16-token vocabulary, the tokens drawn with speculation follow
the target's exact distribution (chi-square, thousands of fixed-seed samples), even with a
deliberately bad draft, and the measured acceptance rate matches sum(min(p, q)).
"""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.engine.engine import LLMEngine
from inferd.engine.kv_cache import BlockManager
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError
from inferd.engine.reference import reference_generate
from inferd.engine.speculative.ngram import propose_ngram
from inferd.engine.speculative.rejection import accept_greedy, expected_acceptance, rejection_sample
from conftest import make_tiny_model
from helpers import (assert_no_leaks, assert_speculated, compare, make_requests, mixed_requests,  # noqa: F401
                     reference_outputs, run_spec)


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy here)."""
    z = {1e-3: 3.090, 1e-4: 3.719}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic, pooling cells with expected count < 5 into one."""
    stat, df = 0.0, -1
    pool_e = pool_o = 0.0
    for key in set(probs) | set(counts):
        e = n * probs.get(key, 0.0)
        o = counts.get(key, 0)
        if e < 5:
            pool_e += e
            pool_o += o
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        df += 1
    return stat, max(df, 1)


# -- pure functions ---------------------------------------------------------------------------

def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 4, 1, 3) == [4, 5, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 1, 3) == [4, 5]
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []  # nothing earlier
    # the longest suffix wins over a more recent shorter one
    assert propose_ngram([7, 8, 9, 1, 5, 8, 6, 7, 8], 2, 1, 2) == [9, 1]
    # among equal lengths the most recent occurrence wins
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2, 1, 2) == [7, 1]
    # n_min: a unigram match alone is not enough
    assert propose_ngram([5, 6, 1, 7, 1], 3, 2, 3) == []
    assert propose_ngram([5, 6, 1, 7, 1], 3, 1, 3) == [7, 1]
    # the continuation may run into the suffix itself (a repetition loop)
    assert propose_ngram([4, 4, 4], 3, 1, 2) == [4]


def test_the_cost_budget_cuts_any_draft():
    """A prompt-lookup draft (no estimate of its own) and a draft model's (with its q) go through the
    cost budget as a suffix draft does: every guess verified where rows are free, none where each
    costs a decode step; the identity budget keeps every guess."""
    from types import SimpleNamespace

    from inferd.engine.request import Status
    from inferd.engine.speculative.budget import CostBudget, VerifyAll
    from inferd.engine.speculative.cost import StepCost
    from inferd.engine.speculative.decoder import SpecStats
    from inferd.engine.speculative.proposal import Draft

    engine = SimpleNamespace(scheduler=SimpleNamespace(waiting=[]), config=SimpleNamespace(max_num_batched_tokens=64))
    req = SimpleNamespace(request_id="a", matcher=None, status=Status.RUNNING, num_tokens=10, num_computed=9)
    flat = StepCost([(1, 1.0), (1024, 1.0)], learn=False)
    steep = StepCost([(1, 1.0), (1024, 1024.0)], learn=False)
    for make in (lambda: Draft([5, 6, 7]), lambda: Draft([5, 6, 7], q=torch.full((3, 8), 1 / 8))):
        assert VerifyAll().choose([req], [req], [make()]) == [3]
        assert CostBudget(engine, SpecStats(), flat).choose([req], [req], [make()]) == [3]
        stats = SpecStats()
        assert CostBudget(engine, stats, steep).choose([req], [req], [make()]) == [0]
        assert stats.num_proposed_tokens == stats.num_cost_skipped_tokens == 3


def test_accept_greedy():
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == (3, [1, 2, 3, 4])
    assert accept_greedy([1, 2, 3], [1, 5, 3, 4]) == (1, [1, 5])
    assert accept_greedy([1, 2, 3], [9, 2, 3, 4]) == (0, [9])


def _rand_dist(g, V, sharp=1.0):
    return torch.softmax(torch.randn(V, generator=g) * sharp, -1)


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sample_is_lossless(one_hot):
    """First emitted token ~ p whatever q; acceptance rate = sum(min(p, q))."""
    g = torch.Generator().manual_seed(0)
    V, N = 8, 20000
    p = _rand_dist(g, V)
    q = _rand_dist(g, V, 2.0)  # a bad draft: sharper and unrelated
    p2 = _rand_dist(g, V)
    counts, accepted = {}, 0
    for _ in range(N):
        if one_hot:
            x, qq = 3, None
        else:
            x = int(torch.multinomial(q, 1, generator=g))
            qq = q[None]
        a, toks = rejection_sample(torch.stack([p, p2]), qq, [x], g)
        assert len(toks) == a + 1
        accepted += a
        counts[toks[0]] = counts.get(toks[0], 0) + 1
    stat, df = chi2(counts, dict(enumerate(p.tolist())), N)
    assert stat < chi2_critical(df), (stat, df)
    want = float(p[3]) if one_hot else expected_acceptance(p, q)
    sd = math.sqrt(want * (1 - want) / N)
    assert abs(accepted / N - want) < 4 * sd, (accepted / N, want)


def test_rejection_sample_all_accepted_gives_bonus():
    p = torch.zeros(3, 4)
    p[0, 1] = p[1, 2] = p[2, 3] = 1.0
    q = p[:2].clone()
    assert rejection_sample(p, q, [1, 2], torch.Generator().manual_seed(0)) == (2, [1, 2, 3])
    # a guess the target gives zero probability is always rejected and replaced from p
    a, toks = rejection_sample(p, None, [0, 2], torch.Generator().manual_seed(0))
    assert (a, toks) == (0, [1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=30),
       st.integers(1, 8))
def test_truncate_keeps_block_accounting(ops, bs):
    """Grow by k+1 slots, roll back to any shorter length: ref counts and free lists stay exact."""
    from inferd.engine.request import Request

    bm = BlockManager(64, bs, enable_prefix_caching=True)
    reqs = [Request(f"r{i}", list(range(1, 5)), SamplingParams()) for i in range(3)]
    for j, (grow, cut) in enumerate(ops):
        r = reqs[j % 3]
        if not bm.allocate(r, grow):
            bm.free_request(r)
            r.num_computed = 0
            continue
        new = r.num_computed + grow
        r.num_computed = max(r.num_computed, new - cut)
        bm.truncate(r, r.num_computed)
        assert len(r.block_table) == -(-r.num_computed // bs)
        bm.check_invariants(reqs)
    for r in reqs:
        bm.free_request(r)
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks


# -- greedy: token-identical inside continuous batching -----------------------------------------

@pytest.fixture(scope="module")
def mixed(tiny_model):
    reqs = mixed_requests()
    return reqs, reference_outputs(tiny_model.model, reqs)


@pytest.mark.parametrize("opts", [
    dict(speculative_method="ngram", num_speculative_tokens=4),
    dict(speculative_method="ngram", num_speculative_tokens=2, ngram_min=2, ngram_max=3, block_size=4),
    dict(speculative_method="draft", draft_model="self:layers=1", num_speculative_tokens=3),
], ids=["ngram-k4", "ngram-k2-bs4", "self-draft-k3"])
def test_greedy_matches_reference(tiny_model, mixed, opts):
    reqs, ref = mixed
    got, _, eng = run_spec(tiny_model, reqs, **opts)
    print("near ties:", compare(got, ref, max_ties=1))
    assert eng.stats.max_batch_seqs >= 16
    assert_speculated(eng)


def test_greedy_with_a_separate_draft_model(tiny_model, mixed):
    reqs, ref = mixed
    draft = make_tiny_model(seed=5, num_hidden_layers=1)
    got, _, eng = run_spec(tiny_model, reqs, draft_loaded=draft, speculative_method="draft",
                           draft_model="tiny", num_speculative_tokens=2)
    print("near ties:", compare(got, ref, max_ties=1))
    assert eng.spec.stats.num_draft_tokens > 0  # a random draft rarely agrees: rejection path


@pytest.mark.slow
def test_ngram_backoff_pauses_failed_lookups(tiny_model, mixed):
    """After a verify that kept no guess, a sequence skips lookups for a while (1, 2, 4 .. steps):
    the same tokens, fewer wasted guesses."""
    reqs, ref = mixed
    got, _, eng = run_spec(tiny_model, reqs, speculative_method="ngram", num_speculative_tokens=4)
    compare(got, ref, max_ties=1)
    got0, _, eng0 = run_spec(tiny_model, reqs, speculative_method="ngram", num_speculative_tokens=4, ngram_backoff=0)
    compare(got0, ref, max_ties=1)
    s, s0 = eng.spec.stats, eng0.spec.stats
    print("backoff", s.as_dict(), "\nno backoff", s0.as_dict())
    assert s.num_skipped > 0 and s0.num_skipped == 0
    assert_speculated(eng)
    assert s.num_draft_tokens < s0.num_draft_tokens


def test_preemption_prefix_caching_and_small_budget(tiny_model):
    """Rollback under memory pressure, shared prefixes and a budget that trims the guesses."""
    reqs = make_requests(seed=2, n=32, shared_prefixes=3)
    ref = reference_outputs(tiny_model.model, reqs)
    for opts in (dict(speculative_method="ngram", num_speculative_tokens=5),
                 dict(speculative_method="draft", draft_model="self:layers=1", num_speculative_tokens=3)):
        got, _, eng = run_spec(tiny_model, reqs, num_kv_blocks=40, block_size=8, max_num_batched_tokens=24, **opts)
        print(opts, "near ties:", compare(got, ref, max_ties=1), "preemptions:", eng.stats.preemptions)
        assert eng.stats.preemptions >= 1 and eng.block_manager.hits > 0
        assert_speculated(eng)


@pytest.mark.slow
def test_penalties_bias_and_stops_see_the_right_history(tiny_model):
    """Greedy with every history-dependent processor: spec must equal plain decoding exactly, which
    only holds if each verified position is processed with the guesses before it as history."""
    rng = random.Random(4)
    reqs = mixed_requests(seed=4, n=16)
    plain, pfin, _ = run_spec(tiny_model, reqs, params=lambda n: SamplingParams(max_tokens=n, temperature=0))
    # stop ids: a token each plain output reaches mid-way, so the stop lands inside a verified chunk
    stops = [[o[len(o) // 2]] if len(o) > 2 else [] for o in plain]

    def params_for(i):
        return lambda n: SamplingParams(max_tokens=n, temperature=0, repetition_penalty=1.2, presence_penalty=0.3,
                                        frequency_penalty=0.2, logit_bias={7: 2.0, 11: -1.0},
                                        min_tokens=min(n, 3), stop_token_ids=stops[i])

    # the plain engine, all 16 at once with their own parameters (batching is lossless: test_engine)
    eng = LLMEngine(loaded=tiny_model, dtype="float32")
    rids = [eng.add_request(p, params_for(i)(n)) for i, (p, n) in enumerate(reqs)]
    live = {r: eng.requests[r] for r in rids}
    while eng.has_unfinished():
        eng.step()
    want, wfin = [live[r].output_ids for r in rids], [live[r].finish_reason for r in rids]
    for opts in (dict(speculative_method="ngram", num_speculative_tokens=4),
                 dict(speculative_method="draft", draft_model="self:layers=1", num_speculative_tokens=3)):
        eng = LLMEngine(loaded=tiny_model, dtype="float32", **opts)
        rids = [eng.add_request(p, params_for(i)(n)) for i, (p, n) in enumerate(reqs)]
        live = {r: eng.requests[r] for r in rids}
        while eng.has_unfinished():
            eng.step()
        assert_no_leaks(eng)
        assert [live[r].output_ids for r in rids] == want
        assert [live[r].finish_reason for r in rids] == wfin
        assert "stop" in wfin
        assert eng.spec.stats.num_draft_tokens > 0
    del rng


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model):
    prompt = [5, 9, 33, 100, 7, 5, 9, 33]
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=1234)
    for opts in (dict(speculative_method="ngram"), dict(speculative_method="draft", draft_model="self:layers=1")):
        runs = []
        for others in (0, 12):
            eng = LLMEngine(loaded=tiny_model, dtype="float32", **opts)
            rng = random.Random(3)
            for i in range(others):
                eng.add_request([rng.randrange(512) for _ in range(rng.randint(1, 60))],
                                SamplingParams(max_tokens=rng.randint(1, 30), temperature=1.0, seed=i))
            rid = eng.add_request(prompt, SamplingParams(**params))
            req = eng.requests[rid]
            while eng.has_unfinished():
                eng.step()
            assert_no_leaks(eng)
            runs.append(req.output_ids)
        assert runs[0] == runs[1] and len(runs[0]) == 24


# -- sampling: the target's distribution, exactly ------------------------------------------------

V = 16
PROMPT = [3, 5, 7, 3, 5, 9, 1, 3, 12, 5]


@pytest.fixture(scope="module")
def small():
    return make_tiny_model(seed=11, vocab_size=V, scale=0.06)


@torch.inference_mode()
def _next_probs(model, seqs: list[list[int]], temperature=1.0) -> torch.Tensor:
    from inferd.model.layers import ContiguousKV

    out = []
    for s in seqs:
        cache = ContiguousKV(model.cfg, len(s), model.dtype, model.device)
        pos = torch.arange(len(s))
        cache.set_positions(pos)
        logits = model.compute_logits(model(torch.tensor(s), pos, cache)[-1:])[0]
        out.append(torch.softmax(logits / temperature, -1))
    return torch.stack(out)


def _sample_engine(loaded, n, max_tokens, seed0=0, temperature=1.0, **opts):
    eng = LLMEngine(loaded=loaded, dtype="float32", max_num_seqs=256, num_kv_blocks=600, block_size=16, **opts)
    rids = [eng.add_request(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed0 + i))
            for i in range(n)]
    live = {r: eng.requests[r] for r in rids}
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)
    return [live[r].output_ids for r in rids], eng


N_SAMPLES = 2000


@pytest.mark.parametrize("method", ["bad-draft", "self-draft", "ngram", "suffix"])
def test_sampled_distribution_is_the_targets(small, method):
    """x2 and x3 are produced by verification (K=2 guesses after the prefill token): their
    marginals and their joint with x1 must match the target's exact distribution. Suffix decoding
    drafts mostly from the shared cache: earlier samples' continuations, by their frequencies."""
    model = small.model
    opts = dict(speculative_method="ngram", num_speculative_tokens=2)
    if method == "suffix":
        opts = dict(speculative_method="suffix", num_speculative_tokens=2, spec_cost_model=False)
    elif method == "bad-draft":
        opts = dict(speculative_method="draft", draft_model="bad", num_speculative_tokens=2,
                    draft_loaded=make_tiny_model(seed=99, vocab_size=V, scale=0.5))
    elif method == "self-draft":
        opts = dict(speculative_method="draft", draft_model="self:layers=1", num_speculative_tokens=2)
    outs, eng = _sample_engine(small, N_SAMPLES, 4, **opts)
    sp = eng.spec.stats
    print(method, sp.as_dict())
    assert sp.num_draft_tokens >= N_SAMPLES // 2 and sp.num_accepted_tokens > 0
    if method == "suffix":
        assert sp.num_cache_drafts > N_SAMPLES // 4
    assert sp.num_accepted_tokens < sp.num_draft_tokens  # rejections happened too
    p1 = _next_probs(model, [PROMPT])[0]
    p2 = _next_probs(model, [PROMPT + [a] for a in range(V)])  # [x1, x2]
    p3 = _next_probs(model, [PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint12 = p1[:, None] * p2  # P(x1, x2)
    joint123 = joint12[:, :, None] * p3
    cases = {
        "x2": (lambda o: o[1], dict(enumerate(joint12.sum(0).tolist()))),
        "x3": (lambda o: o[2], dict(enumerate(joint123.sum((0, 1)).tolist()))),
        "x1x2": (lambda o: (o[0], o[1]), {(a, b): float(joint12[a, b]) for a in range(V) for b in range(V)}),
        "x2x3": (lambda o: (o[1], o[2]), {(a, b): float(joint123.sum(0)[a, b]) for a in range(V) for b in range(V)}),
    }
    for name, (key, probs) in cases.items():
        counts = {}
        for o in outs:
            counts[key(o)] = counts.get(key(o), 0) + 1
        stat, df = chi2(counts, probs, N_SAMPLES)
        print(method, name, f"chi2={stat:.1f} df={df} critical={chi2_critical(df):.1f}")
        assert stat < chi2_critical(df), (method, name, stat, df)


@pytest.mark.parametrize("method", ["bad-draft", "ngram"])
def test_acceptance_rate_is_sum_min_p_q(small, method):
    """K=1, three tokens: exactly one verified guess per request, for x2 given (prompt, x1).
    Expected acceptance: sum over x1 of P(x1) * sum(min(p(.|x1), q(.|x1))) (q one-hot for ngram)."""
    model = small.model
    draft = make_tiny_model(seed=99, vocab_size=V, scale=0.5)
    if method == "ngram":
        opts = dict(speculative_method="ngram", num_speculative_tokens=1, ngram_min=1, ngram_max=3)
    else:
        opts = dict(speculative_method="draft", draft_model="bad", num_speculative_tokens=1, draft_loaded=draft)
    outs, eng = _sample_engine(small, N_SAMPLES, 3, seed0=10_000, **opts)
    sp = eng.spec.stats
    p1 = _next_probs(model, [PROMPT])[0]
    p2 = _next_probs(model, [PROMPT + [a] for a in range(V)])
    if method == "ngram":
        props = [propose_ngram(PROMPT + [a], 1, 1, 3) for a in range(V)]
        w = torch.tensor([float(p1[a]) if props[a] else 0.0 for a in range(V)])
        acc = torch.tensor([float(p2[a, props[a][0]]) if props[a] else 0.0 for a in range(V)])
        want = float((w * acc).sum() / w.sum())
    else:
        q2 = _next_probs(draft.model, [PROMPT + [a] for a in range(V)])
        want = float((p1 * torch.minimum(p2, q2).sum(-1)).sum())
    got = sp.acceptance_rate
    sd = math.sqrt(want * (1 - want) / sp.num_draft_tokens)
    print(method, f"acceptance {got:.4f} expected {want:.4f} (sd {sd:.4f}, n={sp.num_draft_tokens})")
    assert abs(got - want) < 4 * sd
    assert sp.num_drafts == sp.num_draft_tokens  # one guess per verify step


# -- the real model: prompt lookup on a copy task ----------------------------------------------

def test_ngram_copy_task_on_the_default_model(default_gguf_path):
    from inferd.loading.loader import load_model

    real = load_model(None, dtype="float32")
    tok = real.tokenizer
    passages = ["The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.",
                "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high mountains."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Repeat this sentence exactly: {p}"}],
                                       add_generation_prompt=True, tokenize=True) for p in passages]
    eng = LLMEngine(loaded=real, kv_cache_memory="64MiB", speculative_method="ngram", num_speculative_tokens=4)
    rids = [eng.add_request(p, SamplingParams(max_tokens=32, temperature=0)) for p in prompts]
    live = {r: eng.requests[r] for r in rids}
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)
    near = 0
    for r, p in zip(rids, prompts):
        ref = reference_generate(real.model, p, 32, eos_ids=eng.eos_ids, keep_logits=True)
        near += compare([live[r].output_ids], [(ref.token_ids, ref.logits)], max_ties=1)
    print("near ties:", near, tok.decode(live[rids[0]].output_ids))
    assert_speculated(eng, min_rate=0.5)


# -- configuration errors -----------------------------------------------------------------------

def test_bad_configurations(tiny_model):
    with pytest.raises(InferdError, match="draft-model"):
        LLMEngine(loaded=tiny_model, speculative_method="draft")
    with pytest.raises(InferdError, match="at least 1"):
        LLMEngine(loaded=tiny_model, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(InferdError, match="out of range"):
        LLMEngine(loaded=tiny_model, speculative_method="draft", draft_model="self:layers=3")
    with pytest.raises(InferdError, match="vocabulary"):
        LLMEngine(loaded=tiny_model, speculative_method="draft", draft_model="x",
                  draft_loaded=make_tiny_model(vocab_size=256))
    with pytest.raises(InferdError, match="ngram_min"):
        LLMEngine(loaded=tiny_model, speculative_method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(InferdError, match="unknown speculative"):
        LLMEngine(loaded=tiny_model, speculative_method="medusa")


def test_prometheus_spec_metrics(tiny_model):
    from inferd.server.metrics import Metrics

    eng = LLMEngine(loaded=tiny_model, dtype="float32", speculative_method="ngram")
    m = Metrics("tiny", speculative=True)
    for p, n in mixed_requests(seed=7, n=6):
        eng.add_request(p, SamplingParams(max_tokens=n, temperature=0))
    while eng.has_unfinished():
        eng.step()
        m.on_step(eng.snapshot())
    text = m.render().decode()
    sp = eng.spec.stats
    assert sp.num_draft_tokens > 0
    assert f'inferd:spec_decode_num_draft_tokens_total{{engine="0",model_name="tiny"}} {float(sp.num_draft_tokens)}' in text
    assert f'inferd:spec_decode_num_accepted_tokens_total{{engine="0",model_name="tiny"}} {float(sp.num_accepted_tokens)}' in text
    assert "inferd:spec_decode_draft_acceptance_rate" in text and "inferd:spec_decode_mean_accepted_length" in text


# -- command line and YAML ----------------------------------------------------------------------

def _inferd(*argv, timeout=600):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "inferd", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv,msg", [
    (["--speculative-method", "draft"], "--draft-model"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "at least 1"),
    (["--speculative-method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "ngram_min"),
    (["--speculative-method", "draft", "--draft-model", "self:layers=99", "--load-format", "dummy"], "out of range"),
    (["--speculative-method", "draft", "--draft-model", "self:layers=x", "--load-format", "dummy"], "self:layers=N"),
])
def test_cli_bad_combinations_exit_2(argv, msg):
    r = _inferd("throughput", "--num-prompts", "1", "--kv-cache-memory", "16MiB", *argv)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (log lines may come first)
    assert last.startswith("inferd: error:") and msg in last and "Traceback" not in r.stderr


def test_yaml_config_carries_spec_options(tmp_path):
    from inferd.cli import apply_yaml_config, build_parser, engine_config_from_args

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("speculative-method: draft\nnum_speculative_tokens: 3\ndraft_model: self:layers=6\n"
                        "draft_quantization: int8\nngram_max: 5\n")
    parser = build_parser()
    argv = ["serve", "--config", str(cfg_file), "--num-speculative-tokens", "2"]
    args = apply_yaml_config(parser, argv, parser.parse_args(argv))
    cfg = engine_config_from_args(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.draft_model, cfg.draft_quantization,
            cfg.ngram_max) == ("draft", 2, "self:layers=6", "int8", 5)


@pytest.mark.slow
def test_throughput_cli_reports_speculation(tmp_path, default_gguf_path):
    import json

    out = tmp_path / "r.json"
    r = _inferd("throughput", "--num-prompts", "3", "--input-len", "8-24", "--output-len", "24", "--ignore-eos",
                "--dtype", "float32", "--kv-cache-memory", "64MiB", "--speculative-method", "ngram",
                "--num-speculative-tokens", "3", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    assert "Acceptance rate" in r.stdout and "Tokens per target step" in r.stdout
    res = json.loads(out.read_text())
    assert res["speculative_method"] == "ngram" and res["total_output_tokens"] == 72
    assert res["spec_num_drafts"] >= 0 and 0 <= res["spec_acceptance_rate"] <= 1

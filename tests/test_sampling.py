"""Sampling parameters against outside definitions: transformers' logits processors and OpenAI's
penalty formula; seeded draws, stop strings, n > 1 and logprobs end to end on the engine."""
import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper)

from helpers import assert_logprobs_close  # noqa: E402
from inferd.engine import sampler as S  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.llm import LLM  # noqa: E402
from inferd.engine.output import detokenize  # noqa: E402
from inferd.engine.request import Request, SamplingParams  # noqa: E402
from inferd.model.layers import ContiguousKV  # noqa: E402

R, V = 6, 300


@pytest.fixture
def logits():
    return torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 3


def full(x, v, dtype=torch.float32):
    return torch.full((R,), v, dtype=dtype)


@pytest.mark.parametrize("k", [1, 5, 50, 299])
def test_top_k_equals_hf(logits, k):
    want = TopKLogitsWarper(k)(None, logits.clone())
    torch.testing.assert_close(S.apply_top_k(logits, full(logits, k, torch.long)), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_equals_hf(logits, p):
    want = TopPLogitsWarper(p)(None, logits.clone())
    torch.testing.assert_close(S.apply_top_p(logits, full(logits, p)), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("m", [0.01, 0.1, 0.5])
def test_min_p_equals_hf(logits, m):
    want = MinPLogitsWarper(m)(None, logits.clone())
    torch.testing.assert_close(S.apply_min_p(logits, full(logits, m)), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature_equals_hf(logits, t):
    want = TemperatureLogitsWarper(t)(None, logits.clone())
    torch.testing.assert_close(S.apply_temperature(logits, full(logits, t)), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pen", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_hf(logits, pen):
    ids = torch.randint(0, V, (R, 40), generator=torch.Generator().manual_seed(1))
    want = RepetitionPenaltyLogitsProcessor(pen)(ids, logits.clone())
    seen = S.token_counts(ids.tolist(), V) > 0
    torch.testing.assert_close(S.apply_repetition_penalty(logits, seen, full(logits, pen)), want, atol=1e-6, rtol=0)


def test_presence_frequency_openai_formula(logits):
    rng = random.Random(2)
    outs = [[rng.randrange(20) for _ in range(rng.randint(0, 30))] for _ in range(R)]
    pres = torch.tensor([0.0, 0.5, -1.0, 2.0, 1.0, 0.3])
    freq = torch.tensor([0.0, 0.2, 1.0, -0.5, 2.0, 0.0])
    got = S.apply_presence_frequency(logits, S.token_counts(outs, V), pres, freq)
    want = logits.clone()
    for i, out in enumerate(outs):  # mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
        for j in set(out):
            c = out.count(j)
            want[i, j] -= c * float(freq[i]) + float(c > 0) * float(pres[i])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_argmax_is_torchs_on_ties_and_nan():
    x = torch.zeros(4, 49152)
    x[0, [5, 700, 40000]] = 3.0  # ties: the first
    x[1, 5], x[1, 100] = 9.0, float("nan")  # NaN wins, as in torch.argmax
    x[2] = 1.0
    x[3, [49151, 3]] = 2.0
    for t in (x, x.bfloat16()):
        assert S.argmax(t).tolist() == torch.argmax(t, dim=-1).tolist() == [5, 100, 0, 3]


def test_process_logits_never_writes_the_callers_logits(logits):
    raw = logits.clone()
    b = S.SamplingBatch(torch.zeros(R), torch.zeros(R, dtype=torch.long), torch.ones(R), torch.zeros(R), [None] * R)
    assert S.process_logits(logits, b) is logits  # greedy, nothing to apply: no copy
    b.bias_rows = [(0, torch.tensor([1, 2]), torch.tensor([5.0, -5.0]))]
    b.masked_rows = [(1, torch.tensor([3]))]
    out = S.process_logits(logits, b)
    assert torch.equal(logits, raw)
    assert out[0, 1] == raw[0, 1] + 5 and out[1, 3] == S.NEG_INF


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_empirical_frequencies_chi_square():
    probs = [0.30, 0.22, 0.18, 0.12, 0.08, 0.06, 0.04]
    logits = torch.tensor([math.log(p) for p in probs]).repeat(2000, 1)
    # top_k=5 keeps the first five; top_p=0.8 then keeps the fewest whose mass reaches 0.8 of them
    kept = probs[:5]
    z = sum(kept)
    kept = [p / z for p in kept]
    cum, keep = 0.0, []
    for p in kept:
        keep.append(p)
        cum += p
        if cum >= 0.8:
            break
    intended = [p / sum(keep) for p in keep]
    g = torch.Generator().manual_seed(7)
    toks = S.sample_rows(logits, torch.ones(2000),
                         torch.full((2000,), 5), torch.full((2000,), 0.8), [g] * 2000)
    counts = torch.bincount(toks, minlength=len(probs)).tolist()
    assert sum(counts[len(intended):]) == 0, counts
    chi2 = sum((counts[i] - 2000 * q) ** 2 / (2000 * q) for i, q in enumerate(intended))
    assert chi2 < CHI2_999[len(intended) - 1], (chi2, counts, intended)


# -- end to end on the engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_real_vocab(default_gguf_path):
    """A tiny random model over SmolLM2's real vocabulary, with the real tokenizer."""
    from conftest import make_tiny_model
    from inferd.tokenizer import Tokenizer

    lm = make_tiny_model(vocab_size=49152, scale=0.3)
    lm.tokenizer = Tokenizer.load(default_gguf_path)
    return lm


def _feed(eng, text, params):
    """Drive the engine's detokenize/stop path with the tokens of `text`, as if sampled."""
    ids = eng.tokenizer.encode(text)
    req = Request("t", [1], params)
    eng._attach(req)
    emitted = []
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        if i == len(ids) - 1 and req.finish_reason is None:
            req.finish_reason = "length"
        d = detokenize(req, t)
        assert "\ufffd" not in d
        emitted.append(d)
        if req.finish_reason == "stop":
            break
    return "".join(emitted), req


@pytest.mark.parametrize("stop", ["界!", "👋 w", "ld d", "ö", " 世"])
def test_stop_strings_cut_exactly(tiny_real_vocab, stop):
    eng = LLMEngine(loaded=tiny_real_vocab, dtype="float32", num_kv_blocks=8)
    text = "Hello 世界! 👋 wörld done and more"
    out, req = _feed(eng, text, SamplingParams(stop=["never-there", stop]))
    assert out == text[: text.index(stop)]
    assert req.finish_reason == "stop" and req.stop_reason == stop
    out, _ = _feed(eng, text, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert out == text[: text.index(stop) + len(stop)]


def test_stop_hold_back_is_minimal(tiny_real_vocab):
    eng = LLMEngine(loaded=tiny_real_vocab, dtype="float32", num_kv_blocks=8)
    text = "abc abd abe done"
    ids = eng.tokenizer.encode(text)
    req = Request("t", [1], SamplingParams(stop=["abx"]))
    eng._attach(req)
    decoded = emitted = ""
    for t in ids:
        req.output_ids.append(t)
        emitted += detokenize(req, t)  # the engine emits deltas; the text is what they join to
        decoded = eng.tokenizer.decode(req.output_ids)
        # held back: at most a suffix that could still begin "abx"
        assert decoded.startswith(emitted)
        assert len(decoded) - len(emitted) <= 2
        assert "abx".startswith(decoded[len(emitted):])
    req.finish_reason = "length"


def test_stop_string_in_generation(tiny_real_vocab):
    llm = LLM(loaded=tiny_real_vocab, dtype="float32", kv_cache_memory="64MiB")
    base = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30, temperature=0))[0]
    text = base.text
    assert len(text) > 12
    stop = text[len(text) // 2: len(text) // 2 + 3]
    got = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert got.text == text[: text.index(stop)] and got.finish_reason == "stop" and got.stop_reason == stop


def test_min_tokens_and_stop_token_ids(tiny_model):
    llm = LLM(loaded=tiny_model, dtype="float32", kv_cache_memory="64MiB")
    forced = 77
    p = SamplingParams(max_tokens=20, temperature=0, logit_bias={forced: 100.0}, stop_token_ids=[forced],
                       min_tokens=5)
    out = llm.generate([[5, 6, 7]], p)[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == forced and forced not in out.token_ids[:5]
    assert out.finish_reason == "stop" and out.stop_reason == forced
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_n_shares_prompt_blocks(tiny_model):
    eng = LLMEngine(loaded=tiny_model, dtype="float32", num_kv_blocks=64, block_size=16)
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks shared, the tail recomputed per sample
    eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=5), request_id="r")
    outs = {}
    saw_sharing = False
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.index, []).extend(o.new_token_ids)
        live = list(eng.requests.values())
        if len(live) == 4 and all(len(r.block_table) == 3 for r in live) and not saw_sharing:
            shared = live[0].block_table[:2]
            assert all(r.block_table[:2] == shared for r in live)
            assert [eng.block_manager.ref[b] for b in shared] == [4, 4]
            own = {b for r in live for b in r.block_table[2:]}
            assert len(own) == 4  # one private tail block each
            assert eng.block_manager.num_used == 2 + 4
            saw_sharing = True
        eng.block_manager.check_invariants(live)
    assert saw_sharing and eng.stats.forks == 1
    assert sorted(outs) == [0, 1, 2, 3] and all(len(v) == 12 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) == 4
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_best_of_returns_highest_cumulative_logprob(tiny_model):
    llm = LLM(loaded=tiny_model, dtype="float32", kv_cache_memory="64MiB")
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, temperature=1.0, n=2, best_of=5, seed=1))[0]
    assert len(out.samples) == 2
    assert out.samples[0].cumulative_logprob >= out.samples[1].cumulative_logprob


def test_logprobs_equal_full_forward(tiny_model):
    llm = LLM(loaded=tiny_model, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    prompt = [random.Random(4).randrange(512) for _ in range(37)]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=3,
                                                prompt_logprobs=2))[0]
    seq = prompt + out.token_ids
    model = tiny_model.model
    cache = ContiguousKV(tiny_model.config, len(seq), torch.float32, torch.device("cpu"))
    pos = torch.arange(len(seq))
    cache.set_positions(pos)
    with torch.no_grad():
        lsm = torch.log_softmax(model.compute_logits(model(torch.tensor(seq), pos, cache)), -1)
    # the engine's chunked steps against one full forward: other shapes, so floats within LOGPROB_ATOL
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        lp, rank, alts = out.prompt_logprobs[j]
        assert_logprobs_close(lp, float(lsm[j - 1, prompt[j]]), f"prompt token {j}")
        top = torch.topk(lsm[j - 1], 2)
        assert [a for a, _ in alts] == top.indices.tolist()
        assert_logprobs_close([b for _, b in alts], top.values.tolist(), f"prompt token {j}'s top 2")
    for i, tok in enumerate(out.token_ids):
        lp, rank, alts = out.logprobs[i]
        row = lsm[len(prompt) - 1 + i]
        assert_logprobs_close(lp, float(row[tok]), f"output token {i}")
        assert rank == int((row > row[tok]).sum()) + 1
        assert [a for a, _ in alts] == torch.topk(row, 3).indices.tolist()


def test_categorical_draws_the_distribution_per_row_generator():
    """The inverse-CDF draw: each row follows its own probabilities (zeros never drawn, rows need
    not be normalised), and a row's tokens depend only on its own generator."""
    from test_spec import chi2, chi2_critical

    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    rows = torch.stack([p * 3.0, p.flip(0)])  # unnormalised, and a different one
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    N = 6000
    draws = torch.stack([S.categorical(rows, [g1, g2]) for _ in range(N)])
    for r, probs in enumerate((p, p.flip(0))):
        counts = {}
        for t in draws[:, r].tolist():
            counts[t] = counts.get(t, 0) + 1
        assert all(probs[t] > 0 for t in counts)  # zero-probability tokens never come out
        stat, df = chi2(counts, dict(enumerate(probs.tolist())), N)
        assert stat < chi2_critical(df), (r, stat, df)
    alone = torch.Generator().manual_seed(1)
    solo = [int(S.categorical(rows[:1], [alone])[0]) for _ in range(50)]
    assert solo == draws[:50, 0].tolist()  # the same tokens as inside a batch of two

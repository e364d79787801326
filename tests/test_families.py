"""Every model family, in both forms users bring (HF folder, GGUF with llama.cpp's names), held to
`transformers` on tiny random weights it writes itself, teacher-forced past every window."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import teacher_forced  # noqa: E402
from hf_to_gguf import write_gguf  # noqa: E402

from inferd.errors import InferdError  # noqa: E402
from inferd.loading.loader import load_model  # noqa: E402
from inferd.model.layers import ContiguousKV  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            eos_token_id=None)  # the engine runs to max_tokens, as the reference loop does
# the near-tie bound where activations are quantized to int8: a last-bit difference that crosses a
# rounding step moves the logits by up to ~6e-3 (the float model's differ by under 1e-6)
W8A8_TIE = 1e-2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def widen(m):
    """Random init has tiny logits; widen them so greedy choices are well separated."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(3.0)
    return m.eval()


def sequence(hf, n_prompt=40, n_new=48, seed=0):
    """A random prompt and transformers' greedy continuation of it: one teacher-forced sequence."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, hf.config.vocab_size, (1, n_prompt), generator=g)
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0]


def our_logits(lm, ids):
    cache = ContiguousKV(lm.config, len(ids), torch.float32, torch.device("cpu"))
    pos = torch.arange(len(ids))
    cache.set_positions(pos)
    with torch.no_grad():
        return lm.model.compute_logits(lm.model(ids, pos, cache))


# (transformers config class, model class, GGUF architecture, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {}),
    # Mistral: one window for every layer, 16, that the 88-token sequence outruns; its GGUF is arch
    # `llama` (as llama.cpp's converter writes it) with the window kept (test_mistral_window_...)
    "mistral": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"sliding_window": 24, "pad_token_id": 0}),
    # mixtures of experts: 8 experts, 2 a token; Mixtral as llama.cpp writes it (arch llama + experts)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "olmoe",
              {"num_experts": 8, "num_experts_per_tok": 2, "pad_token_id": 0}),
    # Gemma 2: every other layer local (window 16); the attention logits capped at 2 (the real models'
    # 50 would barely bend a tiny model's scores: this cap must show, or a missing one passes), the
    # final ones at 30; query_pre_attn_scalar = head_dim
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2",
               {"num_hidden_layers": 4, "sliding_window": 16, "query_pre_attn_scalar": 16,
                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    # six layers: llama.cpp's Gemma 3 pattern (five local, then one global); a window of 16 that the
    # 88-token sequence outruns; query_pre_attn_scalar = head_dim, as in every Gemma 3 but 27B (a GGUF
    # has no key for it: llama.cpp derives it, see test_gemma3_query_scale_is_the_configs)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3",
               {"num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 16,
                "tie_word_embeddings": True,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
}


def tiny(family, **over):
    conf, cls, _, base = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, conf)(**{**TINY, **base, **over})
    m = widen(getattr(transformers, cls)(cfg))
    if family == "qwen2":  # random biases: zero ones would not show a misplaced bias
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_both_forms_equals_transformers(family, tmp_path):
    """The HF folder and the GGUF (llama.cpp's names and row order) of the same random weights, each
    teacher-forced against transformers over a prompt and 48 of its greedy tokens."""
    hf = tiny(family)
    hf.save_pretrained(tmp_path / "hf")
    ids = sequence(hf)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    window = {"sliding_window": True} if family == "mistral" else {}
    for form in (str(tmp_path / "hf"), write_gguf(hf, tmp_path / "m.gguf", FAMILIES[family][2], **window)):
        lm = load_model(form, dtype="float32", with_tokenizer=False)
        assert lm.config.architecture == family
        teacher_forced(our_logits(lm, ids), ref, max_ties=2)


def test_mistral_window_counts_as_transformers_does(tmp_path):
    """Mistral's window of W = 16 lets position i see keys i - 15 .. i: transformers' count (its
    mask keeps key j where j > i - W; its flash-attention path passes the window as W - 1), and
    inferd's (`model.layers.ContiguousKV` here; the paged kernels count alike, phi3's engine case).
    Both forms equal transformers past the window (test_family_in_both_forms_equals_transformers);
    here, that the comparison would catch a window counted otherwise: one key fewer, one more, or
    none at all equals transformers up to the first position whose keys differ (15, 16, 16) and
    leaves it there. "None at all" is a GGUF as llama.cpp's converter writes a Mistral (arch
    `llama`, the window dropped: llama.cpp's llama graph has none), which inferd, like llama.cpp,
    runs as Llama: only a file that keeps the window (`llama.attention.sliding_window`) is Mistral."""
    import dataclasses

    hf = tiny("mistral")
    hf.save_pretrained(tmp_path / "hf")
    ids = sequence(hf)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    lm = load_model(str(tmp_path / "hf"), dtype="float32", with_tokenizer=False)
    assert lm.config.sliding_window == 16
    as_llamacpp = load_model(write_gguf(hf, tmp_path / "llamacpp.gguf", "llama"), dtype="float32", with_tokenizer=False)
    assert as_llamacpp.config.architecture == "llama" and as_llamacpp.config.sliding_window is None
    # (model, the first position whose keys differ from W = 16's: position i sees min(i + 1, window))
    for other, first in ((dataclasses.replace(lm, config=dataclasses.replace(lm.config, sliding_window=15)), 15),
                         (dataclasses.replace(lm, config=dataclasses.replace(lm.config, sliding_window=17)), 16),
                         (as_llamacpp, 16)):
        wrong = our_logits(other, ids)
        torch.testing.assert_close(wrong[:first], ref[:first], atol=2e-4, rtol=0)
        assert (wrong[first] - ref[first]).abs().max() > 1e-2, other.config.sliding_window


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    hf = widen(transformers.LlamaForCausalLM(cfg))
    d = tmp_path_factory.mktemp("llama3")
    hf.save_pretrained(d / "hf")
    return hf, d


def test_llama3_rope_from_rope_freqs_equals_transformers(llama3):
    """A Llama 3.x GGUF carries its RoPE scaling as the `rope_freqs` tensor (divisors per frequency):
    read, it equals transformers' `rope_type: llama3` at positions past the original context (32
    here); dropped, as the loader once did, every position past it goes wrong."""
    hf, d = llama3
    ids = sequence(hf)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for form in (str(d / "hf"), write_gguf(hf, d / "m.gguf", "llama")):
        lm = load_model(form, dtype="float32", with_tokenizer=False)
        teacher_forced(our_logits(lm, ids), ref, max_ties=2)
    assert lm.config.rope_scaling["rope_type"] == "freq_factors"
    dropped = load_model(write_gguf(hf, d / "no_freqs.gguf", "llama", rope_freqs=False), dtype="float32",
                         with_tokenizer=False)
    wrong = our_logits(dropped, ids)
    assert (wrong[40:] - ref[40:]).abs().max() > 1e-2


YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def test_yarn_rope_in_both_forms_equals_transformers(tmp_path):
    """YaRN (Qwen2.5's long-context form) read from config.json and from a GGUF's rope.scaling.* keys as
    llama.cpp's converter writes them (type yarn, factor, original_context_length): teacher-forced
    against transformers over 88 positions, 56 of them past the original context of 32; the declared
    context is the original x the factor (128). Without the keys the same GGUF goes wrong past it."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 128}, rope_parameters=YARN_ROPE,
                                   tie_word_embeddings=False)
    hf = widen(transformers.LlamaForCausalLM(cfg))
    hf.save_pretrained(tmp_path / "hf")
    ids = sequence(hf)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for form in (str(tmp_path / "hf"), write_gguf(hf, tmp_path / "m.gguf", "llama")):
        lm = load_model(form, dtype="float32", with_tokenizer=False)
        rs = lm.config.rope_scaling
        assert rs["rope_type"] == "yarn" and rs["factor"] == 4.0 and rs["original_max_position_embeddings"] == 32
        assert lm.config.max_position_embeddings == 128
        teacher_forced(our_logits(lm, ids), ref, max_ties=2)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    dropped = load_model(write_gguf(hf, tmp_path / "no_yarn.gguf", "llama"), dtype="float32", with_tokenizer=False)
    assert (our_logits(dropped, ids)[40:] - ref[40:]).abs().max() > 1e-2


def test_yarn_declares_the_extended_context():
    """A YaRN config that keeps its original context as max_position_embeddings (Qwen2.5: 32,768 with
    factor 4) declares original x factor, as vLLM reads it; so does a GGUF whose context_length is the
    original; the attention factor is 1 + 0.1 ln(factor) unless given."""
    import math

    from inferd.loading.gguf import config_from_metadata
    from inferd.model.config import config_from_hf
    from inferd.model.layers import rope_attention_factor

    d = dict(architectures=["Qwen2ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
             rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    cfg = config_from_hf(d)
    assert cfg.max_position_embeddings == 131072 and cfg.rope_scaling["rope_type"] == "yarn"
    assert rope_attention_factor(cfg) == pytest.approx(1 + 0.1 * math.log(4))
    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4, "qwen2.embedding_length": 64,
            "qwen2.block_count": 2, "qwen2.feed_forward_length": 128, "qwen2.vocab_size": 256,
            "qwen2.context_length": 32768, "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    g = config_from_metadata(meta)
    assert g.max_position_embeddings == 131072 and rope_attention_factor(g) == pytest.approx(1 + 0.1 * math.log(4))


@pytest.mark.parametrize("form", ["config", "gguf"])
def test_an_unknown_rope_scaling_is_refused_in_one_line(form):
    """A RoPE scaling inferd does not compute is one clear refusal, never ignored (a model run without
    its scaling is wrong past its original context)."""
    from inferd.loading.gguf import config_from_metadata
    from inferd.model.config import config_from_hf

    if form == "config":
        d = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, rope_scaling={"type": "dynamic", "factor": 2.0})
        with pytest.raises(InferdError, match=r"^RoPE scaling 'dynamic' is not supported \(supported: .*yarn"):
            config_from_hf(d)
    else:
        meta = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
                "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.vocab_size": 256,
                "llama.rope.scaling.type": "dynamic"}
        with pytest.raises(InferdError, match=r"^RoPE scaling 'dynamic' \(this GGUF's llama.rope.scaling.type\)"):
            config_from_metadata(meta)


def test_gemma3_query_scale_is_the_configs(tmp_path):
    """query_pre_attn_scalar, where it differs from head_dim (Gemma 3 27B), sets the softmax scale."""
    hf = tiny("gemma3", query_pre_attn_scalar=24, num_hidden_layers=2)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    assert lm.config.query_scale == 24 ** -0.5
    ids = torch.arange(40) % hf.config.vocab_size
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(our_logits(lm, ids), ref, atol=2e-4, rtol=0)


# Mistral is left out: its one window on every layer of the Llama layer is what phi3's case runs
# through the engine (window 24), and each case costs the suite tens of seconds
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])
def test_family_through_the_engine(family, tmp_path):
    """The engine's greedy tokens equal the reference loop's for every family: continuous batching
    with chunked prefill, prefix caching and preemption in one run, n-gram speculation in another;
    each run shows its machinery ran and leaked no KV block."""
    from helpers import compare, make_requests, mixed_requests, reference_outputs, run_engine

    hf = tiny(family)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    vocab = hf.config.vocab_size
    # shared prefixes (cache hits), copy-style prompts (n-gram matches), prompts past every window
    reqs = make_requests(seed=1, n=8, vocab=vocab, shared_prefixes=2) + mixed_requests(n=8, vocab=vocab)
    ref = reference_outputs(lm.model, reqs)
    # a Gemma block holds the layers of one KV group (Gemma 3 here: six groups of one layer, 200 of them
    # about half the memory of 64 blocks of six layers; Gemma 2: two groups of two), any other
    # family's block all its layers
    got, eng = run_engine(lm, reqs, max_num_batched_tokens=32, num_kv_blocks={"gemma3": 200, "gemma2": 100}.get(family, 64),
                          block_size=8, enable_prefix_caching=True)
    compare(got, ref, max_ties=1)
    s = eng.stats
    assert s.max_batch_seqs >= 4 and s.max_prefill_chunks >= 2 and s.preemptions >= 1
    assert eng.block_manager.hits > 0
    got, eng = run_engine(lm, reqs, speculative_method="ngram", num_speculative_tokens=4)
    compare(got, ref, max_ties=1)
    assert eng.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_moe_runs_one_matmul_per_active_expert(family, tmp_path):
    """A 40-token forward routes 80 token-slots a layer; the experts run once each that any slot
    chose (at most 8 a layer), never once a token."""
    from inferd.model.moe import route

    hf = tiny(family)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    active = []
    for layer in lm.model.layers:
        layer.gate.register_forward_hook(
            lambda mod, args, out, lay=layer: active.append(len(route(out, lay.top_k, lay.renormalise)[1].unique())))
    our_logits(lm, torch.arange(40) % hf.config.vocab_size)
    calls = [layer.experts.matmuls for layer in lm.model.layers]
    assert calls == active and all(c <= 8 for c in calls)
    with pytest.raises(InferdError, match="mixture of experts"):
        load_model(str(tmp_path), dtype="float32", with_tokenizer=False, quantization="int4-gptq")


def test_quantized_experts_run_the_dense_layers_kernels(tmp_path):
    """int8 weights with int8 activations: every expert's two Linears become the W8A8 kernel the
    dense layers use (the router stays float), and the engine's greedy tokens equal the reference
    loop's on that quantized model."""
    from helpers import compare, mixed_requests, reference_outputs, run_engine

    hf = tiny("qwen3_moe")
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False, quantization="int8",
                    quantize_activations=True)
    kinds = {type(lin).__name__ for layer in lm.model.layers for e in layer.experts
             for lin in (e.gate_up_proj, e.down_proj)}
    assert kinds == {"W8A8Linear"} and type(lm.model.layers[0].qkv_proj).__name__ == "W8A8Linear"
    assert type(lm.model.layers[0].gate).__name__ == "Linear"
    reqs = mixed_requests(n=8, vocab=hf.config.vocab_size)
    got, _ = run_engine(lm, reqs)
    # the engine's attention (the tiled kernel over a batch of prompts) and the reference loop's (SDPA,
    # one sequence) differ in their sums' last bits (5e-7 in the logits of the float model); int8
    # activations round some of those across a quantization step, a jump of up to 6e-3 measured here
    compare(got, reference_outputs(lm.model, reqs), max_ties=1, gap=W8A8_TIE)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma2", "gemma3"])
def test_two_ranks_give_the_reference_tokens(family, tmp_path):
    """Tensor parallelism over 2 ranks: a dense family cut by heads and MLP columns, a mixture of
    experts by whole experts (4 of 8 a rank); the reference loop's greedy tokens, near ties allowed."""
    from helpers import assert_no_leaks, compare, make_requests, reference_outputs, run_engine  # noqa: F401

    from inferd.engine.engine import LLMEngine
    from inferd.engine.request import SamplingParams

    hf = tiny(family)
    hf.save_pretrained(tmp_path)
    ref_model = load_model(str(tmp_path), dtype="float32", with_tokenizer=False).model
    reqs = [(p[:100], min(n, 24)) for p, n in make_requests(seed=3, n=8, vocab=hf.config.vocab_size)]
    ref = reference_outputs(ref_model, reqs)
    eng = LLMEngine(model=str(tmp_path), dtype="float32", tensor_parallel_size=2, kv_cache_memory="64MiB")
    try:
        rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0)) for p, n in reqs]
        outs = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
        compare([outs[r] for r in rids], ref, max_ties=1)
        assert_no_leaks(eng)
        # the split ran: 2 all-reduces a layer (attention's output, the MLP or the experts) + 1 for
        # the embedding, every step
        assert eng.runner.comm.counts["all_reduce"] == (2 * hf.config.num_hidden_layers + 1) * eng.stats.steps
        if family == "qwen3_moe":
            assert eng.model.layers[0].experts.owned == frozenset({0, 2, 4, 6})
    finally:
        eng.close()


def test_phi3_longrope_from_either_form_equals_transformers(tmp_path):
    """Phi-3's LongRoPE (the 128k models): per-frequency divisors, a long set past the original
    context (32 here) and a short one before it, and cos/sin scaled by sqrt(1 + ln 16 / ln 32) for
    a 16x extension; from config.json and from the GGUF's rope_factors_long/short tensors. Over a
    sequence past the original context (transformers then takes the long set, as inferd does for a
    model that serves past it), teacher-forced."""
    long = [1.0 + 0.5 * i for i in range(8)]
    short = [1.0 + 0.05 * i for i in range(8)]
    hf = tiny("phi3", rope_parameters={"rope_type": "longrope", "long_factor": long, "short_factor": short,
                                       "rope_theta": 10000.0}, original_max_position_embeddings=32)
    hf.save_pretrained(tmp_path / "hf")
    ids = sequence(hf)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for form in (str(tmp_path / "hf"), write_gguf(hf, tmp_path / "m.gguf", "phi3")):
        lm = load_model(form, dtype="float32", with_tokenizer=False)
        assert lm.config.rope_scaling["rope_type"] == "longrope"
        teacher_forced(our_logits(lm, ids), ref, max_ties=2)
    # the factors matter: the plain RoPE is far off past the original context
    lm.config.rope_scaling = None
    lm.model.rope.reset("cpu")
    assert (our_logits(lm, ids)[40:] - ref[40:]).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
def test_structured_output_through_each_kind_of_family(family, tmp_path):
    """Constrained decoding is the engine's, not the family's, but it runs through each kind of layer
    stack (per-head norms, soft-capped windowed attention in KV groups, routed experts): tiny random
    weights with SmolLM2's vocabulary and tokenizer, a JSON schema and a regex in one batch with an
    unconstrained request; every constrained output is valid (jsonschema)."""
    import json
    import re

    import jsonschema
    from json_schemas import SCHEMAS

    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams, StructuredOutputs
    from inferd.gguf_file import default_model_path
    from inferd.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    hf = tiny(family, vocab_size=tok.vocab_size)
    hf.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", with_tokenizer=False)
    lm.tokenizer = tok
    schema = SCHEMAS[6][1]  # an enum and a bounded integer
    prompt = tok.encode("Give the weather.")
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json=schema)),
              SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2}")),
              SamplingParams(max_tokens=8, temperature=0)]
    with LLM(loaded=lm, dtype="float32") as llm:
        out = llm.generate([prompt] * 3, params)
        assert llm.engine.stats.max_batch_seqs == 3
    jsonschema.validate(json.loads(out[0].text), schema)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out[1].text)

"""Every model family, in both forms users bring (HF folder, GGUF with llama.cpp's names), held to
`transformers` on tiny random weights it writes itself, teacher-forced past every window."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_to_gguf import write_gguf  # noqa: E402

from inferd.loading.loader import load_model  # noqa: E402
from inferd.model.llama import ContiguousKV  # noqa: E402

NEAR_TIE = 1e-4
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
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


def assert_teacher_forced(mine, ref, start):
    """From `start` on, our argmax is transformers' or within NEAR_TIE of it in transformers' own
    logits; near ties are counted and must stay rare."""
    ties = 0
    for t in range(start, ref.shape[0]):
        a, b = int(mine[t].argmax()), int(ref[t].argmax())
        if a != b:
            assert float(ref[t, b] - ref[t, a]) < NEAR_TIE, f"position {t}: {a} vs transformers' {b}"
            ties += 1
    assert ties <= 2, f"{ties} near ties"
    torch.testing.assert_close(mine, ref, atol=2e-4, rtol=0)


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
        assert_teacher_forced(our_logits(lm, ids), ref, 0)
    assert lm.config.rope_scaling["rope_type"] == "freq_factors"
    dropped = load_model(write_gguf(hf, d / "no_freqs.gguf", "llama", rope_freqs=False), dtype="float32",
                         with_tokenizer=False)
    wrong = our_logits(dropped, ids)
    assert (wrong[40:] - ref[40:]).abs().max() > 1e-2

"""Our model against Hugging Face transformers on tiny random checkpoints it saves itself."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from inferd.loading.loader import load_model
from inferd.engine.reference import reference_generate

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _save(tmp_path, kind, **over):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False, **over)
        m = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, **over)
        m = transformers.Qwen2ForCausalLM(cfg)
    else:
        # as Mistral 7B v0.2 and later (no window); v0.1's window: test_families' mistral case
        cfg = transformers.MistralConfig(**TINY, sliding_window=None, **over)
        m = transformers.MistralForCausalLM(cfg)
    # random init has tiny logits; widen them so greedy choices are well separated
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(3.0)
            elif "bias" in n:
                p.normal_(0, 0.5)
    m.eval()
    path = tmp_path / kind
    m.save_pretrained(path)
    return m, str(path)


def _hf_greedy(m, prompt, n):
    ids = torch.tensor([prompt])
    out = m.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                     pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


CASES = [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("qwen2", {}),
    ("mistral", {}),
]


@pytest.mark.parametrize("kind,over", CASES, ids=["llama", "llama3-rope", "qwen2", "mistral"])
def test_logits_and_greedy_match_transformers(tmp_path, kind, over):
    hf, path = _save(tmp_path, kind, **over)
    ours = load_model(path, dtype="float32", with_tokenizer=False)
    prompt = [3, 17, 99, 5, 42, 7, 200, 1, 64, 8]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    from inferd.model.layers import ContiguousKV
    cache = ContiguousKV(ours.config, 64, torch.float32, torch.device("cpu"))
    pos = torch.arange(len(prompt))
    cache.set_positions(pos)
    with torch.no_grad():
        mine = ours.model.compute_logits(ours.model(torch.tensor(prompt), pos, cache))
    assert torch.allclose(mine, ref, atol=1e-4, rtol=0), (mine - ref).abs().max()
    want = _hf_greedy(hf, prompt, 32)
    got = reference_generate(ours.model, prompt, 32).token_ids
    assert got == want

"""Regenerate the small quantized GGUF files the suite loads (tests/test_quantized_files.py).

Each is a tiny random model written by `transformers`, converted to a GGUF with llama.cpp's names
(tests/hf_to_gguf.py, F32) and quantized to Q4_K_M by llama.cpp's own `llama-quantize` (built by
benchmarks/llamacpp.py), so the suite holds inferd to files made by the real tool without ever
building llama.cpp. Every matrix has rows of a multiple of 256 weights, so the K-quant mix really
happens (Q4_K beside Q6_K, as in the files people download). Beside each file: its transformers
config (`<name>.json`), from which the test rebuilds the model the oracle runs.

    .venv/bin/python tests/data/quantized/regenerate.py        # all of them
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "benchmarks"))

BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, eos_token_id=None)

# name -> (transformers config class, model class, GGUF architecture, overrides)
FILES = {
    # biased q/k/v (Qwen2's), an untied output layer: llama-quantize's Q4_K_M gives one layer's attn_v Q6_K
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {"tie_word_embeddings": False}),
    # Mixtral as llama.cpp's converter writes it (arch llama with experts): 4 experts, 2 a token
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # fused attn_qkv and ffn_up (gate and up in one tensor)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"pad_token_id": 0, "sliding_window": None}),
    # llama.cpp's Gemma 3 pattern (five local layers of window 16, then one global), norms stored as
    # 1 + w, a tied table
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3",
               {"num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 64,
                "tie_word_embeddings": True}),
}


def tiny(name: str):
    import torch
    import transformers

    cfg_cls, model_cls, arch, over = FILES[name]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **over})
    torch.manual_seed(0)
    m = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random init has tiny logits: widen them so greedy choices are well separated
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(3.0)
    return m, arch


def main() -> None:
    import llamacpp
    from hf_to_gguf import write_gguf

    quantize = llamacpp.build(("llama-quantize",))["llama-quantize"]
    for name in sys.argv[1:] or FILES:
        model, arch = tiny(name)
        with tempfile.TemporaryDirectory() as tmp:
            f32 = write_gguf(model, os.path.join(tmp, "f32.gguf"), arch)
            out = os.path.join(HERE, f"{name}-Q4_K_M.gguf")
            subprocess.run([str(quantize), f32, out, "Q4_K_M"], check=True, capture_output=True)
        with open(os.path.join(HERE, f"{name}.json"), "w") as f:
            json.dump(model.config.to_dict(), f, indent=1, sort_keys=True)
        print(f"{out}: {os.path.getsize(out) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

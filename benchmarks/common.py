"""Helpers the benchmark scripts share (measuring the competitors the same way each time)."""
from __future__ import annotations

import time

import torch


def hf_decode_rate(hf, prompt: list[int], n: int) -> float:
    """Hugging Face transformers' batch-1 greedy decode tok/s, prefill excluded: a 1-token generate
    is timed and subtracted from an n-token one (after a warm-up)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        dt = time.perf_counter() - t0 - t_prefill
    return (n - 1) / dt

"""One pooling forward: token lists -> one flat batch -> the model -> one vector a sequence.

What the pooling runner computes, knowing nothing of requests (the engine's `engine/pooling.py`
schedules them). No KV cache: the attention backend is `SequenceAttention`, built per batch from
its sequences' lengths; the counters prove the batch was never padded.
"""
from __future__ import annotations

import torch

from inferd.model.pooling import SequenceAttention, pool


class PoolingRunner:
    def __init__(self, model, scale: float, causal: bool, strategy: str = "kernel"):
        self.model = model
        self.scale = scale
        self.causal = causal  # a decoder run as a pooling model keeps its causal attention
        self.strategy = strategy
        self.device = model.device
        self.forwards = 0
        self.sequences = 0
        self.tokens = 0  # rows the model computed: equal to the sequences' real tokens, never padded
        self.real_tokens = 0  # the sum of the sequences' lengths
        self.attention_padded_rows = 0  # rows attention computed past a sequence's end (its length buckets)
        self.max_batch_seqs = 0
        self.kernel_forwards = 0  # forwards whose attention ran as the native varlen kernel

    def execute(self, prompts: list[list[int]], mode: str, normalize: list[bool]) -> list[list[float]]:
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        attn = SequenceAttention(lengths, self.scale, self.causal, self.strategy)
        with torch.inference_mode():
            hidden = self.model(ids, positions, attn)
            vecs = pool(hidden, lengths, mode, normalize=False)
            norms = vecs.norm(dim=1, keepdim=True).clamp_min_(1e-12)
            scale = torch.where(torch.tensor(normalize).unsqueeze(1), norms, torch.ones_like(norms))
            vecs = vecs / scale
        self.forwards += 1
        self.sequences += len(prompts)
        self.tokens += hidden.shape[0]
        self.real_tokens += sum(lengths)
        self.attention_padded_rows += attn.padded_tokens
        self.kernel_forwards += attn.kernel_calls > 0
        self.max_batch_seqs = max(self.max_batch_seqs, len(prompts))
        return vecs.tolist()

    def counters(self) -> dict:
        return {"forwards": self.forwards, "sequences": self.sequences, "tokens": self.tokens,
                "real_tokens": self.real_tokens, "padded_tokens": self.tokens - self.real_tokens,
                "attention_padded_rows": self.attention_padded_rows, "max_batch_seqs": self.max_batch_seqs,
                "attention": self.strategy, "kernel_forwards": self.kernel_forwards}

"""Batch -> tensors -> forward -> logits: the only place the scheduler's plan meets the model."""
from __future__ import annotations

import torch

import logging

from inferd.engine.attention import PagedAttention
from inferd.engine.request import Request
from inferd.model import fused_decode
from inferd.model.llama import LlamaModel

log = logging.getLogger("inferd")


class ModelRunner:
    def __init__(self, model: LlamaModel, attention: PagedAttention, enforce_eager: bool = False):
        self.model = model
        self.attn = attention
        self.device = model.device
        # The one place that decides fused vs eager (as nano-vllm's runner owns eager vs CUDA graph):
        # a qualifying model runs its decode-only steps as one C++ call, every other step eagerly.
        self.fused = None if enforce_eager else fused_decode.build(model)
        if self.fused is not None:
            log.info("decode-only steps: one fused C++ call (--enforce-eager: eager)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            hidden = self.fused(input_ids, positions, self.attn)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, self.attn)

    @torch.inference_mode()
    def execute(self, requests: list[Request], num_new: list[int]):
        """Compute num_new[i] tokens of each request. Returns logits [S, vocab] (fp32) for the
        requests whose last known token was computed (they sample next; one row each, or
        1 + len(spec_tokens) rows for a request verifying guesses), their batch indices, and
        {batch index: (first prompt position, logits rows)} for requests that want prompt logprobs."""
        ids: list[int] = []
        starts = []
        sample_rows, sample_idx = [], []
        prompt_spans = {}
        row = 0
        for i, (req, n) in enumerate(zip(requests, num_new)):
            c = req.num_computed
            p = req.num_prompt
            spec = req.spec_tokens  # speculative guesses follow the known tokens in the chunk
            n_all, n = n, n - len(spec)
            if c + n <= p:
                ids.extend(req.prompt_ids[c:c + n])
            elif c >= p:
                ids.extend(req.output_ids[c - p:c - p + n])
            else:
                ids.extend(req.prompt_ids[c:])
                ids.extend(req.output_ids[: c + n - p])
            starts.append(c)
            if req.params.prompt_logprobs is not None and c < p - 1:
                end = min(c + n, p - 1)
                prompt_spans[i] = (c, row, row + end - c)
            ids.extend(spec)
            row += n_all
            if c + n == req.num_tokens:
                # with guesses, every row of the chunk is a position to verify: k + 1 rows
                sample_rows.extend(range(row - 1 - len(spec), row))
                sample_idx.append(i)
        positions = self.attn.prepare([r.block_table for r in requests], starts, num_new)
        hidden = self.forward(torch.tensor(ids, dtype=torch.long, device=self.device), positions.to(self.device))
        prompt_rows = {i: (c, self.model.compute_logits(hidden[a:b])) for i, (c, a, b) in prompt_spans.items()}
        if not sample_rows:
            return hidden.new_zeros(0, self.model.cfg.vocab_size, dtype=torch.float32), [], prompt_rows
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return logits, sample_idx, prompt_rows

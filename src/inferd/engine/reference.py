"""The reference generation loop: one sequence, a contiguous KV cache, nothing clever.

Every fast path in the engine (paging, batching, chunking, prefix caching, speculation) is tested
against the tokens this loop produces. Keep it simple on purpose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inferd.model.layers import ContiguousKV
from inferd.model.llama import LlamaModel


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> int:
    """One token from a [vocab] logits row: greedy at temperature 0, else temperature, top-k, top-p."""
    from inferd.engine.sampler import sample_rows

    return int(sample_rows(logits[None], torch.tensor([float(temperature)]), torch.tensor([int(top_k)]),
                           torch.tensor([float(top_p)]), [generator])[0])


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] row per generated token


def reference_generate(model: LlamaModel, prompt_ids: list[int], max_tokens: int, *,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       seed: int | None = None, eos_ids=(), keep_logits: bool = False,
                       max_len: int | None = None, forced: list[int] | None = None) -> ReferenceOutput:
    """`forced`: teacher forcing, each step fed the given token in place of the one it sampled (the
    output still holds the sampled ones, and the logits they came from)."""
    out: list[int] = []
    rows: list[torch.Tensor] = []
    finish = "length"
    for tok, logits in reference_stream(model, prompt_ids, max_tokens, temperature=temperature,
                                        top_p=top_p, top_k=top_k, seed=seed, max_len=max_len,
                                        forced=forced):
        out.append(tok)
        if keep_logits:
            rows.append(logits)
        if tok in eos_ids:
            finish = "stop"
            break
    return ReferenceOutput(out, finish, rows)


def reference_stream(model: LlamaModel, prompt_ids: list[int], max_tokens: int, *,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: int | None = None, max_len: int | None = None, forced: list[int] | None = None):
    """Yield (token, logits row) one at a time; the caller decides when to stop."""
    if not prompt_ids:
        raise ValueError("prompt must have at least one token")
    dev = model.device
    total = len(prompt_ids) + max_tokens
    cache = ContiguousKV(model.cfg, max_len or total, model.dtype, dev)
    gen = torch.Generator(device=dev)
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)
    for step in range(max_tokens):
        with torch.inference_mode():
            cache.set_positions(pos)
            hidden = model(ids, pos, cache)
            logits = model.compute_logits(hidden[-1:])[0]
            tok = sample_next(logits, temperature, top_p, top_k, gen)
        yield tok, logits.cpu()
        if forced is not None:
            if step + 1 >= len(forced):
                return
            tok = forced[step]
        ids = torch.tensor([tok], dtype=torch.long, device=dev)
        pos = torch.tensor([int(pos[-1]) + 1], device=dev)

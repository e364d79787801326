"""Admission: a prompt and its sampling parameters checked against the model and the KV cache
before anything is queued (the engine's first step, as vLLM's processor is). Every failure is one
InferdError a client can read; the server answers it with a 400.

The request rules live here and only here: how many samples a request runs (SamplingParams.num_samples),
what max_tokens a request gets when it names none, and its bounds. The server and the CLI call the
same functions before they queue anything, so a bad request fails the same way everywhere."""
from __future__ import annotations

import operator

from inferd.engine.request import SamplingParams
from inferd.errors import InferdError


def default_max_tokens(prompt_len: int, max_model_len: int) -> int:
    """max_tokens when a request leaves it out: the rest of the context, as in vLLM."""
    return max_model_len - prompt_len


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, clamp: bool = False) -> int:
    """The max_tokens a request runs with. None: the rest of the context, at least 1, so that a
    prompt filling the context gets the context-limit error rather than this one. `clamp` (the
    CLI's --max-tokens, a ceiling rather than a demand): at most the room the context leaves.
    Resolved before the request is queued so that min_tokens is checked against it."""
    if requested is None:
        return max(1, default_max_tokens(prompt_len, max_model_len))
    if requested < 1:
        raise InferdError("max_tokens must be at least 1")
    if clamp:
        return max(1, min(requested, max_model_len - prompt_len))
    return requested


def kv_blocks_needed(prompt_len: int, max_tokens: int, samples: int, block_size: int,
                     group_windows: tuple = (), chunk: int = 0) -> int:
    """Blocks a request may hold at its peak: the full prompt blocks once (shared by its samples),
    and each sample's own tail (the partial prompt block, recomputed, plus its output); the same
    again for every other KV group, a window group at most its window plus a step's chunk a sample."""
    prompt_blocks = prompt_len // block_size
    full = prompt_blocks + samples * (-(-(prompt_len + max_tokens) // block_size) - prompt_blocks + 1)

    def windowed(w: int) -> int:
        return samples * (-(-(w - 1 + chunk) // block_size) + 2)

    return full + sum(full if w is None else min(full, windowed(w)) for w in group_windows)


def token_ids(prompt) -> list[int]:
    """A prompt given as ids -> a list of ints; anything that is not an integer id is one clear error
    (int() would read "12" or 1.5 as an id, and fail on a dict with a message about literals)."""
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise InferdError("a prompt is text or a list of integer token ids") from None


def check_request(prompt: str | list[int], params: SamplingParams, tokenizer, vocab: int, max_model_len: int,
              block_size: int, num_kv_blocks: int, group_windows: tuple = (), chunk: int = 0) -> list[int]:
    """The prompt's token ids; fills in params.max_tokens when absent (and logprobs for best_of)."""
    params.validate(vocab)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InferdError("this model has no tokenizer: pass token ids")
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = token_ids(prompt)
    if not prompt_ids:
        raise InferdError("prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise InferdError(f"prompt token ids must be in [0, {vocab})")
    if params.stop and tokenizer is None:
        raise InferdError("stop strings need a tokenizer")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise InferdError(f"prompt is {len(prompt_ids)} tokens; the context limit is {max_model_len}")
    params.max_tokens = resolve_max_tokens(params.max_tokens, len(prompt_ids), max_model_len)
    if params.max_tokens > room:
        raise InferdError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                          f"exceeds the context limit of {max_model_len}")
    k = params.num_samples
    need = kv_blocks_needed(len(prompt_ids), params.max_tokens, k, block_size, group_windows, chunk)
    if need > num_kv_blocks:
        raise InferdError(f"request needs up to {need} KV blocks but the cache holds {num_kv_blocks}")
    if k > params.n:  # best_of ranks by cumulative logprob
        params.logprobs = params.logprobs if params.logprobs is not None else 0
    return prompt_ids

"""Decode speed of the engine, measured the one way `inferd eval` and the benchmarks all use."""
from __future__ import annotations

from inferd.engine.engine import LLMEngine
from inferd.engine.paths import engine_paths
from inferd.engine.request import SamplingParams


def decode_rate(loaded, prompt: list[int], n: int, batch: int = 1, warmup: bool = False,
                kv_cache_memory: str = "256MiB", temperature: float = 0.0, paths: dict | None = None,
                kv_cache_dtype: str = "auto") -> float:
    """Output tok/s of `batch` identical greedy requests of n tokens (ignore_eos), prefill excluded:
    at batch 1 the gaps between one request's tokens; above it, all tokens after each request's
    first over the span from the first first token to the last finish. `warmup` runs a short
    request first (kernel builds, allocator). temperature > 0 samples (seeded) instead of argmax.
    `paths`, if given, is filled with what ran (inferd.engine.paths.engine_paths), warm-up included."""
    eng = LLMEngine(loaded=loaded, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batch, 1),
                    kv_cache_dtype=kv_cache_dtype)
    if warmup:
        eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
    ids = [eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True,
                                                  seed=i if temperature > 0 else None))
           for i in range(batch)]
    reqs = [eng.requests[i] for i in ids]
    while eng.has_unfinished():
        eng.step()
    if paths is not None:
        paths.update(engine_paths(eng))
    if batch == 1:
        tt = reqs[0].timings.token_times
        return (len(tt) - 1) / (tt[-1] - tt[0])
    start = min(r.timings.first_token for r in reqs)
    end = max(r.timings.finished for r in reqs)
    return batch * (n - 1) / (end - start)


def prefill_rate(loaded, prompt: list[int], rounds: int = 3, kv_cache_memory: str = "256MiB",
                 paths: dict | None = None) -> float:
    """Prompt tok/s of one request's prefill as one chunk (the step that yields its first token),
    median of `rounds` after a warm-up, prefix caching off so every round computes every token.
    `paths`, if given, is filled with what ran (inferd.engine.paths.engine_paths)."""
    import statistics

    eng = LLMEngine(loaded=loaded, kv_cache_memory=kv_cache_memory, max_num_seqs=1,
                    max_num_batched_tokens=max(512, len(prompt)), enable_prefix_caching=False)
    runs = []
    for _ in range(rounds + 1):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        req = eng.requests[rid]
        while eng.has_unfinished():
            eng.step()
        runs.append(len(prompt) / (req.timings.first_token - req.timings.arrived))
    if paths is not None:
        paths.update(engine_paths(eng))
    return statistics.median(runs[1:])

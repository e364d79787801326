"""`LLM`: the engine for offline use -- prompts in, finished completions out (or one stream)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from inferd.config import EngineConfig
from inferd.engine.pooling import make_engine
from inferd.engine.request import PoolingParams, SamplingParams
from inferd.errors import InferdError


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None
    timings: object
    index: int = 0
    logprobs: list | None = None  # per token: (logprob, rank, [(id, logprob)])
    prompt_logprobs: list | None = None
    cumulative_logprob: float = 0.0
    samples: list = field(default_factory=list)  # all n samples (this one is samples[0])


@dataclass
class EmbeddingOutput:
    request_id: str
    embedding: list[float]
    num_prompt_tokens: int


class LLM:
    """Offline use: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, loaded=None, config: EngineConfig | None = None, **engine_options):
        cfg = config or EngineConfig(model=model)
        for k, v in engine_options.items():  # the runner is chosen from them (make_engine)
            if not hasattr(cfg, k):
                raise InferdError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        self.engine = make_engine(cfg, loaded=loaded)
        self.tokenizer = self.engine.tokenizer

    def close(self):
        """Stop what the engine started (tensor-parallel ranks, KV transfer servers)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """One CompletionOutput per prompt (with n > 1, its `samples` holds all n, best first
        when best_of > n)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams() for _ in prompts]
        ids = [self.engine.add_request(p, copy.deepcopy(sp)) for p, sp in zip(prompts, params)]
        done: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in ids}
        logprobs: dict[tuple, list] = {}
        texts: dict[tuple, list[str]] = {}  # the text deltas of each sample: joined once, at its finish
        prompt_info: dict[str, tuple] = {}
        while self.engine.has_unfinished():
            for o in self.engine.step():
                if o.request_id not in done:  # one aborted before this call
                    continue
                if o.prompt_ids is not None:
                    prompt_info.setdefault(o.request_id, (o.prompt_ids, o.prompt_logprobs))
                key = (o.request_id, o.index)
                if o.logprobs:
                    logprobs.setdefault(key, []).extend(o.logprobs)
                texts.setdefault(key, []).append(o.text_delta)
                if o.finished:
                    lps = logprobs.get(key)
                    done[o.request_id][o.index] = CompletionOutput(
                        o.request_id, prompt_info[o.request_id][0], list(o.output_ids), "".join(texts.pop(key)),
                        o.finish_reason, o.stop_reason, o.timings, o.index, lps,
                        prompt_info[o.request_id][1], sum(x[0] for x in lps) if lps else 0.0)
        results = []
        for rid, sp in zip(ids, params):
            samples = [done[rid][i] for i in sorted(done[rid])]
            if sp.num_samples > sp.n:
                samples = sorted(samples, key=lambda c: -c.cumulative_logprob)[: sp.n]
                if sp.logprobs is None:
                    for c in samples:
                        c.logprobs = None
            first = samples[0]
            first.samples = samples
            results.append(first)
        return results

    def embed(self, inputs, params: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per input (a text, or a list of token ids), in order (vLLM's
        `LLM.embed`); needs the pooling runner (an encoder model, or `runner="pooling"`)."""
        single = isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
        if single:
            inputs = [inputs]
        ids = [self.engine.add_request(x, params or PoolingParams()) for x in inputs]
        done: dict[str, EmbeddingOutput] = {}
        while self.engine.has_unfinished():
            for o in self.engine.step():
                if o.error:
                    raise InferdError(f"embedding {o.request_id} failed: {o.error}")
                if o.embedding is not None:
                    done[o.request_id] = EmbeddingOutput(o.request_id, o.embedding, o.num_prompt_tokens)
        return [done[i] for i in ids]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield (text delta, RequestOutput) for one prompt as tokens come; runs other queued work too."""
        rid = self.engine.add_request(prompt, params or SamplingParams())
        live = True
        while live:
            for out in self.engine.step():
                if out.request_id == rid:
                    live = rid in self.engine.groups
                    yield out.text_delta, out
            if not self.engine.has_unfinished():
                break

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

"""`LLM`: the engine for offline use -- prompts in, finished completions out (or one stream)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from inferd.config import EngineConfig
from inferd.engine.factory import make_engine
from inferd.engine.interface import Engine
from inferd.engine.request import PoolingParams, SamplingParams
from inferd.errors import InferdError

# the roles a chat template is given; `developer` (what OpenAI's newer clients send for system) as system
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


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
    """Offline use: `LLM(model=...).generate(prompts, SamplingParams(...))`, or `.chat(messages)`.

    The defaults are `inferd serve`'s (`quantization="auto"`: a GGUF file runs from its own blocks);
    `quantization="none"` builds the dequantized model. A prompt is text, a list of token ids, or
    vLLM's dict form: {"prompt": text} or {"prompt_token_ids": [ids]}."""

    def __init__(self, model: str | None = None, loaded=None, config: EngineConfig | None = None, **engine_options):
        cfg = config or EngineConfig(model=model)
        for k, v in engine_options.items():  # the runner is chosen from them (make_engine)
            if not hasattr(cfg, k):
                raise InferdError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        self.engine: Engine = make_engine(cfg, loaded=loaded)
        self.tokenizer = self.engine.tokenizer

    def close(self):
        """Stop what the engine started (tensor-parallel ranks, KV transfer servers)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """One CompletionOutput per prompt (with n > 1, its `samples` holds all n, best first
        when best_of > n). `prompts`: one prompt or a list of them (see the class)."""
        prompts = [prompt_of(p) for p in (prompts if is_batch(prompts) else [prompts])]
        params = sampling_params
        if not isinstance(params, list):
            params = [params or SamplingParams() for _ in prompts]
        elif len(params) != len(prompts):
            raise InferdError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, copy.deepcopy(sp)))
        except InferdError:
            for rid in ids:  # all or nothing: a bad prompt leaves none of the batch queued
                self.engine.abort(rid)
            raise
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

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[CompletionOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered by the model's chat template (with `tools` and `chat_template_kwargs` as its
        variables, as Hugging Face's apply_chat_template passes them), then generated as `generate`
        does: one CompletionOutput per conversation."""
        if self.tokenizer is None:
            raise InferdError("this model has no tokenizer (tokenizer.json or GGUF vocabulary): chat needs one")
        many = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if many else [messages]
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            chat_messages(c), add_generation_prompt=add_generation_prompt, tokenize=True, **extra)}
            for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
        rid = self.engine.add_request(prompt_of(prompt), params or SamplingParams())
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


def is_batch(prompts) -> bool:
    """A list of prompts (an empty one too), not one prompt (text, token ids or a dict)."""
    return isinstance(prompts, (list, tuple)) and not (prompts and isinstance(prompts[0], int))


def prompt_of(p) -> str | list[int]:
    """One prompt in any of its forms -> text or token ids, as the engine takes it."""
    if isinstance(p, dict):
        extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
        if extra:
            raise InferdError(f"prompt dict key {extra[0]!r} is not supported (give prompt or prompt_token_ids)")
        if "prompt_token_ids" in p:  # vLLM's TokensPrompt: the ids are the prompt
            p = p["prompt_token_ids"]
            if not isinstance(p, (list, tuple)):
                raise InferdError("prompt_token_ids must be a list of token ids")
        elif "prompt" in p:
            p = p["prompt"]
            if not isinstance(p, str):
                raise InferdError("prompt must be a string (token ids go in prompt_token_ids)")
        else:
            raise InferdError("a prompt dict needs prompt or prompt_token_ids")
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)):
        return list(p)
    raise InferdError(f"a prompt is text, a list of token ids or a dict with prompt or prompt_token_ids, "
                      f"not {type(p).__name__}")


def chat_messages(conversation) -> list[dict]:
    """OpenAI-form messages -> what the chat template renders: roles from the allow-list, content
    as text (text parts joined; a part of another kind is refused: the model takes text only)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InferdError("a conversation is a non-empty list of messages ({'role': ..., 'content': ...})")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            raise InferdError(f"messages[{i}] must be a dict with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InferdError(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__
                            for part in content} - {"text"})
            if kinds:
                raise InferdError(f"messages[{i}].content: a part of type {kinds[0]}; this model takes text only")
            content = "".join(str(part.get("text", "")) for part in content)
        out.append({**m, "role": CHAT_ROLES[role], "content": content})
    return out

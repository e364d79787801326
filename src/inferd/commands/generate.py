"""`inferd generate` and `inferd chat`: one prompt, or a conversation in the terminal, on the same
engine `inferd serve` runs (sized for one sequence)."""
from __future__ import annotations

import sys

import torch

from inferd.config import EngineConfig
from inferd.engine.llm import LLM
from inferd.engine.processor import resolve_max_tokens
from inferd.engine.request import SamplingParams
from inferd.errors import InferdError
from inferd.loading.loader import load_model


def _setup(args):
    """An engine sized for one conversation: generate/chat run on the same engine as serve."""
    cfg = EngineConfig.from_args(args)
    cfg.seed = EngineConfig.seed  # --seed here seeds the sampling (SamplingParams), not the engine
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.tensor_parallel_size > 1:  # every rank loads its own share: no model loaded here first
        if args.max_model_len:
            cfg.max_model_len = args.max_model_len
        cfg.max_num_seqs = 1
        cfg.kv_cache_memory = cfg.kv_cache_memory or "256MiB"
        llm = LLM(config=cfg)
        if llm.tokenizer is None:
            llm.close()
            raise InferdError("this model has no tokenizer (tokenizer.json or GGUF vocabulary); text generation needs one")
        return llm, llm.engine.max_model_len
    lm = load_model(cfg.load_config())
    if lm.tokenizer is None:
        raise InferdError("this model has no tokenizer (tokenizer.json or GGUF vocabulary); text generation needs one")
    max_len = lm.config.max_position_embeddings
    if args.max_model_len:
        if args.max_model_len < 1:
            raise InferdError("--max-model-len must be at least 1")
        if args.max_model_len > max_len:
            raise InferdError(f"--max-model-len {args.max_model_len} exceeds the model's context length {max_len}")
        max_len = args.max_model_len
    # one conversation: one sequence, a KV pool that holds exactly the context
    cfg.max_model_len, cfg.max_num_seqs = max_len, 1
    cfg.num_kv_blocks = -(-max_len // cfg.block_size) + 1
    return LLM(loaded=lm, config=cfg), max_len


def _check_sampling(args):
    if args.temperature < 0:
        raise InferdError("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise InferdError("--top-p must be in (0, 1]")
    if args.top_k < 0:
        raise InferdError("--top-k must be >= 0")


def _stream(llm, prompt_ids, args, max_len):
    """Yield text deltas for one completion, stopping at an end token or the context limit."""
    params = SamplingParams(max_tokens=resolve_max_tokens(args.max_tokens, len(prompt_ids), max_len, clamp=True),
                            temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for delta, _ in llm.stream(prompt_ids, params):
        if delta:
            yield delta


def run_generate(args) -> int:
    _check_sampling(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise InferdError("empty prompt")
    lm, max_len = _setup(args)
    try:
        tok = lm.tokenizer
        if args.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
        else:
            ids = tok.encode(prompt)
        if args.stream:
            for d in _stream(lm, ids, args, max_len):
                sys.stdout.write(d)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print("".join(_stream(lm, ids, args, max_len)))
    finally:
        lm.close()
    return 0


def run_chat(args) -> int:
    _check_sampling(args)
    lm, max_len = _setup(args)
    tok = lm.tokenizer
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"inferd chat — {lm.engine.loaded.source.name}. Type /reset to forget, /exit or Ctrl-D to leave.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        reply = []
        try:
            for d in _stream(lm, ids, args, max_len):
                reply.append(d)
                sys.stdout.write(d)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0

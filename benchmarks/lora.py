"""LoRA adapters on the default model: batched decode over several adapters against the base
model alone, in one engine and one run; and each adapter's quality over the quantized base against
the same adapter merged by peft into transformers' fp32 model.

Speed: one engine (the default serving configuration: the GGUF's own blocks, int8 activations, with
--enable-lora and every adapter loaded) decodes `--batch` requests at once, either all on the base
model or spread evenly over the adapters; rounds interleave the two. Decode tok/s counts the
decode-only steps (every row one new token): their tokens over their time, so prefill is out.
The LoRA rows run eagerly through the model's WithLoRA wrappers (the base alone takes the fused C++
step): the ratio prices both the LoRA products and that path.

Quality: WikiText-2 windows through (a) transformers with the adapter merged by peft, fp32 — the
oracle — and (b) inferd's engine model with the adapter in a slot: the dequantized fp32 base (should
be ~0) and the default quantized base. Mean KL divergence, top-1 agreement, perplexity (as
`inferd eval` computes them).

Usage: .venv/bin/python benchmarks/lora.py [--adapters 4] [--rank 16] [--batch 16] [--rounds 5]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, fmt_spread, interleaved, report_header, spread, write_json  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.paths import engine_paths  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.gguf_file import default_model_path  # noqa: E402

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(hf, n: int, rank: int, root: str) -> dict[str, str]:
    import peft

    paths = {}
    for i in range(n):
        torch.manual_seed(1000 + i)
        m = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJ,
                                                                    init_lora_weights=False))
        paths[f"ad{i}"] = os.path.join(root, f"ad{i}")
        m.save_pretrained(paths[f"ad{i}"])
    return paths


def decode_rate(eng: LLMEngine, loras: list, prompt: list[int], out_len: int) -> float:
    """Tokens per second of the decode-only steps of one batch (all requests added at once)."""
    for i, lo in enumerate(loras):
        eng.add_request(prompt[i % 7:] + prompt[:i % 7], SamplingParams(max_tokens=out_len, temperature=0,
                                                                       ignore_eos=True), lora=lo)
    toks, secs = 0, 0.0
    while eng.has_unfinished():
        decode = bool(eng.scheduler.running) and not eng.scheduler.waiting and all(
            r.num_tokens - r.num_computed == 1 for r in eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        if decode:
            secs += time.perf_counter() - t0
            toks += sum(len(o.new_token_ids) for o in outs)
    return toks / secs


def quality(hf_merged, eng: LLMEngine, adapter: str, windows: list[list[int]]) -> dict:
    from inferd.eval import Accumulator, compare, window_logprobs

    acc = Accumulator()
    slot = eng.lora._slot(adapter, {adapter})
    for w in windows:
        with torch.inference_mode():
            ref = torch.log_softmax(hf_merged(torch.tensor([w])).logits[0].float(), -1)
        eng.lora.set_step([slot], [len(w)])
        try:
            ours = window_logprobs(eng.model, w)
        finally:
            eng.lora.end_step()
        acc.add(compare(ref, ours, torch.tensor(w[1:])))
    return acc.summary()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--windows", type=int, default=4, help="WikiText-2 windows for the quality rows")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    d, f = os.path.split(default_model_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    root = tempfile.mkdtemp(prefix="inferd-lora-bench-")
    paths = make_adapters(hf, args.adapters, args.rank, root)
    mods = [f"{n}={p}" for n, p in paths.items()]
    names = list(paths)
    eng = LLMEngine(lora_modules=mods, max_loras=len(names), max_lora_rank=args.rank, quantization="auto",
                    max_num_seqs=args.batch, kv_cache_memory="512MiB", threads=args.threads)
    from inferd.data import wikitext_path

    text = open(wikitext_path(), encoding="utf-8").read()
    ids = tok(text[:200_000]).input_ids
    prompt = ids[:args.prompt_len]
    base_rows = [None] * args.batch
    mixed_rows = [names[i % len(names)] for i in range(args.batch)]
    one_rows = [names[0]] * args.batch
    runs = interleaved({"base model": lambda: decode_rate(eng, base_rows, prompt, args.out_len),
                        f"{len(names)} adapters": lambda: decode_rate(eng, mixed_rows, prompt, args.out_len),
                        "1 adapter": lambda: decode_rate(eng, one_rows, prompt, args.out_len)}, args.rounds)
    paths_rec = {"inferd, GGUF blocks + int8 activations, LoRA": engine_paths(eng)}
    check_rows(paths_rec)
    setup = {"model": "SmolLM2-135M-Instruct Q4_1 (embedded default), --quantization auto",
             "adapters": f"{len(names)} random peft LoRA adapters, rank {args.rank}, alpha {2 * args.rank}, on "
                         f"{', '.join(PROJ)}", "batch": args.batch,
             "lengths": f"prompt {args.prompt_len}, output {args.out_len} (ignore_eos)",
             "threads": args.threads or torch.get_num_threads(), "rounds": args.rounds,
             "measure": "decode-only steps: their tokens over their seconds (median of interleaved rounds)"}
    report_header("LoRA: batched decode over adapters vs the base model (one engine, one run)", setup, paths_rec)
    base = statistics.median(runs["base model"])
    print(f"\n{'batch rows':<24}{'decode tok/s (min-max)':>28}{'vs base':>10}")
    rows = []
    for k, v in runs.items():
        ratio = statistics.median(v) / base
        print(f"{k:<24}{fmt_spread(v):>28}{ratio:>9.2f}x")
        rows.append({"rows": k, "decode_tok_s": spread(v), "vs_base": ratio})
    windows = [ids[i * args.ctx:(i + 1) * args.ctx] for i in range(1, args.windows + 1)]
    dense = LLMEngine(lora_modules=mods, max_loras=len(names), max_lora_rank=args.rank, quantization="none",
                      dtype="float32", kv_cache_memory="64MiB", threads=args.threads)
    import peft

    print(f"\nquality against the adapter merged by peft into transformers (fp32), {args.windows} WikiText-2 "
          f"windows of {args.ctx} tokens:")
    print(f"{'adapter':<8}{'base in inferd':<34}{'mean KL':>10}{'top-1':>8}{'ppl':>9}")
    qrows = []
    for name, path in paths.items():
        merged = peft.PeftModel.from_pretrained(copy.deepcopy(hf), path).merge_and_unload().eval()
        for label, e in (("fp32 (the file dequantized)", dense), ("default: GGUF blocks + int8 act.", eng)):
            q = quality(merged, e, name, windows)
            print(f"{name:<8}{label:<34}{q['mean_kl']:>10.5f}{q['top1_agreement']:>8.3f}{q['perplexity']:>9.2f}")
            qrows.append({"adapter": name, "base": label, **q})
        del merged
    write_json(args.json, setup, rows, paths_rec, quality=qrows)


if __name__ == "__main__":
    main()

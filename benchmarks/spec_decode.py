"""Speculative decoding at batch 1 on the default model: plain decode vs prompt lookup (ngram)
vs self-drafts (the model's first N layers, bf16 and quantized), in one process run.

Prompts ask the model to repeat or edit a passage of the prompt (the chat template is applied),
the case prompt lookup is for. Every configuration runs every prompt, round-robin per prompt so
that a noisy machine slows all of them alike. Greedy, so each configuration must reproduce the
baseline's tokens (bf16: up to a near tie; the "same" column counts identical outputs).

Columns: decode tok/s (first to last output token: prefill excluded; the median of --rounds
interleaved rounds over every prompt, with the min-max), speedup vs plain decode (ratio of medians),
acceptance rate (accepted / proposed), mean accepted guesses per verify step, output tokens per
target forward pass of the sequence, draft and verify seconds (over every round). The header gives
the setup and each config's paths record (speculative method, the target's and the draft's weights);
each label is checked against it ("self-draft 10L k=3, draft int8": the draft's weights are int8).

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): 16 tokens
a prompt, 1 round.

Usage: .venv/bin/python benchmarks/spec_decode.py [--model F.gguf] [--max-tokens 160] [--threads 2] [--rounds 3]
       [--json out.json] [--tiny]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, interleaved, report_header, spread, write_json  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.paths import check_label, engine_paths  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.loading.loader import load_model  # noqa: E402

PASSAGE_A = ("The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every evening the keeper "
             "climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again "
             "to put it out. In forty years he had missed only one night, during the great storm of 1953, when the "
             "sea broke through the door and filled the lower room with water and sand.")
PASSAGE_B = ("Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
             "into sugar and oxygen. It takes place mainly in the leaves, inside small structures called "
             "chloroplasts, which contain the green pigment chlorophyll. The oxygen is released into the air, "
             "while the sugar gives the plant the energy it needs to grow.")
TYPOS_C = ("Our team meeting will be held on Thursday at ten oclock in the main conferense room. Please bring "
           "your laptop and the quarterly report, and be ready to discus the new budget. Lunch will be provded "
           "after the meeting for everyone who attends.")
CODE_D = ("def average(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
          "    return total / len(values)\n\n\ndef maximum(values):\n    best = values[0]\n    for v in values:\n"
          "        if v > best:\n            best = v\n    return best\n")

PROMPTS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE_A}",
    f"Copy this text exactly as it is:\n\n{PASSAGE_B}",
    f"Fix the spelling mistakes in the following text and write out the corrected text in full:\n\n{TYPOS_C}",
    f"Rename the variable `values` to `numbers` in this Python code and return the whole code:\n\n{CODE_D}",
]


def configs(args):
    yield "plain decode", {}
    for k in args.ngram_k:
        yield f"ngram k={k}", dict(speculative_method="ngram", num_speculative_tokens=k, ngram_min=1,
                                   ngram_max=args.ngram_max, ngram_backoff=args.ngram_backoff)
    if args.ngram_backoff and args.ngram_k:  # what the backoff buys: the first k without it
        k = args.ngram_k[0]
        yield f"ngram k={k} no backoff", dict(speculative_method="ngram", num_speculative_tokens=k, ngram_min=1,
                                              ngram_max=args.ngram_max, ngram_backoff=0)
    for n in args.self_layers:
        yield f"self-draft {n}L k={args.draft_k}", dict(speculative_method="draft", draft_model=f"self:layers={n}",
                                                        num_speculative_tokens=args.draft_k)
    for q in args.quant_methods:
        n = args.quant_layers
        yield f"self-draft {n}L k={args.draft_k}, draft {q}", dict(speculative_method="draft",
                                                            draft_model=f"self:layers={n}",
                                                            draft_quantization=q, num_speculative_tokens=args.draft_k)


def run_one(eng: LLMEngine, prompt_ids: list[int], max_tokens: int):
    rid = eng.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    req = eng.requests[rid]
    while eng.has_unfinished():
        eng.step()
    t = req.timings
    return req.output_ids, len(t.token_times) - 1, t.token_times[-1] - t.token_times[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-backoff", type=int, default=8)
    ap.add_argument("--quantization", default="none",
                    help="the target's weights (e.g. gguf: the file's own Q4_1 blocks); drafts are separate")
    ap.add_argument("--quant-group-size", type=int, default=32)
    ap.add_argument("--self-layers", type=int, nargs="*", default=[4, 10, 20])
    ap.add_argument("--quant-layers", type=int, default=10)
    ap.add_argument("--quant-methods", nargs="*", default=["int8", "int4"])
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=None, help="indices of PROMPTS to run (default: all)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds over every prompt and config; each row is the median round")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): 16 tokens a prompt, 1 round")
    args = ap.parse_args()
    if args.tiny:
        args.max_tokens, args.rounds = 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, quantization=args.quantization,
                    quant_group_size=args.quant_group_size)
    tok = lm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for i, p in enumerate(PROMPTS) if args.prompts is None or i in args.prompts]
    names, engines = [], []
    for name, opts in configs(args):
        names.append(name)
        engines.append(LLMEngine(loaded=lm, kv_cache_memory="96MiB", max_num_seqs=1, **opts))
    # warm-up: kernels, rope tables, allocator
    for eng in engines:
        run_one(eng, prompts[0][:64], 8)
    before = {n: (e.stats.generated_tokens, e.stats.sample_events,
                  e.spec.stats.as_dict() if e.spec else None) for n, e in zip(names, engines)}

    def one(pi: int, name: str, eng: LLMEngine):
        def run():
            g0, e0 = eng.stats.generated_tokens, eng.stats.sample_events
            a0 = (eng.spec.stats.num_accepted_tokens, eng.spec.stats.num_draft_tokens) if eng.spec else (0, 0)
            out, n, dt = run_one(eng, prompts[pi], args.max_tokens)
            acc = ""
            if eng.spec:
                acc = (f"  acceptance {(eng.spec.stats.num_accepted_tokens - a0[0]) / max(1, eng.spec.stats.num_draft_tokens - a0[1]):.2f}")
            print(f"prompt {pi}  {name:<30} {n / dt:6.2f} tok/s  {(eng.stats.generated_tokens - g0) / (eng.stats.sample_events - e0):.2f} "
                  f"tok/step{acc}", file=sys.stderr, flush=True)
            return out, n, dt
        return run

    # round-robin per prompt (every config on prompt 0, then on prompt 1, ...), --rounds times
    runs = interleaved({(pi, name): one(pi, name, eng) for pi in range(len(prompts))
                        for name, eng in zip(names, engines)}, args.rounds, log=False)
    # a config's decode tok/s in a round: its tokens over its decode time, every prompt of the round
    per_round = {name: [sum(runs[(pi, name)][r][1] for pi in range(len(prompts)))
                        / sum(runs[(pi, name)][r][2] for pi in range(len(prompts))) for r in range(args.rounds)]
                 for name in names}
    paths = {name: engine_paths(eng) for name, eng in zip(names, engines)}
    check_rows(paths)
    if args.dtype != "auto":
        check_label(f"target {args.dtype}", paths[names[0]])
    base = statistics.median(per_round[names[0]])
    rows = []
    for name, eng in zip(names, engines):
        g0, e0, s0 = before[name]
        gen, ev = eng.stats.generated_tokens - g0, eng.stats.sample_events - e0
        # identical to plain decode's output on a prompt in every round
        same = sum(all(runs[(pi, name)][r][0] == runs[(pi, names[0])][r][0] for r in range(args.rounds))
                   for pi in range(len(prompts)))
        row = {"label": name, "config": name, "metric": "batch-1 decode tok/s", **spread(per_round[name]),
               "decode_tok_s": statistics.median(per_round[name]),
               "speedup": statistics.median(per_round[name]) / base,
               "tokens_per_target_step": gen / ev, "same_as_plain": same}
        if eng.spec is not None:
            s1 = eng.spec.stats.as_dict()
            d = {k: s1[k] - s0[k] for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                                            "spec_draft_time_s", "spec_verify_time_s")}
            row["acceptance"] = d["spec_num_accepted_tokens"] / max(1, d["spec_num_draft_tokens"])
            row["accepted_per_verify"] = d["spec_num_accepted_tokens"] / max(1, d["spec_num_drafts"])
            row["draft_s"], row["verify_s"] = d["spec_draft_time_s"], d["spec_verify_time_s"]
        rows.append(row)
    name = os.path.basename(args.model) if args.model else "SmolLM2-135M-Instruct"
    setup = {"model": f"{name} ({args.dtype}, target weights: {args.quantization})",
             "threads": torch.get_num_threads(), "torch kernels": torch.backends.cpu.get_cpu_capability(),
             "requests": f"{len(prompts)} repeat/edit prompts (chat template), one at a time (batch 1), greedy, "
                         f"max_tokens={args.max_tokens}",
             "rounds": f"{args.rounds}, interleaved (every config on each prompt in turn, then the next prompt, "
                       "then again); a row's tok/s is the median round's (its tokens over its decode time, prefill "
                       "excluded), with the min-max; speedup = the ratio of medians",
             "same": f"prompts whose output equals plain decode's in every round, of {len(prompts)}"}
    report_header("speculative decoding at batch 1", setup, paths)
    hdr = f"{'config':<32}{'tok/s':>8}{'min-max':>14}{'speedup':>9}{'accept':>8}{'acc/step':>9}{'tok/step':>9}" \
          f"{'draft s':>9}{'verify s':>9}{'same':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        acc = f"{100 * r['acceptance']:.0f}%" if "acceptance" in r else "-"
        aps = f"{r['accepted_per_verify']:.2f}" if "acceptance" in r else "-"
        ds = f"{r['draft_s']:.1f}" if "acceptance" in r else "-"
        vs = f"{r['verify_s']:.1f}" if "acceptance" in r else "-"
        print(f"{r['config']:<32}{r['decode_tok_s']:>8.1f}{r['min']:>7.1f}-{r['max']:<6.1f}{r['speedup']:>8.2f}x"
              f"{acc:>8}{aps:>9}{r['tokens_per_target_step']:>9.2f}{ds:>9}{vs:>9}{r['same_as_plain']:>4}/{len(prompts)}")
    write_json(args.json, setup, rows, paths)


if __name__ == "__main__":
    main()

"""Suffix decoding against no speculation and prompt lookup, on the workloads it is for and on one
it is not for, at batch 1 and 16, in one process run.

Workloads (inferd.bench.workloads, the same `inferd bench --dataset` sends): agent-loop (a shell
agent's turns, tool output quoted back), code-edit (a file and a small change: the answer is the
file again), json-extraction, low-rep-chat (open questions: little to copy). Each request is chat
messages under the model's own chat template; greedy.

Small models loop under greedy decoding (the same sentence again and again), which flatters every
lookup method. So each workload's pool is screened first with plain decoding: for each output, the
share of its tokens whose 8-gram already occurred earlier in the same output ("self-repeat"); an
output at or over --loop-share is looping and its request is left out; the timed set is the first
--requests requests that do not loop (the header reports how many were left out, and the mean
self-repeat of those kept).

Contenders: plain decode; prompt lookup (`ngram`, k=8, backoff on: what inferd had); suffix decoding
(`--speculative-config '{"method": "suffix", "num_speculative_tokens": 16}'`: the request's own
prompt and output plus the shared cache of earlier outputs, the cost model measured at start);
with --ablation also suffix without its cost model. Each round runs every contender on the same
requests in turn (interleaved), and the shared cache starts empty every round (each round's
requests carry their own cache_salt: a round never drafts from an earlier round's identical
outputs, only from earlier requests of its own round, as a served agent would). The engines, and
the cost model's learned acceptance, live across rounds.

Decode tok/s: batch 1, every request's tokens after its first over the time from its first to its
last token, summed over the requests; batch B, the B requests submitted at once, the tokens written
after the last of them got its first one, over the time from then to the last token (prefill out of
it alike for every contender). Rows: the median round with the min-max, the ratio to plain decode
and to prompt lookup (ratios of medians), acceptance, tokens per target step, rows verified and
rows the cost model skipped, and whether each output equals plain decoding's ("same": greedy; bf16
may flip a near tie). The header gives the CPU, the setup and each contender's record of paths.

The model is served as `inferd serve` serves it by default (--quantization auto: a GGUF's own blocks
with int8 activations, the fused decode step; --quantization none: the dequantized weights).

First, the verify-cost curve: what one step of R decode rows (R = 1..17) costs at contexts of 512
and 4096 tokens, the rows reading the same blocks as a verifying sequence's k + 1 rows do; what a
guess costs is what decides whether it pays.

Usage: .venv/bin/python benchmarks/suffix_decode.py [--model gemma3-270m] [--quantization auto] [--batch 1 16]
       [--requests 16] [--max-tokens 160] [--rounds 3] [--workloads ...] [--ablation] [--json F] [--tiny]
       [--curve-depths 512 4096] [--curve-rows 17] [--curve-only]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import check_rows, interleaved, report_header, spread, write_json  # noqa: E402
from inferd.bench.workloads import WORKLOADS, conversations  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.paths import engine_paths  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.engine.speculative.budget import verify_cost_curve  # noqa: E402
from inferd.loading.loader import load_model  # noqa: E402

PLAIN, NGRAM, SUFFIX, NO_COST = "plain decode", "ngram k=8", "suffix k=16, cost model", "suffix k=16, no cost model"


def contenders(args) -> dict:
    out = {PLAIN: {}, NGRAM: dict(speculative_method="ngram", num_speculative_tokens=8),
           SUFFIX: dict(speculative_config={"method": "suffix", "num_speculative_tokens": 16})}
    if args.ablation:
        out[NO_COST] = dict(speculative_config={"method": "suffix", "num_speculative_tokens": 16, "cost_model": False})
    return out


def self_repeat(out: list[int], n: int = 8) -> float:
    """The share of an output's tokens that end an n-gram already seen earlier in the output."""
    seen, rep = set(), 0
    for j in range(n - 1, len(out)):
        g = tuple(out[j - n + 1:j + 1])
        rep += g in seen
        seen.add(g)
    return rep / len(out) if out else 0.0


def run_batch(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, salt: str | None) -> dict:
    """Submit the prompts at once, run to the end: outputs, and the decode tokens and seconds after the
    last of them got its first token."""
    steps0, events0 = eng.stats.steps, eng.stats.sample_events
    reqs = []
    for p in prompts:
        rid = eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, cache_salt=salt))
        reqs.append(eng.requests[rid])
    while eng.has_unfinished():
        eng.step()
    t0 = max(r.timings.token_times[0] for r in reqs)
    t1 = max(r.timings.token_times[-1] for r in reqs)
    toks = sum(sum(1 for t in r.timings.token_times if t > t0) for r in reqs)
    return {"outputs": [r.output_ids for r in reqs], "tokens": toks, "seconds": t1 - t0,
            "steps": eng.stats.steps - steps0, "sample_events": eng.stats.sample_events - events0}


def run_round(eng: LLMEngine, prompts, batch: int, max_tokens: int, salt: str | None) -> dict:
    """One contender over the request set: batch 1 one request at a time, else batches of `batch`."""
    outs, toks, secs = [], 0, 0.0
    for i in range(0, len(prompts), batch):
        r = run_batch(eng, prompts[i:i + batch], max_tokens, salt)
        outs += r["outputs"]
        toks += r["tokens"]
        secs += r["seconds"]
    return {"outputs": outs, "tokens": toks, "seconds": secs, "rate": toks / secs if secs > 0 else 0.0}


def screen(eng: LLMEngine, pool, want: int, batch: int, max_tokens: int, loop_share: float):
    """Plain decoding of the pool: (the first `want` requests whose output does not loop, the
    self-repeat share of every output screened, how many looped)."""
    kept, shares, looped = [], [], 0
    for i in range(0, len(pool), batch):
        chunk = pool[i:i + batch]
        res = run_batch(eng, chunk, max_tokens, "screen")
        for p, out in zip(chunk, res["outputs"]):
            s = self_repeat(out)
            shares.append(s)
            if s >= loop_share:
                looped += 1
            elif len(kept) < want:
                kept.append(p)
        if len(kept) >= want:
            break
    return kept, shares, looped


def spec_delta(eng, before: dict | None) -> dict:
    if eng.spec is None:
        return {}
    now = eng.spec.stats.as_dict()
    keys = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_proposed_tokens",
            "spec_num_cost_skipped_tokens", "spec_num_verified_rows", "spec_num_cache_drafts", "spec_draft_time_s")
    out = {k: now[k] - (before or {}).get(k, 0) for k in keys}
    out["steps"] = eng.stats.steps - (before or {}).get("steps", 0)
    return out


def spec_before(eng) -> dict | None:
    return {**eng.spec.stats.as_dict(), "steps": eng.stats.steps} if eng.spec is not None else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M; gemma3-270m: the other one")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto",
                    help="the target's weights; auto (default): what `inferd serve` serves a GGUF as")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=16, help="timed requests per workload (after screening)")
    ap.add_argument("--pool", type=int, default=3, help="screen up to this many times --requests")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-share", type=float, default=0.4,
                    help="an output whose self-repeat share is at least this is looping (left out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ablation", action="store_true", help="also suffix without its cost model")
    ap.add_argument("--curve-depths", type=int, nargs="*", default=[512, 4096],
                    help="the verify-cost curve: a step of R rows at these contexts (none: no curve)")
    ap.add_argument("--curve-rows", type=int, default=17, help="the curve's rows: 1 .. this")
    ap.add_argument("--curve-only", action="store_true", help="print the verify-cost curve, run no workload")
    ap.add_argument("--kv-cache-memory", default="2GiB",
                    help="each engine's KV cache: enough that no request is preempted (a preempted request "
                         "recomputes its tokens through the prefill path, whose last bits differ: then outputs "
                         "may part from plain decoding's for that reason alone; the table counts preemptions)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="a smoke run: two workloads, 2 requests, 8 tokens, 1 round")
    args = ap.parse_args()
    if args.tiny:
        args.workloads, args.batch, args.requests, args.pool = ["code-edit", "low-rep-chat"], [1, 2], 2, 1
        args.max_tokens, args.rounds = 8, 1
        args.curve_depths, args.curve_rows = [64, 256], 3
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    tok = lm.tokenizer
    biggest = max(args.batch)
    engines = {}
    for name, opts in contenders(args).items():
        engines[name] = LLMEngine(loaded=lm, kv_cache_memory=args.kv_cache_memory if not args.tiny else "128MiB",
                                  max_num_seqs=biggest, max_model_len=4096, **opts)
    names = list(engines)
    plain = engines[PLAIN]
    for eng in engines.values():  # warm-up: kernels, allocator, rope tables
        run_batch(eng, [[1] + list(range(100, 140))], 4, "warm-up")
    curve = verify_curve(plain, args) if args.curve_depths else {}
    results, screens, rows = {}, {}, []
    for wl in ([] if args.curve_only else args.workloads):
        pool = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
                for m in conversations(wl, args.requests * args.pool, args.seed)]
        kept, shares, looped = screen(plain, pool, args.requests, biggest, args.max_tokens, args.loop_share)
        screens[wl] = {"screened": len(shares), "looping": looped, "kept": len(kept),
                       "mean_self_repeat": statistics.mean(shares) if shares else 0.0,
                       "prompt_tokens": statistics.mean(len(p) for p in kept) if kept else 0}
        print(f"[{wl}] screened {len(shares)}: {looped} looping (self-repeat >= {args.loop_share}), kept {len(kept)}; "
              f"mean self-repeat {100 * screens[wl]['mean_self_repeat']:.0f} %", file=sys.stderr, flush=True)
        if not kept:
            continue
        for b in args.batch:
            before = {n: spec_before(engines[n]) for n in names}
            preempted = {n: engines[n].stats.preemptions for n in names}
            rnd = {"i": 0}

            def runner(name, b=b, kept=kept, wl=wl):
                def go():
                    # every round its own salt: the shared cache starts empty for each round's requests
                    r = run_round(engines[name], kept, b, args.max_tokens, f"{wl}:b{b}:round{rnd['i'] // len(names)}")
                    rnd["i"] += 1
                    return r
                return go

            runs = interleaved({n: runner(n) for n in names}, args.rounds, log=False)
            results[(wl, b)] = runs
            base = statistics.median(r["rate"] for r in runs[PLAIN])
            ng = statistics.median(r["rate"] for r in runs[NGRAM])
            for n in names:
                rates = [r["rate"] for r in runs[n]]
                same = sum(all(o == p for o, p in zip(r["outputs"], q["outputs"]))
                           for r, q in zip(runs[n], runs[PLAIN]))
                d = spec_delta(engines[n], before[n])
                row = {"label": n, "workload": wl, "batch": b, "metric": "decode tok/s", **spread(rates),
                       "speedup_vs_plain": statistics.median(rates) / base, "speedup_vs_ngram": statistics.median(rates) / ng,
                       "rounds_same_as_plain": same, "preemptions": engines[n].stats.preemptions - preempted[n], **d}
                if d:
                    row["acceptance"] = d["spec_num_accepted_tokens"] / max(1, d["spec_num_draft_tokens"])
                rows.append(row)
                print(f"[{wl} b={b}] {n:<28} {statistics.median(rates):8.1f} tok/s  x{row['speedup_vs_plain']:.2f} plain"
                      f"  x{row['speedup_vs_ngram']:.2f} ngram", file=sys.stderr, flush=True)
    paths = {n: engine_paths(e) for n, e in engines.items()}
    check_rows(paths)
    model = lm.source.name if hasattr(lm, "source") else str(args.model)
    setup = {"model": f"{model} ({str(lm.model.dtype).replace('torch.', '')}, --quantization {args.quantization})",
             "threads": torch.get_num_threads(),
             "workloads": ", ".join(f"{w}: {s['kept']} kept of {s['screened']} screened ({s['looping']} looping, "
                                    f"mean self-repeat {100 * s['mean_self_repeat']:.0f} %, ~{s['prompt_tokens']:.0f} "
                                    "prompt tokens)" for w, s in screens.items()),
             "requests": f"greedy, max_tokens={args.max_tokens}, chat template; batch {args.batch}",
             "rounds": f"{args.rounds}, interleaved; each row the median round (min-max); ratios of medians; the "
                       "shared suffix cache starts empty each round",
             "cost model": "; ".join(f"{n}: {e.spec.cost.describe()}" for n, e in engines.items()
                                     if e.spec is not None and e.spec.cost is not None)}
    report_header("suffix decoding vs prompt lookup vs plain decode", setup, paths)
    hdr = (f"{'workload':<16}{'b':>3} {'config':<29}{'tok/s':>8}{'min-max':>15}{'/plain':>8}{'/ngram':>8}"
           f"{'accept':>8}{'tok/step':>9}{'rows':>7}{'skipped':>8}{'draft ms':>9}{'same':>6}{'preempt':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        runs = results[(r["workload"], r["batch"])][r["label"]]
        steps_tok = ""
        acc = f"{100 * r['acceptance']:.0f}%" if "acceptance" in r else "-"
        rows_v = str(r.get("spec_num_verified_rows", "-"))
        skipped = str(r.get("spec_num_cost_skipped_tokens", "-"))
        gen = sum(len(o) for o in runs[0]["outputs"])
        draft_ms = "-"
        if "spec_num_drafts" in r:
            steps_tok = f"{1 + r['spec_num_accepted_tokens'] / max(1, r['spec_num_drafts']):.2f}"
            draft_ms = f"{1000 * r['spec_draft_time_s'] / max(1, r['steps']):.2f}"
        print(f"{r['workload']:<16}{r['batch']:>3} {r['label']:<29}{r['median']:>8.1f}{r['min']:>8.1f}-{r['max']:<7.1f}"
              f"{r['speedup_vs_plain']:>7.2f}x{r['speedup_vs_ngram']:>7.2f}x{acc:>8}{steps_tok or '-':>9}{rows_v:>7}"
              f"{skipped:>8}{draft_ms:>9}{r['rounds_same_as_plain']:>4}/{len(runs)}{r['preemptions']:>8}")
        r["output_tokens_per_round"] = gen
    print("(tok/step: tokens per verify step of a drafted sequence; rows: verify rows over every round; skipped: "
          "guesses the cost model left out; draft ms: proposing (and the cost model) per engine step; same: rounds whose "
          "outputs all equal plain decoding's; preempt: requests preempted over every round, each recomputed through "
          "the prefill path)")
    print_curve(curve)
    write_json(args.json, setup, rows, paths, screens=screens,
               verify_cost={str(d): {str(r): t for r, t in c.items()} for d, c in curve.items()})


def verify_curve(eng: LLMEngine, args) -> dict:
    """What a verify step of R rows costs at each depth (the plain engine: the same model and paths)."""
    need = max(args.curve_depths) + 1
    if need > eng.num_kv_blocks * eng.config.block_size:
        sys.exit(f"--curve-depths: {need} tokens do not fit this engine's KV cache")
    print(f"[curve] rows 1..{args.curve_rows} at depths {args.curve_depths}", file=sys.stderr, flush=True)
    return verify_cost_curve(eng, list(range(1, args.curve_rows + 1)), args.curve_depths)


def print_curve(curve: dict):
    """The step of R rows in ms and as a multiple of one row's step, at each depth."""
    if not curve:
        return
    depths = list(curve)
    print("\nverify-cost curve: one step of R decode rows over the same context (median of 5, ms; xN: over one row)")
    print(f"{'rows':>5}" + "".join(f"{f'depth {d}':>22}" for d in depths))
    for r in curve[depths[0]]:
        cells = "".join(f"{1000 * curve[d][r]:>12.2f} ms {curve[d][r] / curve[d][1]:>5.2f}x" for d in depths)
        print(f"{r:>5}{cells}")


if __name__ == "__main__":
    main()

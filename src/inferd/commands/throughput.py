"""`inferd throughput`: N seeded requests through the engine at once, measured from its own events."""
from __future__ import annotations

import json
import logging
import random
import sys
import time

from inferd.errors import InferdError


def parse_range(text: str, name: str) -> tuple[int, int]:
    try:
        if "-" in text or ":" in text:
            a, b = text.replace(":", "-").split("-")
            lo, hi = int(a), int(b)
        else:
            lo = hi = int(text)
    except ValueError:
        raise InferdError(f"--{name} must be N or MIN-MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise InferdError(f"--{name} must satisfy 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def random_requests(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int, avoid: set[int] = frozenset()) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    pool = [t for t in range(vocab) if t not in avoid]
    return [([rng.choice(pool) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(n)]


def jsonl_requests(path: str, n: int, tokenizer, output_len: tuple[int, int], seed: int):
    rng = random.Random(seed)
    out = []
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                d = json.loads(line)
                ids = tokenizer.encode(d["prompt"]) if isinstance(d["prompt"], str) else list(d["prompt"])
                out.append((ids, int(d.get("output_len") or rng.randint(*output_len))))
                if len(out) == n:
                    break
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise InferdError(f"cannot read dataset {path}: {e}") from None
    return out


def percentile(xs: list[float], q: float) -> float:
    """bench's percentile (numpy's linear method); NaN for no samples, as this report always wrote."""
    from inferd.bench.metrics import percentile as pct

    v = pct(xs, q)
    return float("nan") if v is None else v


def run_throughput(args) -> dict:
    from inferd.config import EngineConfig
    from inferd.engine.engine import LLMEngine
    from inferd.engine.request import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.num_prompts < 1:
        raise InferdError("--num-prompts must be at least 1")
    cfg = EngineConfig.from_args(args)
    if cfg.runner == "pooling":
        raise InferdError("inferd throughput measures generation; embeddings: `inferd bench --endpoint /v1/embeddings` "
                          "against a server, or benchmarks/embeddings.py")
    eng = LLMEngine(cfg)
    tok = eng.tokenizer
    out_range = parse_range(args.output_len, "output-len")
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise InferdError("--dataset jsonl needs --dataset-path")
        if tok is None:
            raise InferdError("this model has no tokenizer for text prompts")
        reqs = jsonl_requests(args.dataset_path, args.num_prompts, tok, out_range, args.seed)
    else:
        special = {i for i in range(eng.model_config.vocab_size) if tok and tok.is_special(i)} if tok else set()
        reqs = random_requests(args.num_prompts, parse_range(args.input_len, "input-len"), out_range,
                               eng.model_config.vocab_size, args.seed, special)
    t0 = time.monotonic()
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=args.temperature, seed=args.seed + i,
                                              ignore_eos=args.ignore_eos), arrival=t0)
            for i, (p, n) in enumerate(reqs)]
    live = {rid: eng.requests[rid] for rid in rids}
    while eng.has_unfinished():
        eng.step()
    elapsed = time.monotonic() - t0
    done = list(live.values())
    out_toks = sum(len(r.output_ids) for r in done)
    in_toks = sum(r.num_prompt for r in done)
    ttft = [r.timings.ttft * 1000 for r in done if r.timings.ttft is not None]
    tpot = [r.timings.tpot * 1000 for r in done if r.timings.tpot is not None]
    bm = eng.block_manager
    s = eng.stats
    res = {
        "num_requests": len(done),
        "elapsed_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_throughput": out_toks / elapsed,
        "total_token_throughput": (in_toks + out_toks) / elapsed,
        "total_input_tokens": in_toks,
        "total_output_tokens": out_toks,
        "mean_ttft_ms": sum(ttft) / len(ttft),
        "median_ttft_ms": percentile(ttft, 50),
        "p99_ttft_ms": percentile(ttft, 99),
        "mean_tpot_ms": sum(tpot) / len(tpot) if tpot else float("nan"),
        "median_tpot_ms": percentile(tpot, 50),
        "p99_tpot_ms": percentile(tpot, 99),
        "steps": s.steps,
        "max_batch_seqs": s.max_batch_seqs,
        "preemptions": s.preemptions,
        "peak_kv_blocks": s.peak_kv_blocks,
        "kv_blocks": bm.num_blocks,
        "peak_kv_usage": s.peak_kv_blocks / bm.num_blocks,
        "prefix_cache_queries": bm.queries,
        "prefix_cache_hits": bm.hits,
        "prefix_cache_hit_rate": bm.hits / bm.queries if bm.queries else 0.0,
        "scheduling": cfg.scheduling,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": str(eng.model.dtype).replace("torch.", ""),
        "sample_events": s.sample_events,
        "speculative_method": cfg.speculative_method,
    }
    if eng.spec is not None:
        res.update(eng.spec.stats.as_dict())
        res["num_speculative_tokens"] = cfg.num_speculative_tokens
        res["spec_tokens_per_step"] = s.generated_tokens / s.sample_events if s.sample_events else 0.0
    print(format_report(res))
    return res


def format_report(r: dict) -> str:
    rows = [
        ("Requests", f"{r['num_requests']}"),
        ("Elapsed (s)", f"{r['elapsed_s']:.2f}"),
        ("Requests/s", f"{r['requests_per_s']:.2f}"),
        ("Output tokens/s", f"{r['output_throughput']:.1f}"),
        ("Total tokens/s", f"{r['total_token_throughput']:.1f}"),
        ("Input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']}"),
        ("TTFT mean / p50 / p99 (ms)", f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}"),
        ("TPOT mean / p50 / p99 (ms)", f"{r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}"),
        ("Steps / largest batch", f"{r['steps']} / {r['max_batch_seqs']}"),
        ("Peak KV usage", f"{r['peak_kv_blocks']} of {r['kv_blocks']} blocks ({100 * r['peak_kv_usage']:.1f}%)"),
        ("Preemptions", f"{r['preemptions']}"),
        ("Prefix cache hit rate", f"{100 * r['prefix_cache_hit_rate']:.1f}% ({r['prefix_cache_hits']} of {r['prefix_cache_queries']} tokens)"),
    ]
    if r.get("speculative_method"):
        rows += [
            ("Speculative decoding", f"{r['speculative_method']}, k={r['num_speculative_tokens']}"),
            ("Acceptance rate", f"{100 * r['spec_acceptance_rate']:.1f}% ({r['spec_num_accepted_tokens']} of "
                                f"{r['spec_num_draft_tokens']} proposed)"),
            ("Mean accepted length", f"{r['spec_mean_accepted_length']:.2f} per verify step "
                                     f"({r['spec_num_drafts']} steps)"),
            ("Tokens per target step", f"{r['spec_tokens_per_step']:.2f} (per sequence)"),
            ("Draft / verify time (s)", f"{r['spec_draft_time_s']:.2f} / {r['spec_verify_time_s']:.2f}"),
        ]
        if r["speculative_method"] == "suffix":  # where the guesses went
            rows.append(("Guesses", f"{r['spec_num_proposed_tokens']} proposed: {r['spec_num_draft_tokens']} verified, "
                                    f"{r['spec_num_cost_skipped_tokens']} skipped by the cost model, "
                                    f"{r['spec_num_grammar_cut_tokens']} cut by a grammar; "
                                    f"{r['spec_num_cache_drafts']} drafts from the shared cache"))
    w = max(len(k) for k, _ in rows)
    title = f"inferd throughput ({r['scheduling']}, max_num_seqs={r['max_num_seqs']}, {r['dtype']})"
    return "\n".join([title, "-" * len(title)] + [f"{k:<{w}}  {v}" for k, v in rows])

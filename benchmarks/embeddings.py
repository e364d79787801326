"""Embeddings/s of inferd's pooling runner against sentence-transformers, on the same CPU, threads,
files (the embedded all-MiniLM-L6-v2) and batches of mixed-length texts.

    python benchmarks/embeddings.py                      # batches 1, 8, 64; 5 interleaved rounds
    python benchmarks/embeddings.py --threads 2 --rounds 7 --json out.json
    python benchmarks/embeddings.py --tiny               # the suite's smoke run (tests/test_benchmarks.py)

Both run in this process, in-memory: sentence-transformers' `encode(batch, batch_size=len(batch))`
(fp32, padded to the longest text of each batch, its own default) against inferd's `LLM.embed(batch)`
(one padding-free flat batch per step, `--dtype auto`: bf16 on a CPU with AVX512-BF16). Each round
embeds the same texts with every contender in turn (A B C, A B C ...); a row is the median of the
rounds with their min-max. The inferd record says what ran: the weights' dtype, the attention
layout, and the counters that prove no padding (tokens computed == the sequences' real tokens).
`inferd loop` is the same engine with one attention call per sequence instead of length buckets: the
"which is faster on this CPU" measurement of the two varlen layouts.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, fmt_spread, hf_paths, interleaved, report_header, spread, write_json  # noqa: E402

WORDS = ("the of and to in is was for on that with as by it at from his her an have are were this be which or had "
         "not river model token light north quiet paper system garden number about would could people after").split()


def mixed_texts(n: int, seed: int, lo: int = 4, hi: int = 240) -> list[str]:
    """Texts of lo..hi words (each about one WordPiece), lengths spread as a retrieval corpus's are:
    most short, a tail up to the model's 256-token limit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = min(hi, max(lo, int(rng.expovariate(1 / 60))))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64", help="texts per call, comma-separated")
    ap.add_argument("--texts", type=int, default=64, help="texts embedded per batch size and contender, a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: all cores)")
    ap.add_argument("--no-loop", action="store_true", help="leave out the one-call-per-sequence attention row")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: batches 1 and 8, 8 texts, 1 round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.batches, args.texts, args.rounds, args.no_loop = "1,8", 8, 1, False
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from inferd.engine.llm import LLM
    from inferd.engine.pooling import pooling_paths
    from inferd.loading import embedded

    folder = embedded.minilm_path()
    st = SentenceTransformer(folder, device="cpu")
    llm = LLM(model="all-minilm-l6-v2", dtype="auto", threads=args.threads)
    loop = None if args.no_loop else LLM(loaded=llm.engine.loaded, threads=args.threads)
    if loop is not None:
        loop.engine.runner.strategy = "loop"
    batches = [int(b) for b in args.batches.split(",")]
    corpus = mixed_texts(args.texts, seed=0)
    tok = llm.tokenizer
    lengths = [min(256, len(tok.encode(t))) for t in corpus]

    def rate(fn, b):
        def run():
            t0 = time.perf_counter()
            for i in range(0, len(corpus), b):
                fn(corpus[i:i + b])
            return len(corpus) / (time.perf_counter() - t0)
        return run

    contenders = {"sentence-transformers fp32": lambda xs: st.encode(xs, batch_size=len(xs)),
                  "inferd": lambda xs: llm.embed(xs)}
    if loop is not None:
        contenders["inferd loop"] = lambda xs: loop.embed(xs)
    for fn in contenders.values():  # warm-up: first-call allocations, thread pools
        fn(corpus[:8])
    results = {}
    for b in batches:
        runners = {(name, b): rate(fn, b) for name, fn in contenders.items()}
        results.update(interleaved(runners, args.rounds))
    dtype = str(llm.engine.model.dtype).replace("torch.", "")
    paths = {"sentence-transformers fp32": hf_paths(st[0].auto_model), "inferd": pooling_paths(llm.engine)}
    labels = {}
    if loop is not None:
        paths["inferd loop"] = pooling_paths(loop.engine)
    setup = {"model": f"all-MiniLM-L6-v2 ({folder})", "threads": torch.get_num_threads(),
             "texts a round": f"{len(corpus)} per batch size, {min(lengths)}-{max(lengths)} tokens "
                              f"(median {statistics.median(lengths):.0f}, total {sum(lengths)})",
             "batches": batches, "rounds": f"{args.rounds}, interleaved; medians (min-max)",
             "inferd": f"LLM.embed, --dtype auto ({dtype}), token budget {llm.engine.budget}, "
                       f"max_num_seqs {llm.engine.config.max_num_seqs}",
             "sentence-transformers": f"encode(batch, batch_size=len(batch)), fp32, torch threads "
                                      f"{torch.get_num_threads()}"}
    report_header("Embeddings/s: inferd's pooling runner vs sentence-transformers (same files, threads, texts)",
                  setup, paths)
    check_rows(paths, labels)
    rows = []
    print(f"\n{'batch':>5}  {'contender':<28} {'embeddings/s':>26}  {'vs sentence-transformers':>24}")
    for b in batches:
        base = statistics.median(results[("sentence-transformers fp32", b)])
        for name in contenders:
            runs = results[(name, b)]
            ratio = statistics.median(runs) / base
            print(f"{b:>5}  {name:<28} {fmt_spread(runs):>26}  {ratio:>23.2f}x")
            rows.append({"label": name, "batch": b, "metric": "embeddings/s", **spread(runs), "ratio": ratio})
    c = llm.engine.counters()
    print(f"\ninferd padding-free: {c['tokens']} tokens computed for {c['real_tokens']} real ones "
          f"({c['padded_tokens']} padded), {c['sequences']} sequences in {c['forwards']} forwards "
          f"(largest {c['max_batch_seqs']}); attention buckets padded {c['attention_padded_rows']} rows")
    write_json(args.json, setup, rows, paths, counters=c)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""inferd's engine vs Hugging Face transformers `generate`, on the same requests, in one process run.

Like for like: one batch cap (--batch-cap) for all three batched contenders, and the same weights
(both load the default GGUF's Q4_1 blocks dequantized to bf16: every linear and the embedding are
compared bit for bit before anything is timed, and the run stops if one differs).
  1. inferd continuous batching (max_num_seqs = the cap) vs HF static padded batches of the cap
     (bf16, sdpa, left padding), counting only each request's own output tokens; plus inferd's
     share of the bf16 FLOP ceiling measured in this run;
  2. inferd continuous vs inferd --scheduling static at the same cap;
  3. inferd batch-1 decode vs HF batch-1 decode.
Every row is the median of --rounds interleaved rounds (each contender once a round), printed with
the min-max; the header gives the setup and the paths each inferd engine ran, and --json F writes
{"cpu", "setup", "rows", "paths"}.

--tiny runs the same command in seconds (the suite's smoke test, tests/test_benchmarks.py): 4
requests of 8-24 in / 4-12 out tokens, a batch cap of 2, 8 batch-1 tokens, 1 round.

Usage: .venv/bin/python benchmarks/engine_vs_hf.py [--model F.gguf] [--num-prompts 64] [--batch-cap 32]
       [--threads 2] [--rounds 3] [--json F] [--tiny]
transformers is a benchmark/test dependency only; the product never imports it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (check_rows, fmt_spread, hf_decode_rate, hf_paths, interleaved, merge_paths,  # noqa: E402
                    report_header, spread, write_json)
from inferd.commands.throughput import random_requests  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.paths import engine_paths  # noqa: E402
from inferd.engine.rate import decode_rate  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.loading.loader import default_model_path, load_model  # noqa: E402


def bf16_gemm_rate(n: int = 2048, reps: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def run_inferd(loaded, reqs, **opts) -> tuple[float, float, LLMEngine]:
    eng = LLMEngine(loaded=loaded, **opts)
    t0 = time.monotonic()
    for p, n in reqs:
        eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), arrival=t0)
    while eng.has_unfinished():
        eng.step()
    dt = time.monotonic() - t0
    return sum(n for _, n in reqs) / dt, dt, eng


def run_hf_static(hf, reqs, batch: int, pad_id: int) -> tuple[float, float]:
    t0 = time.monotonic()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        L = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, L - len(p):] = torch.tensor(p)
            mask[j, L - len(p):] = 1
        n = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=pad_id)
    dt = time.monotonic() - t0
    return sum(n for _, n in reqs) / dt, dt


def load_hf(path: str, dtype: torch.dtype):
    import transformers  # benchmark/test dependency only

    # transformers 5 can keep a GGUF's blocks packed: ask for the dense model explicitly
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype, attn_implementation="sdpa",
        quantization_config=transformers.GgufConfig(dequantize=True))
    return hf.eval()


def same_weights(model, hf) -> str:
    """Compare every linear and the embedding of inferd's model with transformers' (inferd holds q/k/v
    and gate/up fused); raise SystemExit at the first difference: a ratio between different weights
    is no like-for-like row."""
    emb = model.embed_tokens  # a GGUF's table is read in place: its rows, looked up, are the weights
    table = emb.weight if hasattr(emb, "weight") else emb(torch.arange(emb.num_embeddings))
    pairs = [("embed_tokens", table, hf.model.embed_tokens.weight)]
    for i, (ours, theirs) in enumerate(zip(model.layers, hf.model.layers)):
        at, mlp = theirs.self_attn, theirs.mlp
        pairs += [(f"layers.{i}.qkv_proj", ours.qkv_proj.weight,
                   torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
                  (f"layers.{i}.o_proj", ours.o_proj.weight, at.o_proj.weight),
                  (f"layers.{i}.gate_up_proj", ours.gate_up_proj.weight,
                   torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                  (f"layers.{i}.down_proj", ours.down_proj.weight, mlp.down_proj.weight)]
    pairs.append(("lm_head", model.lm_head.weight, hf.lm_head.weight))
    for name, a, b in pairs:
        if a.dtype != b.dtype or not torch.equal(a, b):
            raise SystemExit(f"not like for like: {name} differs between inferd ({a.dtype}) and transformers "
                             f"({b.dtype})")
    return (f"identical: {len(pairs)} tensors (every linear and the embedding) compared bit for bit, "
            f"{str(table.dtype)[6:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded default)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-cap", type=int, default=32,
                    help="the one batch cap: inferd's max_num_seqs (continuous and static) and HF's batch size")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; every row is their median")
    ap.add_argument("--decode-tokens", type=int, default=128, help="batch-1 decode rows: tokens a round")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true",
                    help="a seconds-long smoke run of the same command (the tests): 4 requests of 8-24 in / 4-12 "
                         "out tokens, batch cap 2, 8 batch-1 tokens, 1 round")
    a = ap.parse_args()
    lengths, kv_memory, gemm_n = ((64, 256), (32, 256)), "1GiB", 2048
    if a.tiny:
        a.num_prompts, a.batch_cap, a.rounds, a.decode_tokens = 4, 2, 1, 8
        lengths, kv_memory, gemm_n = ((8, 24), (4, 12)), "64MiB", 256
    torch.set_num_threads(a.threads)
    path = a.model or default_model_path()
    # the dequantized model on both sides, named: the bit-for-bit check below compares dense weights
    loaded = load_model(path, dtype="bfloat16", quantization="none")
    cfg = loaded.config
    special = {i for i in range(cfg.vocab_size) if loaded.tokenizer.is_special(i)}
    reqs = random_requests(a.num_prompts, *lengths, cfg.vocab_size, seed=0, avoid=special)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    kv = dict(kv_cache_memory=kv_memory, kv_cache_dtype=a.kv_cache_dtype)
    cap = a.batch_cap
    hf = None if a.skip_hf else load_hf(path, torch.bfloat16)
    weights = same_weights(loaded.model, hf) if hf is not None else "inferd only (--skip-hf)"

    cont, stat = f"inferd continuous, max_num_seqs={cap}", f"inferd static, max_num_seqs={cap}"
    hf_row = f"HF generate, static padded batches of {cap}"
    b1, hf_b1 = "inferd batch-1 decode", "HF batch-1 decode"
    paths: dict = {}
    largest = {"seqs": 0, "preemptions": 0}

    def inferd_batched(label: str, **opts) -> float:
        tps, _, eng = run_inferd(loaded, reqs, max_num_seqs=cap, **kv, **opts)
        paths[label] = merge_paths(paths.get(label), engine_paths(eng))
        if label == cont:
            largest.update(seqs=eng.stats.max_batch_seqs, preemptions=largest["preemptions"] + eng.stats.preemptions)
        return tps

    def inferd_b1() -> float:
        got: dict = {}
        v = decode_rate(loaded, prompt, a.decode_tokens, warmup=True, paths=got)
        paths[b1] = merge_paths(paths.get(b1), got)
        return v

    prompt = reqs[0][0][:93]
    runners = {cont: lambda: inferd_batched(cont)}
    if hf is not None:
        runners[hf_row] = lambda: run_hf_static(hf, reqs, cap, pad_id=2)[0]
        paths[hf_row] = paths[hf_b1] = hf_paths(hf)
    runners[stat] = lambda: inferd_batched(stat, scheduling="static")
    runners[b1] = inferd_b1
    if hf is not None:
        runners[hf_b1] = lambda: hf_decode_rate(hf, prompt, a.decode_tokens)
    peak = bf16_gemm_rate(gemm_n)
    runs = interleaved(runners, a.rounds)
    check_rows(paths)
    med = {k: statistics.median(v) for k, v in runs.items()}
    flops = 2 * n_params * (sum(len(p) for p, _ in reqs) + sum(n for _, n in reqs))
    cont_dt = sum(n for _, n in reqs) / med[cont]

    (i0, i1), (o0, o1) = lengths
    setup = {"model": os.path.basename(path), "weights": weights, "dtype": "bfloat16",
             "threads": a.threads, "requests": f"{a.num_prompts}, all at t=0 (inputs {i0}-{i1}, outputs {o0}-{o1} "
             "tokens, ignore_eos, greedy; seed 0)",
             "batch cap": f"{cap} for every batched row (inferd max_num_seqs, continuous and static; HF batch size)",
             "batch-1 rows": f"a {len(prompt)}-token prompt, {a.decode_tokens} tokens, prefill excluded",
             "KV cache": f"{a.kv_cache_dtype} (inferd), {kv_memory}", "HF attention": "sdpa, left padding",
             "rounds": f"{a.rounds}, interleaved (every row once a round, in table order); each row is the "
                       "median, with the min-max over the rounds"}
    report_header("inferd engine vs Hugging Face transformers generate", setup, paths)
    print(f"bf16 GEMM ceiling measured here: {peak / 1e9:.0f} GFLOP/s; inferd continuous achieved "
          f"{flops / cont_dt / 1e9:.0f} GFLOP/s = {100 * flops / cont_dt / peak:.1f}% of it "
          f"(2 x {n_params / 1e6:.0f}M params x prompt+output tokens, at its median)")
    ratios = {hf_row: (cont, hf_row), stat: (cont, stat), hf_b1: (b1, hf_b1)}
    print(f"{'run':<48} {'out tok/s (min-max)':>24}  {'ratio':>7}")
    for name in runners:
        num, den = ratios.get(name, (None, None))
        ratio = f"{med[num] / med[den]:.2f}x" if num else ""
        print(f"{name:<48} {fmt_spread(runs[name]):>24}  {ratio:>7}")
    print(f"(ratio = {cont} over the row, or inferd batch-1 over HF batch-1; largest inferd continuous batch: "
          f"{largest['seqs']} sequences, {largest['preemptions']} preemptions over the rounds)")
    rows = [{"label": k, "metric": "output tok/s", **spread(v)} for k, v in runs.items()]
    for name, (num, den) in ratios.items():
        if name in med:
            rows.append({"label": f"{num} / {den}", "metric": "ratio of medians", "median": med[num] / med[den]})
    write_json(a.json, setup, rows, paths, bf16_gemm_gflops=peak / 1e9)


if __name__ == "__main__":
    main()

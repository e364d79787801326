"""inferd's engine vs Hugging Face transformers `generate`, on the same requests, in one process run.

Prints one table:
  1. inferd continuous batching vs HF static padded batches of 32 (bf16, sdpa, left padding),
     counting only each request's own output tokens; plus inferd's share of the bf16 FLOP ceiling
     measured in this run;
  2. inferd continuous vs inferd --scheduling static at equal max_num_seqs;
  3. inferd batch-1 decode vs HF batch-1 decode.

Usage: .venv/bin/python benchmarks/engine_vs_hf.py [--num-prompts 64] [--threads 2]
transformers is a benchmark/test dependency only; the product never imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import cpu_features, hf_decode_rate  # noqa: E402
from inferd.engine.engine import LLMEngine  # noqa: E402
from inferd.engine.rate import decode_rate  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.loading.loader import default_model_path, load_model  # noqa: E402
from inferd.commands.throughput import random_requests  # noqa: E402


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


def inferd_decode_rate(loaded, prompt, n) -> float:
    return decode_rate(loaded, prompt, n, warmup=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="inferd's batch cap vs HF")
    ap.add_argument("--static-max-num-seqs", type=int, default=8,
                    help="the batch cap both inferd schedulers share in the continuous-vs-static row")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3, help="batch-1 decode: alternating rounds, median")
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_model(None, dtype="bfloat16")
    cfg = loaded.config
    special = {i for i in range(cfg.vocab_size) if loaded.tokenizer.is_special(i)}
    reqs = random_requests(a.num_prompts, (64, 256), (32, 256), cfg.vocab_size, seed=0, avoid=special)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    kv = dict(kv_cache_memory="1GiB", kv_cache_dtype=a.kv_cache_dtype)

    peak = bf16_gemm_rate()
    cont_tps, cont_dt, eng = run_inferd(loaded, reqs, max_num_seqs=a.max_num_seqs, **kv)
    flops = 2 * n_params * (sum(len(p) for p, _ in reqs) + sum(n for _, n in reqs))
    c16_tps, _, _ = run_inferd(loaded, reqs, max_num_seqs=a.static_max_num_seqs, **kv)
    s16_tps, _, _ = run_inferd(loaded, reqs, max_num_seqs=a.static_max_num_seqs, scheduling="static", **kv)
    prompt = reqs[0][0][:93]
    hf = None
    if not a.skip_hf:
        import transformers

        path = default_model_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.bfloat16,
            attn_implementation="sdpa")
        hf.eval()
    b1, hf_b1 = [], []
    for _ in range(a.rounds):  # alternate, so both see the same machine weather
        b1.append(inferd_decode_rate(loaded, prompt, 128))
        if hf is not None:
            hf_b1.append(hf_decode_rate(hf, prompt, 128))
    med = lambda xs: sorted(xs)[len(xs) // 2]

    print(f"\n{cpu_features()}; {a.threads} threads")
    print(f"{a.num_prompts} requests, inputs 64-256, outputs 32-256 (ignore_eos), bf16, {a.threads} threads, "
          f"KV cache {a.kv_cache_dtype}")
    print(f"bf16 GEMM ceiling measured here: {peak / 1e9:.0f} GFLOP/s; inferd continuous achieved "
          f"{flops / cont_dt / 1e9:.0f} GFLOP/s = {100 * flops / cont_dt / peak:.1f}% of it "
          f"(2 x {n_params / 1e6:.0f}M params x prompt+output tokens)")
    rows = [(f"inferd continuous, max_num_seqs={a.max_num_seqs}", cont_tps, "")]
    if hf is not None:
        hf_tps, _ = run_hf_static(hf, reqs, a.hf_batch, pad_id=2)
        rows.append((f"HF generate, static padded batches of {a.hf_batch}", hf_tps, f"{cont_tps / hf_tps:.2f}x"))
    rows.append((f"inferd continuous, max_num_seqs={a.static_max_num_seqs}", c16_tps, ""))
    rows.append((f"inferd static, max_num_seqs={a.static_max_num_seqs}", s16_tps, f"{c16_tps / s16_tps:.2f}x"))
    rows.append(("inferd batch-1 decode", med(b1), ""))
    if hf is not None:
        rows.append(("HF batch-1 decode", med(hf_b1), f"{med(b1) / med(hf_b1):.2f}x"))
    print(f"{'run':<48} {'out tok/s':>9}  {'ratio':>7}")
    for name, tps, ratio in rows:
        print(f"{name:<48} {tps:>9.1f}  {ratio:>7}")
    print(f"(ratio = the inferd row above / this row; largest inferd batch: {eng.stats.max_batch_seqs} "
          f"sequences, {eng.stats.preemptions} preemptions; batch-1 rounds inferd "
          f"{[round(x, 1) for x in b1]}, HF {[round(x, 1) for x in hf_b1]})")


if __name__ == "__main__":
    main()

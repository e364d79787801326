"""Batch-1 greedy decode rate of llama.cpp (llama-cpp-python, in-process) on a GGUF.

The number inferd's own batch-1 decode is compared against: same GGUF, same prompt ids, same
thread count, prefill excluded (generated tokens after the first, over the time they took; the
first token comes out of the prefill's logits).

Usage: .venv/bin/python benchmarks/llamacpp_decode.py [--gguf PATH] [--prompt-len 64] [--n-out 128]
Builds llama.cpp and installs the bindings on first use (see benchmarks/llamacpp.py).
OpenMP: llama.cpp runs with OMP_WAIT_POLICY=passive on an oversubscribed machine and active on a
quiet one (see llamacpp.omp_env), set by importing this module, which only takes effect if no
libgomp is loaded yet (torch loads one); when importing it from a script that has already imported
torch, export OMP_WAIT_POLICY in the shell.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from common import cpu_features  # noqa: E402
from llamacpp import build_info, ensure_llama_cpp_python, omp_env, row_name  # noqa: E402

# torch ships a libgomp.so.1 too, and whichever process loads one first fixes the OpenMP wait
# policy for both: it has to be in the environment before torch (inferd) is imported. A script
# importing this module after torch gets the policy only from its own environment.
# Only when run as the script: a process that imports this module (the suite checks each
# benchmark's arguments) would otherwise keep the policy, and every server it starts later would
# spin an idle core at OpenMP's barriers for as long as it lives.
if __name__ == "__main__":
    for _k, _v in omp_env().items():
        os.environ.setdefault(_k, _v)


def load_llama(gguf_path: str, threads: int = 2, n_ctx: int = 1024, flash_attn: bool = True):
    lc = ensure_llama_cpp_python()
    return lc.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                    n_threads_batch=threads, flash_attn=flash_attn, verbose=False)


def _decode_once(llm, prompt_ids: Sequence[int], n_out: int) -> float:
    import numpy as np
    import llama_cpp as lc

    ctx = llm.ctx
    n_vocab = llm.n_vocab()
    # A clean KV per round: without it the next round's prompt would attend to the previous one.
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)

    def decode(ids: Sequence[int]) -> int:
        arr = (lc.llama_token * len(ids))(*ids)
        if lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    # Greedy argmax on the raw logits, no EOS check: every round produces exactly n_out tokens,
    # the same contract as inferd's ignore_eos decode.
    tok = decode(list(prompt_ids))
    t_first = time.perf_counter()
    for _ in range(n_out - 1):
        tok = decode([tok])
    return (n_out - 1) / (time.perf_counter() - t_first)


def llamacpp_decode_rate(gguf_path: str, prompt_ids: Sequence[int], n_out: int, threads: int = 2,
                         rounds: int = 3, flash_attn: bool = True, llm=None) -> float:
    """Median over `rounds` (after one warm-up round) of generated tokens/s after the first."""
    if n_out < 2:
        raise ValueError("n_out must be at least 2: the first token is prefill, not decode")
    if llm is None:
        llm = load_llama(gguf_path, threads=threads, n_ctx=max(256, len(prompt_ids) + n_out + 8),
                         flash_attn=flash_attn)
    _decode_once(llm, prompt_ids, min(n_out, 8))
    return statistics.median(_decode_once(llm, prompt_ids, n_out) for _ in range(rounds))


def default_prompt(gguf_path: str, prompt_len: int, seed: int = 0) -> list[int]:
    """Random non-special token ids, drawn the way inferd's own throughput benchmarks draw them."""
    from inferd.bench.tokenizer import load_local
    from inferd.commands.throughput import random_requests

    tok = load_local(gguf_path)
    special = {i for i in range(tok.vocab_size) if tok.is_special(i)}
    return random_requests(1, (prompt_len, prompt_len), (1, 1), tok.vocab_size, seed=seed, avoid=special)[0][0]


def main() -> None:
    from inferd.loading.loader import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="default: inferd's default model")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n-out", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-flash-attn", action="store_true",
                    help="llama.cpp's flash attention is on by default here (llama-server's `auto` picks it on CPU)")
    a = ap.parse_args()
    gguf = a.gguf or default_model_path()
    prompt = default_prompt(gguf, a.prompt_len)
    rate = llamacpp_decode_rate(gguf, prompt, a.n_out, threads=a.threads, rounds=a.rounds,
                                flash_attn=not a.no_flash_attn)
    info = build_info()
    print(cpu_features())
    print(info["isa"])
    print(f"{row_name(info)} batch-1 decode, median of {a.rounds}; decode: {rate:.1f} tok/s ({os.path.basename(gguf)}, {a.prompt_len}-token prompt, "
          f"{a.n_out} greedy tokens, prefill excluded, {a.threads} threads)")


if __name__ == "__main__":
    main()

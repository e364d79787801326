"""Small synthetic traces in the public traces' formats, shipped so that `--dataset mooncake-trace`
and `--dataset azure-trace` run without a --dataset-path (and tests have a fixed input).

    mooncake_synthetic.jsonl  Mooncake's JSONL: timestamp (ms), input_length, output_length, hash_ids
                              (blocks of 512 tokens). 60 requests over ~60 s: chat turns behind one
                              of two shared 1-block system prompts, long-context requests behind one
                              of three shared documents (3, 5 or 7 blocks), and a few short
                              unshared ones, so that replaying it exercises prefix caching and mixes
                              prefill-heavy with decode-heavy requests.
    azure_synthetic.csv       Azure's LLM inference trace CSV (TIMESTAMP with 7 fractional digits,
                              ContextTokens, GeneratedTokens): 60 requests over ~60 s, conversation-
                              like and long-context ("code"-like) inputs.

Not real traffic: made up by `python -m inferd.bench.traces`, which rewrites both files, the same
bytes every time (the tests check that the shipped files are what it writes).
"""
from __future__ import annotations

import json
import random
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
MOONCAKE_FILE, AZURE_FILE = "mooncake_synthetic.jsonl", "azure_synthetic.csv"
ROWS, SPAN_S, BLOCK = 60, 59.5, 512
AZURE_START = datetime(2023, 11, 16, 18, 15, 46)
AZURE_START_TICKS = 6_805_900  # 100 ns ticks past AZURE_START: the sample timestamp's .6805900


def _arrivals_s(rng: random.Random, n: int) -> list[float]:
    """Poisson-like arrivals, stretched so that the last one lands at SPAN_S."""
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.expovariate(1.0)
        out.append(t)
    return [x * SPAN_S / out[-1] for x in out]


def mooncake_rows(seed: int = 0) -> list[dict]:
    rng = random.Random(f"mooncake-synthetic:{seed}")
    next_id = [0]

    def fresh(k: int) -> list[int]:
        ids = list(range(next_id[0], next_id[0] + k))
        next_id[0] += k
        return ids

    systems = [fresh(1) for _ in range(2)]
    docs = [fresh(k) for k in (3, 5, 7)]
    rows = []
    for t in _arrivals_s(rng, ROWS):
        u = rng.random()
        if u < 0.6:  # chat: a shared system prompt, then the turn's own text; decode-heavy
            prefix, n_in, n_out = rng.choice(systems), BLOCK + rng.randint(32, 700), rng.randint(64, 320)
        elif u < 0.9:  # long context: a shared document, then a question; prefill-heavy
            prefix = rng.choice(docs)
            n_in, n_out = len(prefix) * BLOCK + rng.randint(16, 400), rng.randint(8, 64)
        else:  # short and unshared
            prefix, n_in, n_out = [], rng.randint(20, 400), rng.randint(16, 128)
        need = -(-n_in // BLOCK)
        rows.append({"timestamp": int(round(t * 1000)), "input_length": n_in, "output_length": n_out,
                     "hash_ids": prefix + fresh(need - len(prefix))})
    return rows


def azure_rows(seed: int = 0) -> list[tuple[str, int, int]]:
    rng = random.Random(f"azure-synthetic:{seed}")
    rows = []
    for t in _arrivals_s(rng, ROWS):
        ticks = AZURE_START_TICKS + int(round(t * 1e7))
        stamp = (AZURE_START + timedelta(seconds=ticks // 10 ** 7)).strftime("%Y-%m-%d %H:%M:%S")
        if rng.random() < 0.7:  # conversation-like
            ctx, gen = int(rng.lognormvariate(6.3, 0.6)) + 16, rng.randint(20, 400)
        else:  # long context, short answer
            ctx, gen = rng.randint(1500, 4000), rng.randint(4, 40)
        rows.append((f"{stamp}.{ticks % 10 ** 7:07d}", min(ctx, 4000), gen))
    return rows


def mooncake_text(seed: int = 0) -> str:
    return "".join(json.dumps(r) + "\n" for r in mooncake_rows(seed))


def azure_text(seed: int = 0) -> str:
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{a},{b},{c}\n" for a, b, c in azure_rows(seed))


def write(directory: Path = HERE) -> list[Path]:
    out = []
    for name, text in ((MOONCAKE_FILE, mooncake_text()), (AZURE_FILE, azure_text())):
        p = Path(directory) / name
        p.write_text(text, encoding="utf-8", newline="\n")
        out.append(p)
    return out

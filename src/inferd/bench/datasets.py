"""Benchmark prompts: random tokens, WikiText-2 slices, JSONL prompts, ShareGPT conversations, and
two workloads with shared prefixes for prefix caching and prefix routing to find:
`prefix-families` (K shared system prompts of --input-len tokens, each request one of them plus its
own --question-len question, in random order) and `multi-turn` (K conversations; each turn's prompt
is the previous turn's prompt + an answer of --output-len tokens + a new question, turns sent in
order, conversations interleaved; the answers are fixed random text, as the load is open-loop).

Lengths (`--input-len`, `--output-len`): `N`, `MIN-MAX` (uniform integers), or `normal:MEAN,STD`
(rounded, at least 1). Random and WikiText prompts hit their input length exactly under the
tokenizer (text -> tokens -> text can merge or split tokens, so the text is re-tokenized and
trimmed or extended until it round-trips to the target count).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from inferd.errors import InferdError

WIKITEXT_REL = os.path.join("shared", "data", "wikitext-2", "test.txt")


@dataclass
class BenchPrompt:
    prompt: str
    prompt_len: int | None  # tokens under the bench's tokenizer (None: no tokenizer)
    output_len: int | None  # max_tokens to ask for (None: let the server decide)


def parse_length(spec: str, what: str) -> Callable[[random.Random], int]:
    s = str(spec).strip()
    try:
        if s.startswith("normal:"):
            mean_s, std_s = s[7:].split(",")
            m, sd = float(mean_s), float(std_s)
            if m < 1 or sd < 0:
                raise ValueError
            return lambda rng: max(1, int(round(rng.gauss(m, sd))))
        if "-" in s:
            a, b = (int(x) for x in s.split("-", 1))
            if not 1 <= a <= b:
                raise ValueError
            return lambda rng: rng.randint(a, b)
        n = int(s)
        if n < 1:
            raise ValueError
        return lambda rng: n
    except ValueError:
        raise InferdError(f"bad {what} {spec!r}: expected N, MIN-MAX or normal:MEAN,STD (all >= 1)") from None


def default_wikitext_path() -> str | None:
    here = Path(__file__).resolve()
    cands = [Path.cwd().parent / WIKITEXT_REL, Path.cwd() / WIKITEXT_REL]
    cands += [p.parent / WIKITEXT_REL for p in here.parents]  # the project root's sibling `shared/`
    for c in cands:
        if c.is_file():
            return str(c)
    return None


class _Exact:
    """Texts of exactly N tokens under a tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.n_special = len(tok.encode("a")) - len(tok.encode("a", add_special_tokens=False))
        self._vocab: list[int] | None = None

    def vocab(self) -> list[int]:
        """Ids of ordinary tokens that decode to clean, printable text on their own."""
        if self._vocab is None:
            tok = self.tok
            if getattr(tok, "is_server", False):
                path = default_wikitext_path()
                sample = open(path, encoding="utf-8").read(200_000) if path else _FALLBACK_TEXT
                ids = sorted(set(tok.encode(sample, add_special_tokens=False)))
            else:
                ids = []
                for i in range(tok.vocab_size):
                    if tok.is_special(i):
                        continue
                    s = tok.decode([i])
                    if s and "\ufffd" not in s and s.isprintable():
                        ids.append(i)
            if len(ids) < 100:
                raise InferdError("the tokenizer offers too few ordinary tokens to build random prompts")
            self._vocab = ids
        return self._vocab

    def fit(self, ids: list[int], target: int, more: Callable[[int], list[int]]) -> tuple[str, int]:
        """Adjust `ids` until decode -> encode gives `target` tokens in all (specials included)."""
        body = max(target - self.n_special, 0)
        ids = list(ids[:body])
        best = None
        for _ in range(32):
            if len(ids) < body:
                ids += more(body - len(ids))
            text = self.tok.decode(ids)
            got = self.tok.encode(text, add_special_tokens=False)
            if len(got) == body:
                return text, target
            if best is None or abs(len(got) - body) < abs(best[1] - body):
                best = (text, len(got))
            ids = got[:body]
        return best[0], best[1] + self.n_special


def _prefix_prompts(dataset: str, num: int, ex: "_Exact", rng: random.Random, in_spec, out_spec, q_spec,
                    families: int) -> list[BenchPrompt]:
    vocab = ex.vocab()

    def text(n: int) -> str:
        def more(k):
            return [rng.choice(vocab) for _ in range(k)]

        return ex.fit(more(n), n, more)[0]

    def bench_prompt(t: str, olen: int) -> BenchPrompt:
        return BenchPrompt(t, len(ex.tok.encode(t)), olen)

    systems = [text(in_spec(rng)) for _ in range(families)]
    if dataset == "prefix-families":
        order = [i % families for i in range(num)]
        rng.shuffle(order)
        return [bench_prompt(systems[f] + "\n" + text(q_spec(rng)), out_spec(rng)) for f in order]
    contexts = list(systems)  # multi-turn: the conversation so far, per conversation
    out = []
    for i in range(num):
        c = i % families
        olen = out_spec(rng)
        prompt = contexts[c] + "\nUser: " + text(q_spec(rng)) + "\nAssistant:"
        out.append(bench_prompt(prompt, olen))
        contexts[c] = prompt + " " + text(olen)
    return out


def build_prompts(dataset: str, num: int, tokenizer, input_len: str, output_len: str | None, seed: int,
                  path: str | None = None, families: int = 8,
                  question_len: str = "32") -> tuple[list[BenchPrompt], list[str]]:
    """(prompts, warnings)."""
    rng = random.Random(f"dataset:{seed}")
    out_spec = parse_length(output_len, "--output-len") if output_len is not None else None
    warnings: list[str] = []
    if dataset in ("prefix-families", "multi-turn"):
        if tokenizer is None:
            raise InferdError(f"--dataset {dataset} needs a tokenizer: pass --tokenizer PATH|server")
        if families < 1:
            raise InferdError("--prefix-families must be >= 1")
        return _prefix_prompts(dataset, num, _Exact(tokenizer), rng, parse_length(input_len, "--input-len"),
                               out_spec or parse_length("128", "--output-len"),
                               parse_length(question_len, "--question-len"), families), warnings
    if dataset in ("random", "wikitext"):
        if tokenizer is None:
            raise InferdError(f"--dataset {dataset} needs a tokenizer: pass --tokenizer PATH|server "
                              f"(the default model's is not installed)")
        in_spec = parse_length(input_len, "--input-len")
        out_spec = out_spec or parse_length("128", "--output-len")
        ex = _Exact(tokenizer)
        prompts = []
        if dataset == "random":
            vocab = ex.vocab()
            for _ in range(num):
                n = in_spec(rng)

                def more(k):
                    return [rng.choice(vocab) for _ in range(k)]

                text, got = ex.fit(more(n), n, more)
                prompts.append(BenchPrompt(text, got, out_spec(rng)))
        else:
            p = path or default_wikitext_path()
            if p is None:
                raise InferdError("WikiText-2 not found at ../shared/data/wikitext-2/test.txt: pass --dataset-path")
            corpus = _read(p)
            corpus = " ".join(corpus.split())
            if len(corpus) < 1000:
                raise InferdError(f"{p} is too short for wikitext slices")
            for _ in range(num):
                n = in_spec(rng)
                start = corpus.find(" ", rng.randrange(0, max(1, len(corpus) - 8 * n - 64))) + 1
                stop = start + 6 * n + 64
                ids = tokenizer.encode(corpus[start:stop], add_special_tokens=False)
                pos = [stop]

                def more(k, pos=pos):
                    got = []
                    while len(got) < k:
                        a = pos[0] if pos[0] < len(corpus) else 0
                        chunk = corpus[a: a + 6 * k + 64]
                        pos[0] = a + len(chunk)
                        got += tokenizer.encode(" " + chunk, add_special_tokens=False)
                    return got[:k]

                text, got = ex.fit(ids, n, more)
                prompts.append(BenchPrompt(text, got, out_spec(rng)))
        return prompts, warnings

    if dataset == "jsonl":
        items = _jsonl_items(path)
    elif dataset == "sharegpt":
        items = _sharegpt_items(path, tokenizer)
    else:
        raise InferdError(f"unknown --dataset {dataset!r} (random, wikitext, jsonl, sharegpt, prefix-families, "
                          f"multi-turn)")
    if not items:
        raise InferdError(f"no usable prompts in {path}")
    rng.shuffle(items)
    if len(items) < num:
        warnings.append(f"{path} has {len(items)} prompts; cycling through them for {num} requests")
    prompts = []
    for i in range(num):
        text, olen = items[i % len(items)]
        plen = len(tokenizer.encode(text)) if tokenizer is not None else None
        prompts.append(BenchPrompt(text, plen, out_spec(rng) if out_spec else olen))
    return prompts, warnings


def _read(path: str | None) -> str:
    if not path:
        raise InferdError("this dataset needs --dataset-path")
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise InferdError(f"dataset file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InferdError(f"cannot read dataset {path}: {e}") from None


def _jsonl_items(path) -> list[tuple[str, int | None]]:
    """One {"prompt": str, "output_len"|"max_tokens": N (optional)} per line."""
    items = []
    for ln, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt = d["prompt"] if isinstance(d, dict) else None
            if not isinstance(prompt, str):
                raise KeyError
        except (ValueError, KeyError):
            raise InferdError(f"{path}:{ln}: expected a JSON object with a string \"prompt\"") from None
        olen = d.get("output_len", d.get("max_tokens"))
        items.append((prompt, int(olen) if olen is not None else None))
    return items


def _sharegpt_items(path, tokenizer) -> list[tuple[str, int | None]]:
    """ShareGPT JSON (a list, or JSONL) of {"conversations": [{"from": "human"|"gpt", "value": ...}]}:
    the first human turn is the prompt; the reply's token count is the output length."""
    raw = _read(path)
    try:
        data = json.loads(raw)
    except ValueError:
        try:
            data = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except ValueError:
            raise InferdError(f"{path}: not ShareGPT JSON or JSONL") from None
    if isinstance(data, dict):
        data = [data]
    items = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not all(isinstance(t, dict) for t in (first, second)):
            continue
        q, a = first.get("value") or first.get("content"), second.get("value") or second.get("content")
        if not isinstance(q, str) or not isinstance(a, str) or not q.strip():
            continue
        olen = len(tokenizer.encode(a, add_special_tokens=False)) if tokenizer is not None else None
        if olen is not None and olen < 1:
            continue
        items.append((q, olen))
    return items


_FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. A benchmark needs prompts, and prompts need words: "
    "rivers, mountains, history, science, music, cities, numbers such as 12, 345 and 6789, questions "
    "about weather and travel, recipes with flour, butter and sugar, and stories of ships and stars. "
) * 4

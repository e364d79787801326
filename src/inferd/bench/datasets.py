"""Benchmark prompts: random tokens, WikiText-2 slices, JSONL prompts, ShareGPT conversations, and
two workloads with shared prefixes for prefix caching and prefix routing to find:
`prefix-families` (K shared system prompts of --input-len tokens, each request one of them plus its
own --question-len question, in random order) and `multi-turn` (K conversations; each turn's prompt
is the previous turn's prompt + an answer of --output-len tokens + a new question, turns sent in
order, conversations interleaved; the answers are fixed random text, as the load is open-loop).

Workloads for disaggregated prefill/decode, where what matters is how prefill-heavy and
decode-heavy requests interfere:
`mixed` (request classes from --mix NAME:FRACTION:INPUT_LEN:OUTPUT_LEN,...; random-token prompts of
exact lengths; each class gets round(FRACTION * N) requests (largest remainder, so the counts add
up to N), in seeded random order; each prompt carries its class name, which the trace and the
per-class metrics keep), and trace replay: `mooncake-trace` (Mooncake's JSONL: `timestamp` ms,
`input_length`, `output_length`, `hash_ids`, one id per --trace-block-size block of tokens) and
`azure-trace` (Azure's LLM inference CSV: TIMESTAMP,ContextTokens,GeneratedTokens). Trace prompts
are sent at the trace's own arrival times (divided by --trace-speedup), not on a Poisson schedule,
and each trace block's tokens are a function of (seed, hash id) only, so that requests sharing hash
ids share a token prefix as they did in the trace (prefix-cache hits are real). Without
--dataset-path a small synthetic trace shipped in `inferd/bench/traces/` is replayed.

Chat workloads for speculative decoding (inferd.bench.workloads: `agent-loop`, `code-edit`,
`json-extraction`, `low-rep-chat`): multi-message conversations generated offline from shipped text
(--input-len does not apply; --output-len, default 160), sent as their messages to a chat endpoint
and as a plain transcript to a completions one.

Lengths (`--input-len`, `--output-len`, the --mix lengths): `N`, `MIN-MAX` (uniform integers), or
`normal:MEAN,STD` (rounded, at least 1). Random, mixed and WikiText prompts hit their input length
exactly under the tokenizer (text -> tokens -> text can merge or split tokens, so the text is
re-tokenized and trimmed or extended until it round-trips to the target count); trace prompts are
built from word tokens (a space and letters) that re-tokenize to themselves, so that they do too.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import random
import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Callable

from inferd.bench.workloads import WORKLOADS, conversations, render
from inferd.errors import InferdError

WIKITEXT_REL = os.path.join("shared", "data", "wikitext-2", "test.txt")
DEFAULT_MIX = "chat:0.8:128:128,rag:0.2:2048:16"
TRACE_DATASETS = ("mooncake-trace", "azure-trace")
TRACE_BLOCK_SIZE = 512  # Mooncake's: one hash id per 512 prompt tokens
TRACES_DIR = Path(__file__).resolve().parent / "traces"
SHIPPED_TRACES = {"mooncake-trace": "mooncake_synthetic.jsonl", "azure-trace": "azure_synthetic.csv"}
DATASETS = ("random", "wikitext", "jsonl", "sharegpt", "prefix-families", "multi-turn", "mixed", *TRACE_DATASETS,
            *WORKLOADS)


@dataclass
class BenchPrompt:
    prompt: str
    prompt_len: int | None  # tokens under the bench's tokenizer (None: no tokenizer)
    output_len: int | None  # max_tokens to ask for (None: let the server decide)
    klass: str | None = None  # the request class (`mixed`), kept in the trace for per-class metrics
    arrival_ns: int | None = None  # trace datasets: when the trace sends it (ns after its first row)
    messages: list | None = None  # chat workloads (inferd.bench.workloads): what a chat endpoint is sent


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
        self._words: list[int] | None = None

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

    def words(self) -> list[int]:
        """Ordinary tokens that decode to a space and letters and encode back to themselves. Under a
        byte-level BPE (GPT-2 style pre-tokenizer: a word keeps its leading space and is never merged
        with the one before it), any sequence of them round-trips id for id, so a block of them keeps
        its tokens whatever comes before or after it. Other tokenizers (few or no such tokens) fall
        back to vocab(), and the fitting trims or extends the end."""
        if self._words is None:
            tok, out = self.tok, []
            check = not getattr(tok, "is_server", False)  # a round-trip per token over HTTP: too slow
            for i in self.vocab():
                s = tok.decode([i])
                if len(s) >= 2 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
                    if not check or tok.encode(s, add_special_tokens=False) == [i]:
                        out.append(i)
                        if len(out) >= 8192:  # plenty for random text; keeps the scan short
                            break
            self._words = out if len(out) >= 100 else self.vocab()
        return self._words


# -- mixed: request classes -------------------------------------------------------------------------
@dataclass
class MixClass:
    name: str
    fraction: float
    input_len: Callable[[random.Random], int]
    output_len: Callable[[random.Random], int]


_MIX_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w.-]*\s*:)")  # a comma inside normal:M,S is followed by a digit
_MIX_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")


def parse_mix(spec: str) -> list[MixClass]:
    """'chat:0.8:128:128,rag:0.2:normal:2048,256:16' -> classes; the fractions must add up to 1."""
    usage = "expected NAME:FRACTION:INPUT_LEN:OUTPUT_LEN,... e.g. " + DEFAULT_MIX
    out: list[MixClass] = []
    for part in _MIX_SPLIT.split(str(spec or "").strip()):
        fields = [f.strip() for f in part.split(":")]
        if len(fields) < 4 or not _MIX_NAME.match(fields[0]):
            raise InferdError(f"bad --mix class {part.strip()!r}: {usage}")
        name, frac_s, rest = fields[0], fields[1], fields[2:]
        try:
            frac = float(frac_s)
        except ValueError:
            frac = float("nan")
        if not 0 < frac <= 1:
            raise InferdError(f"bad --mix class {part.strip()!r}: the fraction must be in (0, 1]")
        lens = []
        while rest and len(lens) < 2:  # a length is one field, or two for normal:MEAN,STD
            n = 2 if rest[0] == "normal" else 1
            lens.append(":".join(rest[:n]))
            rest = rest[n:]
        if len(lens) != 2 or rest:
            raise InferdError(f"bad --mix class {part.strip()!r}: {usage}")
        if any(c.name == name for c in out):
            raise InferdError(f"bad --mix {spec!r}: class {name!r} is given twice")
        out.append(MixClass(name, frac, parse_length(lens[0], f"--mix {name} input length"),
                            parse_length(lens[1], f"--mix {name} output length")))
    total = math.fsum(c.fraction for c in out)
    if abs(total - 1) > 1e-6:
        raise InferdError(f"bad --mix {spec!r}: the fractions add up to {total:g}, not 1")
    return out


def class_counts(fractions: list[float], n: int) -> list[int]:
    """round(f * n) per class, adding up to n: floors, then the largest remainders get one more
    (ties to the earlier class)."""
    raw = [f * n for f in fractions]
    counts = [int(math.floor(r + 1e-9)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[:max(0, n - sum(counts))]:
        counts[i] += 1
    return counts


def _mixed_prompts(num: int, ex: "_Exact", rng: random.Random, classes: list[MixClass],
                   warnings: list[str]) -> list[BenchPrompt]:
    counts = class_counts([c.fraction for c in classes], num)
    for c, k in zip(classes, counts):
        if k == 0:
            warnings.append(f"--mix class {c.name!r} gets no request out of {num} (fraction {c.fraction:g})")
    order = [c for c, k in zip(classes, counts) for _ in range(k)]
    rng.shuffle(order)  # exact counts, random order
    vocab = ex.vocab()

    def more(k):
        return [rng.choice(vocab) for _ in range(k)]

    out = []
    for c in order:
        n = c.input_len(rng)
        text, got = ex.fit(more(n), n, more)
        out.append(BenchPrompt(text, got, c.output_len(rng), klass=c.name))
    return out


# -- trace replay -----------------------------------------------------------------------------------
@dataclass
class TraceRow:
    t_ns: int  # arrival time on the trace's own clock (any origin; only differences count)
    input_len: int
    output_len: int
    hash_ids: list[int] | None  # Mooncake: one id per block of prompt tokens; None: no sharing
    line: int  # in the file, for messages


def default_trace_path(dataset: str) -> str:
    return str(TRACES_DIR / SHIPPED_TRACES[dataset])


def _int_field(v, what: str, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer() or v < least:
        raise ValueError(f"{what} must be an integer >= {least}, got {v!r}")
    return int(v)


def _check_order(rows: list[TraceRow], path: str) -> None:
    for a, b in zip(rows, rows[1:]):
        if b.t_ns < a.t_ns:
            raise InferdError(f"{path}:{b.line}: its timestamp is before the previous row's (line {a.line}): "
                              f"a trace must be in arrival order")


def read_mooncake(path: str, block_size: int = TRACE_BLOCK_SIZE) -> list[TraceRow]:
    """Mooncake's trace: one {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}
    per line. Each hash id stands for one block of `block_size` prompt tokens (the last one cut),
    so a row needs at least ceil(input_length / block_size) of them."""
    rows = []
    for ln, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            ts = d.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise ValueError(f"timestamp must be a number of ms >= 0, got {ts!r}")
            n_in = _int_field(d.get("input_length"), "input_length", 1)
            n_out = _int_field(d.get("output_length"), "output_length", 0)
            hashes = d.get("hash_ids")
            if hashes is not None:
                if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                           for h in hashes):
                    raise ValueError("hash_ids must be a list of integers")
                need = -(-n_in // block_size)
                if len(hashes) < need:
                    raise ValueError(f"{len(hashes)} hash_ids cannot cover input_length {n_in} in blocks of "
                                     f"{block_size} tokens (needs {need}; is --trace-block-size right?)")
        except ValueError as e:
            raise InferdError(f"{path}:{ln}: bad Mooncake trace row: {e}") from None
        rows.append(TraceRow(int(round(ts * 1e6)), n_in, n_out, hashes, ln))
    _check_order(rows, path)
    return rows


_TS = re.compile(r"^(\d{4})-(\d{1,2})-(\d{1,2})[T ](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


def parse_timestamp_ns(s: str) -> int:
    """'2023-11-16 18:15:46.6805900' (Azure's: 7 fractional digits, more than datetime keeps) -> ns
    on a day-count clock, exact in integers; a 'Z' or +HH:MM suffix is honoured, and a plain number
    is taken as seconds."""
    s = s.strip()
    m = _TS.match(s)
    if m is None:
        try:
            v = float(s)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v):
            raise ValueError(f"bad timestamp {s!r} (expected YYYY-MM-DD HH:MM:SS.fffffff or seconds)")
        return int(round(v * 1e9))
    y, mo, d, h, mi, sec = (int(m.group(i)) for i in range(1, 7))
    if h > 23 or mi > 59 or sec > 59:
        raise ValueError(f"bad timestamp {s!r}: no such time of day")
    days = date(y, mo, d).toordinal()  # ValueError on a day that does not exist
    frac = int(((m.group(7) or "") + "000000000")[:9])
    tz = m.group(8)
    off = 0
    if tz and tz != "Z":
        t = tz.replace(":", "")
        off = (int(t[1:3]) * 3600 + int(t[3:5]) * 60) * (1 if t[0] == "+" else -1)
    return ((days * 86400 + h * 3600 + mi * 60 + sec) - off) * 1_000_000_000 + frac


def read_azure(path: str) -> list[TraceRow]:
    """Azure's LLM inference trace: CSV with the header TIMESTAMP,ContextTokens,GeneratedTokens."""
    reader = csv.reader(io.StringIO(_read(path)))
    rows: list[TraceRow] = []
    cols = None
    for ln, rec in enumerate(reader, 1):
        if not rec or not any(x.strip() for x in rec):
            continue
        if cols is None:
            names = [x.strip().lower() for x in rec]
            want = ("timestamp", "contexttokens", "generatedtokens")
            if not all(w in names for w in want):
                raise InferdError(f"{path}:{ln}: expected the header TIMESTAMP,ContextTokens,GeneratedTokens, "
                                  f"got {','.join(rec)[:80]!r}")
            cols = [names.index(w) for w in want]
            continue
        try:
            if len(rec) <= max(cols):
                raise ValueError(f"{len(rec)} fields, expected at least {max(cols) + 1}")
            t = parse_timestamp_ns(rec[cols[0]])
            vals = []
            for c, what, least in ((cols[1], "ContextTokens", 1), (cols[2], "GeneratedTokens", 0)):
                try:
                    v = int(rec[c].strip())
                except ValueError:
                    raise ValueError(f"{what} must be an integer, got {rec[c].strip()!r}") from None
                vals.append(_int_field(v, what, least))
        except ValueError as e:
            raise InferdError(f"{path}:{ln}: bad Azure trace row: {e}") from None
        rows.append(TraceRow(t, vals[0], vals[1], None, ln))
    if cols is None:
        raise InferdError(f"{path}: empty trace (expected the header TIMESTAMP,ContextTokens,GeneratedTokens)")
    _check_order(rows, path)
    return rows


def trace_offsets_ns(rows: list[TraceRow], speedup: float = 1.0) -> list[int]:
    """Send offsets from the first row's arrival, the gaps divided by `speedup`."""
    if not rows:
        return []
    t0 = rows[0].t_ns
    return [int(round((r.t_ns - t0) / speedup)) for r in rows]


def _trace_prompts(rows: list[TraceRow], ex: "_Exact", seed: int, block_size: int, out_spec,
                   rng: random.Random, speedup: float, warnings: list[str]) -> list[BenchPrompt]:
    words = ex.words()
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:  # the same tokens for the same hash id in every request: a shared prefix
            r = random.Random(f"trace-block:{seed}:{h}")
            blocks[h] = [r.choice(words) for _ in range(block_size)]
        return blocks[h]

    out, zero = [], 0
    for i, (row, off) in enumerate(zip(rows, trace_offsets_ns(rows, speedup))):
        own = random.Random(f"trace-row:{seed}:{i}")  # a row's own tokens (no hash ids, or fitting)

        def more(k, own=own):
            return [own.choice(words) for _ in range(k)]

        body = max(row.input_len - ex.n_special, 0)
        if row.hash_ids is not None:
            ids = [t for h in row.hash_ids[:-(-body // block_size)] for t in block(h)][:body]
        else:
            ids = more(body)
        text, got = ex.fit(ids, row.input_len, more)
        olen = out_spec(rng) if out_spec else row.output_len
        if olen < 1:  # max_tokens 0 is refused by most servers; the trace meant "next to nothing"
            zero += 1
            olen = 1
        out.append(BenchPrompt(text, got, olen, arrival_ns=off))
    if zero:
        warnings.append(f"{zero} trace rows asked for 0 output tokens: sent with max_tokens 1")
    return out


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
                  path: str | None = None, families: int = 8, question_len: str = "32",
                  mix: str | None = None, block_size: int = TRACE_BLOCK_SIZE,
                  speedup: float = 1.0) -> tuple[list[BenchPrompt], list[str]]:
    """(prompts, warnings). Trace datasets use at most `num` rows (the first) and set each prompt's
    arrival_ns; the others make exactly `num` prompts."""
    rng = random.Random(f"dataset:{seed}")
    out_spec = parse_length(output_len, "--output-len") if output_len is not None else None
    warnings: list[str] = []
    if dataset in ("mixed", *TRACE_DATASETS):
        if tokenizer is None:
            raise InferdError(f"--dataset {dataset} needs a tokenizer: pass --tokenizer PATH|server")
        if dataset == "mixed":
            classes = parse_mix(mix or DEFAULT_MIX)
            if output_len is not None:
                warnings.append("--output-len is ignored with --dataset mixed: each --mix class has its own")
            return _mixed_prompts(num, _Exact(tokenizer), rng, classes, warnings), warnings
        if block_size < 1:
            raise InferdError("--trace-block-size must be >= 1")
        if not speedup > 0 or math.isinf(speedup):
            raise InferdError(f"bad --trace-speedup {speedup!r}: expected a number > 0")
        p = path or default_trace_path(dataset)
        rows = read_mooncake(p, block_size) if dataset == "mooncake-trace" else read_azure(p)
        if not rows:
            raise InferdError(f"no rows in trace {p}")
        if len(rows) > num:
            warnings.append(f"replaying the first {num} of the {len(rows)} rows of {p} (--num-prompts)")
            rows = rows[:num]
        return _trace_prompts(rows, _Exact(tokenizer), seed, block_size, out_spec, rng, speedup, warnings), warnings
    if dataset in WORKLOADS:
        out_spec = out_spec or parse_length("160", "--output-len")
        prompts = []
        for msgs in conversations(dataset, num, seed):
            text = render(msgs)
            plen = len(tokenizer.encode(text)) if tokenizer is not None else None
            prompts.append(BenchPrompt(text, plen, out_spec(rng), messages=msgs))
        return prompts, warnings
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
        raise InferdError(f"unknown --dataset {dataset!r} ({', '.join(DATASETS)})")
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

"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) compiled once by
llguidance, and per step a token mask for each constrained row, applied before sampling.

The pieces, in the order a request meets them:
* admission: `Grammars.matcher(constraint)` compiles the constraint (cached by its text, so the
  same schema sent again costs a copy) and returns a fresh matcher; a bad schema, regex or grammar
  is an InferdError naming the problem (a 400 at the server).
* before the forward: `MaskPrefetch.start(requests)` computes the next position's masks of the
  constrained rows that sample this step, in a thread, while the model runs on a GPU -- as vLLM and
  SGLang overlap grammar work with the GPU (on a CPU only when two or more rows need masks: see
  MaskPrefetch.overlap). Rows verifying speculative guesses get one mask per verified position,
  the matcher advanced along the guesses and rolled back.
* sampling: `masks_for(request)` takes the prefetched masks (or computes them if the state moved),
  the sampler sets disallowed logits to -inf; logprobs stay the model's raw ones (vLLM's default).
* append: the engine advances the matcher on each emitted token; a grammar that can go no further
  ends the request with finish_reason "stop".
Unconstrained rows pay nothing: no mask, no copy.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from inferd.engine.request import StructuredOutputs
from inferd.errors import InferdError

# Compact JSON (no whitespace between tokens, "," and ":" separators): a small model given free
# whitespace can spend its whole budget on newlines. A schema may override it with llguidance's
# own "x-guidance" key (e.g. {"whitespace_flexible": true}).
JSON_DEFAULTS = {"whitespace_flexible": False}
CACHE_SIZE = 256  # compiled constraints kept (each a matcher in its start state)


WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression", "choice": "choice",
        "grammar": "grammar"}


def _one_line(msg: str, limit: int = 400) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar of one constraint (no compile yet)."""
    import llguidance

    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else so.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise InferdError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if kind == "regex":
            # \d, \w, \s as ASCII classes (JSON Schema's and JavaScript's reading, which llguidance
            # gives "pattern" too): a subset of Python's Unicode reading, so every output still
            # matches under re.fullmatch, and a model is not offered every digit of Unicode
            return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(so.regex, "dws") + "/")
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF (converted to Lark)
    except InferdError:
        raise
    except (ValueError, TypeError) as e:
        raise InferdError(f"invalid {WHAT[kind]}: {_one_line(e)}") from None


def cache_key(so: StructuredOutputs) -> tuple:
    kind = so.kind
    v = getattr(so, kind)
    return kind, v if isinstance(v, str) else json.dumps(v)


def unpack(words: np.ndarray, vocab: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 bitmasks (bit i of a word: token 32 * word + i) -> bool [rows, V]."""
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.view(np.bool_))


class Grammars:
    """The engine's llguidance side: the tokenizer bridge, the compile cache, mask timing."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        if tokenizer is None:
            raise InferdError("structured output needs the model's tokenizer")
        self.tokenizer = tokenizer
        self.vocab = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_ids = sorted(eos_ids)
        self._lltok = None
        self._json_tok = None
        self._executor = None
        self._lock = threading.Lock()
        self.cache: OrderedDict = OrderedDict()
        self.compile_times: deque = deque(maxlen=4096)  # seconds per compile (cache misses)
        self.mask_times: deque = deque(maxlen=65536)  # seconds per mask (one position of one row)

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                # the tokenizer's own description (a tokenizer.json), so llguidance sees the same
                # token bytes; the model's vocabulary may be wider than the tokenizer's
                self._lltok = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab,
                                                     eos_token=self.eos_ids)
            return self._lltok

    def tokenizer_for(self, kind: str):
        """JSON constraints get llguidance's JSON slices (token classes precomputed for JSON
        strings: ~20 % less mask time inside them, measured); everything else the general ones."""
        tok = self.lltokenizer
        if kind not in ("json", "json_object"):
            return tok
        with self._lock:
            if self._json_tok is None:
                import llguidance

                self._json_tok = tok.with_slices(llguidance.LLTokenizer.json_slices())
            return self._json_tok

    @property
    def executor(self):
        """llguidance's own thread pool, for the masks of many rows at once (it computes them in
        parallel in Rust, without the GIL)."""
        if self._executor is None:
            import os

            import llguidance

            try:
                cores = len(os.sched_getaffinity(0))
            except AttributeError:
                cores = os.cpu_count() or 1
            self._executor = llguidance.LLExecutor(num_threads=max(1, cores))
        return self._executor

    def matcher(self, so: StructuredOutputs):
        """A matcher in the constraint's start state (its compiled form cached)."""
        key = cache_key(so)
        tmpl = self.cache.get(key)
        if tmpl is None:
            import llguidance

            text = grammar_text(so)
            t0 = time.perf_counter()
            tmpl = llguidance.LLMatcher(self.tokenizer_for(key[0]), text, log_level=0)
            self.compile_times.append(time.perf_counter() - t0)
            if tmpl.is_error():
                raise InferdError(f"invalid {WHAT[key[0]]}: {_one_line(tmpl.get_error())}")
            self.cache[key] = tmpl
            if len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return tmpl.deep_copy()

    def compute(self, matcher, drafts=()) -> torch.Tensor:
        """bool [1 + len(drafts), V]: the allowed tokens at the next position and after each
        speculative guess, the matcher advanced along the guesses and rolled back. Past a guess the
        grammar forbids, nothing can be accepted; those rows repeat the last mask."""
        n = 1 + len(drafts)
        buf = np.empty((n, self.words), dtype=np.int32)
        consumed = 0
        for j in range(n):
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(buf[j].ctypes.data, self.words * 4)
            self.mask_times.append(time.perf_counter() - t0)
            if j == n - 1:
                break
            d = drafts[j]
            if not (buf[j, d >> 5] >> (d & 31)) & 1 or not matcher.consume_token(d):
                buf[j + 1:] = buf[j]
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return unpack(buf, self.vocab)

    def compute_many(self, matchers) -> torch.Tensor:
        """bool [len(matchers), V]: each matcher's next-position mask, computed in parallel."""
        n = len(matchers)
        buf = np.empty((n, self.words), dtype=np.int32)
        t0 = time.perf_counter()
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], buf.ctypes.data,
                                              self.words * 4, n)
        dt = (time.perf_counter() - t0) / n
        self.mask_times.extend([dt] * n)  # per row, as the batch cost them
        return unpack(buf, self.vocab)

def mask_key(req) -> tuple:
    return len(req.output_ids), tuple(req.spec_tokens)


def needs_mask(req) -> bool:
    """A constrained request whose masks (if any) are for an earlier state."""
    return req.matcher is not None and (req.masks is None or req.masks[0] != mask_key(req))


class MaskPrefetch:
    """Masks of the next step computed on a worker thread while the forward runs."""

    def __init__(self, grammars: Grammars, overlap: bool | None = None):
        self.grammars = grammars
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="inferd-masks")
        self.job = None
        # On a GPU the forward is the device's work and the masks hide behind it: always overlap.
        # On a CPU the forward is CPU work too. Measured on 2 cores (benchmarks/structured.py): with
        # one constrained row a mask thread costs more than it hides (+7 % batch-1 TPOT against +5 %
        # computing the mask after the forward); with many, llguidance's executor computes them in
        # Rust threads without the GIL and the overlap pays (batch 32: +2 % against +9 %). So on a
        # CPU (overlap None): a thread when two or more rows need masks.
        self.overlap = overlap
        self.ahead = 0  # rows whose masks were computed during the forward
        self.inline = 0  # ... and after it, on the engine thread (the state moved, or the job failed)

    def start(self, reqs):
        todo = [r for r in reqs if needs_mask(r)]
        if todo and (self.overlap or (self.overlap is None and len(todo) > 1)):
            self.job = self.pool.submit(self._fill, todo)

    def _fill(self, reqs):
        self.ahead += self.fill(reqs, threaded=True)

    def fill(self, reqs, threaded: bool = False) -> int:
        """Compute the stale masks of these requests: rows without guesses in one parallel call,
        rows verifying guesses one by one (their matchers step along the guesses). -> rows done."""
        stale = [r for r in reqs if needs_mask(r)]
        plain = [r for r in stale if not r.spec_tokens]
        # the executor releases the GIL (what a thread needs); on the engine thread one row is cheaper alone
        if len(plain) > 1 or (plain and threaded):
            for r, m in zip(plain, self.grammars.compute_many([r.matcher for r in plain])):
                r.masks = (mask_key(r), m[None])
        for r in stale:
            if needs_mask(r):
                r.masks = (mask_key(r), self.grammars.compute(r.matcher, r.spec_tokens))
        return len(stale)

    def wait(self):
        """Called before anything touches a matcher again. A failed job is left to masks_for, which
        computes again on the engine thread (and fails only the request at fault)."""
        job, self.job = self.job, None
        if job is not None:
            try:
                job.result()
            except Exception:  # noqa: BLE001
                pass

    def masks_for(self, req) -> torch.Tensor:
        if needs_mask(req):
            req.masks = (mask_key(req), self.grammars.compute(req.matcher, req.spec_tokens))
            self.inline += 1
        return req.masks[1]

    def close(self):
        self.pool.shutdown(wait=True)


def advance(req, tok: int) -> None:
    """The matcher takes the emitted token; a grammar that is complete and cannot continue ends the
    request ("stop"), as vLLM ends it when its grammar terminates."""
    m = req.matcher
    if not m.consume_token(tok):
        raise InferdError(f"structured output: token {tok} does not fit the constraint ({_one_line(m.get_error())})")
    if req.finish_reason is None and m.is_stopped():
        req.finish_reason, req.stop_reason = "stop", None

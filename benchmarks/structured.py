"""What structured output costs: llguidance's compile time and mask time per token, and decode TPOT
with and without a constraint at batch 1 and 32, on the fastest configuration (gguf W4A8 with the
lm_head quantized, fused decode step), the masks computed after the forward ("inline"), on a thread
during it ("overlapped"), and as the engine chooses by default (on a CPU: overlapped when two or
more rows need masks).

Constrained rows follow a JSON schema (an array of records, long enough never to close within the
run); unconstrained rows the same prompt. TPOT: decode time per output token of a request (prefill
excluded), greedy, the same number of tokens for every row; medians of alternating rounds, one
engine for everything. The header gives the setup and the engine's paths record (the config's label,
e.g. "gguf W4A8 +lm_head, fused decode", is checked against it); --json F writes {"cpu", "setup",
"rows", "paths", ...}.

Usage: .venv/bin/python benchmarks/structured.py [--rounds 5] [--tokens 64] [--batches 1,32]
       [--quantization gguf] [--no-quantize-activations] [--json F]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import check_rows, fmt_spread, interleaved, report_header, spread, write_json  # noqa: E402

PROMPT = "List the people of the village as JSON records, one after another:"
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "job"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "job": {"enum": ["farmer", "smith", "baker", "miller", "weaver"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}
SCHEMA = {"type": "array", "items": RECORD, "maxItems": 10000}
# for the compile times: schemas of growing size (object widths), a regex, a grammar
COMPILE = [{"json": {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(w)],
                     "properties": {f"f{i}": RECORD if i % 3 == 0 else {"type": "string", "pattern": "^[a-z]{1,8}$"}
                                    for i in range(w)}}} for w in (1, 4, 16, 64)] + [
    {"regex": r"[A-Z][a-z]+ [0-9]{1,4}(, [A-Z][a-z]+ [0-9]{1,4})*"},
    {"grammar": 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]+/'},
]


def decode_tpot(eng, ids, batch: int, n: int, constrained: bool) -> float:
    """Mean over rows of (decode time / (tokens - 1)), seconds."""
    from inferd.engine.request import SamplingParams, StructuredOutputs

    so = StructuredOutputs(json=SCHEMA) if constrained else None
    rids = [eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, structured_outputs=so))
            for _ in range(batch)]
    reqs = [eng.requests[r] for r in rids]
    while eng.has_unfinished():
        eng.step()
    tpots = [r.timings.tpot for r in reqs]
    assert all(len(r.output_ids) == n for r in reqs), "a constrained row ended early: lengthen the schema"
    return statistics.mean(tpots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--no-quantize-activations", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from inferd.engine.engine import LLMEngine
    from inferd.engine.paths import engine_paths
    from inferd.engine.request import StructuredOutputs
    from inferd.engine.structured import Grammars
    from inferd.gguf_file import default_model_path

    w4a8 = not a.no_quantize_activations and a.quantization != "none"
    eng = LLMEngine(model=default_model_path(), quantization=a.quantization, quantize_activations=w4a8,
                    quantize_lm_head=w4a8, threads=a.threads, max_num_seqs=max(64, max(map(int, a.batches.split(",")))))
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True)
    # the row label: what this engine was built to run (checked against what it ran, below)
    setup = f"{a.quantization}{' W4A8 +lm_head' if w4a8 else ''}, {'fused decode' if eng.runner.fused else 'eager'}"

    # compile: a fresh Grammars (empty cache) per constraint, the tokenizer bridge built first
    g = Grammars(eng.tokenizer, eng.model_config.vocab_size, eng.eos_ids)
    t0 = time.perf_counter()
    g.lltokenizer
    g.tokenizer_for("json")  # JSON constraints' slices (a second llguidance tokenizer)
    bridge = time.perf_counter() - t0
    compiles = []
    for c in COMPILE:
        g.cache.clear()
        t0 = time.perf_counter()
        g.matcher(StructuredOutputs(**c))
        compiles.append(time.perf_counter() - t0)

    decode_tpot(eng, ids, 1, 8, True)  # warm-up (also builds the engine's own Grammars)
    decode_tpot(eng, ids, 1, 8, False)
    pre = eng.structured
    default_overlap = pre.overlap
    batches = [int(b) for b in a.batches.split(",")]
    modes = [("none", False, False), ("json, inline", True, False), ("json, overlapped", True, True),
             ("json, default", True, None)]
    pre.grammars.mask_times.clear()

    def tpot(b: int, constrained: bool, overlap):
        def run() -> float:
            pre.overlap = overlap
            return decode_tpot(eng, ids, b, a.tokens, constrained)
        return run

    res = interleaved({(b, m): tpot(b, constrained, overlap) for b in batches for m, constrained, overlap in modes},
                      a.rounds, log=False)
    pre.overlap = default_overlap
    paths = {setup: engine_paths(eng)}
    check_rows(paths)
    masks = sorted(pre.grammars.mask_times)
    p50 = masks[len(masks) // 2] * 1e6
    p99 = masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e6

    report_header("what structured output costs", {
        "config": setup, "threads": eng.config.threads or "all", "tokens": f"{a.tokens} a row (greedy, ignore_eos)",
        "batches": ", ".join(map(str, batches)) + " rows, each of the same prompt",
        "rounds": f"{a.rounds}, interleaved (every batch and constraint once a round); each TPOT is the median, "
                  "with the min-max", "vocabulary": eng.model_config.vocab_size}, paths)
    print(f"masks overlapped with the forward by default here: "
          f"{'when 2+ rows need them' if default_overlap is None else default_overlap} "
          f"(torch threads {__import__('torch').get_num_threads()})")
    print(f"\ntokenizer bridge (once per engine): {bridge * 1e3:.0f} ms")
    print("compile:", ", ".join(f"{list(c)[0]}{'/' + str(len(c['json']['properties'])) if 'json' in c else ''}"
                                f" {t * 1e3:.2f} ms" for c, t in zip(COMPILE, compiles)))
    print(f"mask per token (one row, one position): p50 {p50:.0f} us, p99 {p99:.0f} us over {len(masks)} masks\n")
    print(f"{'batch':>5}  {'constraint':<18} {'TPOT ms (min-max)':>22} {'vs none':>8}")
    out = {"compile_ms": [t * 1e3 for t in compiles], "bridge_ms": bridge * 1e3, "mask_us_p50": p50,
           "mask_us_p99": p99, "tpot_ms": {}}
    rows = []
    for b in batches:
        base = statistics.median(res[(b, "none")])
        for m, _, _ in modes:
            ms = [t * 1e3 for t in res[(b, m)]]
            t = statistics.median(ms)
            out["tpot_ms"][f"{b}/{m}"] = t
            rows.append({"label": f"{setup}, batch {b}, {m}", "metric": "TPOT ms", **spread(ms)})
            print(f"{b:>5}  {m:<18} {fmt_spread(ms, '{:.2f}'):>22} {(t / (base * 1e3) - 1) * 100:+7.1f}%")
    write_json(a.json, {"config": setup, "threads": eng.config.threads, "tokens": a.tokens, "batches": batches,
                        "rounds": a.rounds}, rows, paths, **out)
    eng.close()


if __name__ == "__main__":
    main()

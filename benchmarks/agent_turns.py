"""An agent's second turn through each API dialect: how much of its prompt the prefix cache holds,
and its time to first token beside the first turn's.

One `inferd serve` (the default model, default flags). A conversation is what a coding agent sends:
a system prompt of about 300 tokens and one tool, a question (turn 1), then the same with the
model's call and the tool's result appended (turn 2), streamed, 8 output tokens each. It runs
through the Responses API (store false, the whole history: Codex's way), Anthropic's Messages
(system as a block with cache_control: Claude Code's) and Ollama's /api/chat, each round with a
new system prompt (a nonce at its start) so that turn 1 is never a hit. Per turn: the client's TTFT
(the request sent to its first event that carries output; Ollama's stream has no event before
that) and the prompt tokens found in the prefix cache (`inferd:prefix_cache_hits`). A warm-up
conversation runs first (the first prefill over cached blocks in a process pays a one-time cost).
Medians of --rounds, interleaved, with the min-max.

Usage: .venv/bin/python benchmarks/agent_turns.py [--rounds 5] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import fmt_spread, interleaved, report_header, served_paths, spread, write_json  # noqa: E402
from serving import free_port, inferd_env, inferd_serve_cmd, server  # noqa: E402

SYSTEM = ("You are a coding agent working in a repository. You read files, run commands and edit code to "
          "finish the user's task. Think about which tool fits before you call it, call one tool at a time, "
          "and answer briefly once the task is done. Never invent file contents: read them first. ") * 3
READ = {"name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
ASK, ARGS, RESULT = "Read README.md and tell me what the project is.", {"path": "README.md"}, "inferd: an engine."
OUT = 8
MODEL = {"name": "default"}  # the served name, read at start (Ollama's requests name it)


def body(dialect: str, system: str, second: bool) -> tuple[str, dict]:
    if dialect == "responses":
        items = [{"role": "user", "content": ASK}]
        if second:
            items += [{"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": json.dumps(ARGS)},
                      {"type": "function_call_output", "call_id": "call_1", "output": RESULT}]
        return "/v1/responses", {"instructions": system, "input": items, "tools": [{"type": "function", **READ}],
                                 "store": False, "stream": True, "max_output_tokens": OUT, "temperature": 0}
    if dialect == "messages":
        msgs = [{"role": "user", "content": ASK}]
        if second:
            msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                        "input": ARGS}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}]
        tool = {"name": READ["name"], "description": READ["description"], "input_schema": READ["parameters"]}
        return "/v1/messages", {"system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                                "messages": msgs, "tools": [tool], "stream": True, "max_tokens": OUT, "temperature": 0}
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": ASK}]
    if second:
        msgs += [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "read_file",
                                                                                  "arguments": ARGS}}]},
                 {"role": "tool", "content": RESULT, "tool_name": "read_file"}]
    return "/api/chat", {"model": MODEL["name"], "messages": msgs, "tools": [{"type": "function", "function": READ}],
                         "options": {"temperature": 0, "num_predict": OUT}}


def has_output(line: bytes) -> bool:
    return any(k in line for k in (b'"response.output_text.delta"', b'"response.function_call_arguments.delta"',
                                   b'"content_block_delta"', b'"done": false', b'"done":false'))


def hits(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return sum(float(line.split()[-1]) for line in r.read().decode().splitlines()
                   if line.startswith("inferd:prefix_cache_hits_total"))


def turn(base: str, dialect: str, system: str, second: bool) -> tuple[float, float]:
    """(the client's TTFT in ms, prompt tokens found in the prefix cache) of one streamed turn."""
    path, b = body(dialect, system, second)
    before = hits(base)
    req = urllib.request.Request(base + path, json.dumps(b).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and has_output(line):
                first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0) * 1000, hits(base) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = free_port()
    extra = ["--threads", str(args.threads)] if args.threads else []
    rows, paths = [], {}
    with server(inferd_serve_cmd(*extra, port=port), "inferd", env=inferd_env()) as base:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            MODEL["name"] = json.load(r)["data"][0]["id"]
        turn(base, "responses", "warm-up " + SYSTEM, False)
        turn(base, "responses", "warm-up " + SYSTEM, True)
        results: dict = {}

        def conversation(dialect):
            def run():
                system = f"[{uuid.uuid4().hex[:8]}] " + SYSTEM
                results.setdefault(dialect, []).append((turn(base, dialect, system, False),
                                                        turn(base, dialect, system, True)))
                return results[dialect][-1][1][0]
            return run

        interleaved({d: conversation(d) for d in ("responses", "messages", "ollama")}, args.rounds)
        paths["inferd"] = served_paths(base)
    setup = {"model": "the embedded default (SmolLM2-135M-Instruct Q4_1), --quantization auto",
             "conversation": "system prompt ~300 tokens + 1 tool + a question; turn 2 adds the call and its result",
             "output tokens a turn": OUT, "rounds": args.rounds}
    report_header("An agent's second turn through each API dialect", setup, paths)
    print(f"\n{'dialect':<10} {'turn 1 TTFT ms':>22} {'turn 2 TTFT ms':>22} {'turn 2 cached tokens':>22}")
    for dialect, runs in results.items():
        t1 = [r[0][0] for r in runs]
        t2 = [r[1][0] for r in runs]
        cached = [r[1][1] for r in runs]
        print(f"{dialect:<10} {fmt_spread(t1, '{:.0f}'):>22} {fmt_spread(t2, '{:.0f}'):>22} "
              f"{fmt_spread(cached, '{:.0f}'):>22}")
        rows.append({"dialect": dialect, "turn1_ttft_ms": spread(t1), "turn2_ttft_ms": spread(t2),
                     "turn2_cached_tokens": spread(cached)})
    write_json(args.json, setup, rows, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())

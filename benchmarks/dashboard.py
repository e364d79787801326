"""What watching costs: the engine's step time with the dashboard closed, with its event stream read
(what the server and the engine pay: a state built every 0.5 s, the page's rate), and with the real page open in
headless Chromium on the same machine (that plus the browser's own CPU, which on a 2-core box
competes with the engine's threads).

One `inferd serve` (the default model) for every round; each round is the same `inferd bench` load
(16 requests, 128 in / 64 out, 8 at a time, ignore_eos), and the modes alternate round by round.
The step times come from the engine's own ring (read once after the round, so a closed round stays
closed): the median of the round's pure-decode steps at the full batch of 8, beside the bench's
output tok/s. The noise is the spread of the closed rounds among themselves.

The header gives the setup and the server's paths record (GET /v1/engine/state after the rounds);
--json F writes {"cpu", "setup", "rows", "paths", ...}.

Usage: .venv/bin/python benchmarks/dashboard.py [--rounds 5] [--modes closed,stream,browser] [--json F]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import check_rows, interleaved, report_header, served_paths, spread, write_json  # noqa: E402
from serving import free_port, inferd_serve_cmd, print_table, run_bench, server  # noqa: E402

BENCH = ["--dataset", "random", "--input-len", "128", "--output-len", "64", "--num-prompts", "16",
         "--max-concurrency", "8", "--extra-body", '{"ignore_eos": true}', "--no-progress", "--seed", "1"]
BATCH = 8
SERVED = "inferd serve, default model"


@contextlib.contextmanager
def stream_reader(base: str):
    """Reads /v1/engine/state/stream as the page does (every 0.5 s), parsing each event; returns
    [events read, engine milliseconds spent building them]."""
    import httpx

    stop = threading.Event()
    seen = [0, 0.0]

    def run():
        with httpx.stream("GET", base + "/v1/engine/state/stream", params={"interval": 0.5}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    doc = json.loads(line[5:])
                    seen[0] += 1
                    seen[1] += sum(e.get("build_ms", 0) for e in doc["engines"])
                if stop.is_set():
                    return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join(5)


@contextlib.contextmanager
def browser_page(base: str):
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-background-networking"])
        pg = b.new_page(viewport={"width": 1300, "height": 1000})
        pg.goto(base + "/dashboard")
        pg.wait_for_selector("#status[data-state=live]", timeout=30000)
        try:
            yield [pg]
        finally:
            b.close()


def decode_steps(base: str, after: int) -> tuple[int, list[float]]:
    import httpx

    st = httpx.get(base + "/v1/engine/state", timeout=30).json()["engines"][0]
    rows = [dict(zip(st["steps"]["fields"], r)) for r in st["steps"]["rows"]]
    mine = [r for r in rows if r["step"] > after]
    if mine and mine[0]["step"] != after + 1:
        raise SystemExit("a round ran more steps than the engine's ring keeps: make the load smaller")
    return st["step"], [r["ms"] for r in mine if r["prefill"] == 0 and r["recompute"] == 0 and r["seqs"] == BATCH]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="closed,stream,browser")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    extra = ["--threads", str(args.threads)] if args.threads else []
    with server(inferd_serve_cmd(*extra, port=port), "inferd"):
        run_bench(base, *BENCH)  # warm-up: the first requests pay for first-use work
        paths: dict = {}
        last = [decode_steps(base, 0)[0]]  # the engine's step id after the previous round

        def one_round(mode: str):
            def run() -> dict:
                ctx = {"closed": contextlib.nullcontext, "stream": stream_reader, "browser": browser_page}[mode]
                with ctx(base) if mode != "closed" else ctx() as watcher:
                    res = run_bench(base, *BENCH)
                last[0], ms = decode_steps(base, last[0])
                frames = list(watcher) if mode == "stream" else None
                print(f"{mode}: decode step {statistics.median(ms):.2f} ms over {len(ms)} steps, "
                      f"{res['output_throughput']:.1f} out tok/s"
                      + (f", {frames[0]} states read, {frames[1] / max(1, frames[0]):.2f} ms each to build" if frames
                         else ""), file=sys.stderr, flush=True)
                return {"decode_step_ms": statistics.median(ms), "decode_steps": len(ms),
                        "out_tok_s": res["output_throughput"], "mean_tpot_ms": res["mean_tpot_ms"], "frames": frames}
            return run

        results = interleaved({m: one_round(m) for m in modes}, args.rounds, log=False)
        paths[SERVED] = served_paths(base)
    check_rows(paths)
    closed = [r["decode_step_ms"] for r in results["closed"]] if "closed" in results else None
    base_ms = statistics.median(closed) if closed else None
    noise = (max(closed) - min(closed)) / base_ms * 100 if closed and len(closed) > 1 else None
    rows = []
    for mode in modes:
        ms = [r["decode_step_ms"] for r in results[mode]]
        med = statistics.median(ms)
        rows.append([mode, f"{med:.2f}", f"{min(ms):.2f}-{max(ms):.2f}",
                     f"{(med / base_ms - 1) * 100:+.1f} %" if base_ms else "-",
                     f"{statistics.median(r['out_tok_s'] for r in results[mode]):.1f}",
                     f"{statistics.median(r['mean_tpot_ms'] for r in results[mode]):.1f}"])
    setup = {"server": f"{SERVED} ({' '.join(extra) or 'default flags'})",
             "load": "inferd bench " + " ".join(BENCH) + " a round (16 requests, 8 in flight)",
             "rounds": f"{args.rounds}, the modes alternating ({', '.join(modes)}, again); each cell is the median",
             "decode steps": f"the round's pure-decode steps at the full batch of {BATCH}, from the engine's own ring"}
    report_header("what watching the dashboard costs", setup, paths)
    title = (f"closed rounds' spread {noise:.1f} % (max-min over median)" if noise is not None else "")
    print_table(title, ["dashboard", "decode step ms (median)", "range over rounds", "vs closed",
                              "out tok/s", "mean TPOT ms"], rows)
    write_json(args.json, setup, [{"label": f"dashboard {m}", "metric": "decode step ms",
                                   **spread([r["decode_step_ms"] for r in results[m]])} for m in modes],
               paths, results=results, noise_pct=noise)


if __name__ == "__main__":
    main()

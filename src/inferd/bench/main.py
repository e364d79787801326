"""`inferd bench` and `inferd bench report`: glue between the parsed arguments and the package."""
from __future__ import annotations

import json
import math
import os
import sys

from inferd.errors import InferdError

EXIT_SLA = 3


def _rate(s: str, what: str, allow_inf: bool = True) -> float:
    try:
        v = float(s)
    except ValueError:
        v = float("nan")
    if not v > 0 or (math.isinf(v) and not allow_inf):
        raise InferdError(f"bad {what} {s!r}: expected a number > 0" + (" or inf" if allow_inf else ""))
    return v


def _safe(v):
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def _emit(res: dict, requests: list[dict], args, clauses) -> int:
    from inferd.bench.crosscheck import format_crosscheck
    from inferd.bench.report import check_sla, console_table, write_csv, write_json

    print(console_table(res), flush=True)
    if res.get("crosscheck"):
        print(format_crosscheck(res["crosscheck"]), flush=True)
    if args.result_json:
        write_json(args.result_json, res)
    if args.csv:
        write_csv(args.csv, requests)
    if getattr(args, "html", None):
        from inferd.bench.html import run_page, write_html

        write_html(args.html, run_page(res, requests))
    if res["completed"] == 0 and res["failed"]:
        first = res["errors"][0] if res["errors"] else "no reason recorded"
        sys.stderr.write(f"inferd: error: all {res['failed']} requests failed ({first})\n")
        return 2
    bad = check_sla(res, clauses)
    if bad:
        sys.stderr.write("inferd: SLA violated: " + "; ".join(bad) + "\n")
        return EXIT_SLA
    return 0


def _load_json(path: str):
    """A JSON document (a sweep's), or None when the file is something else (e.g. a JSONL trace)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def cmd_report(args) -> int:
    from inferd.bench.metrics import compute_result
    from inferd.bench.report import parse_sla, read_trace
    from inferd.bench.sweep import SWEEP_FORMAT, points_table

    if len(args.action) != 2:
        raise InferdError("usage: inferd bench report TRACE.jsonl|SWEEP.json [--result-json F] [--csv F] "
                          "[--html F] [--sla ...]")
    if args.html:
        from inferd.bench.html import check_writable

        check_writable(args.html)
    doc = _load_json(args.action[1])
    if isinstance(doc, dict) and doc.get("format") == SWEEP_FORMAT:
        from inferd.bench.crosscheck import sweep_lines
        from inferd.bench.html import sweep_page, write_html

        print("\n".join([points_table(doc)] + sweep_lines(doc.get("points") or [])))
        if args.html:
            write_html(args.html, sweep_page(doc))
        return 0
    header, requests, footer = read_trace(args.action[1])
    res = compute_result(header, requests, footer)
    clauses = parse_sla(args.sla, res.get("percentiles") or [50, 90, 95, 99])
    return _emit(res, requests, args, clauses)


def preflight(base_url: str, api_key: str | None, timeout: float = 10.0) -> list[str]:
    """Reach the server once before anything else; returns the model ids it lists (maybe none)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise InferdError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        return []
    try:
        return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError, TypeError):
        return []


def _suffixed(path: str | None, tag: str) -> str | None:
    """t.jsonl + 'c=4' -> t.c4.jsonl: one file per sweep point."""
    if not path:
        return None
    root, ext = os.path.splitext(path)
    safe = "".join(ch for ch in tag if ch.isalnum() or ch in ".-_") or "point"
    return f"{root}.{safe}{ext}"


def cmd_run(args) -> int:
    from inferd.bench.arrivals import arrival_offsets_ns
    from inferd.bench.datasets import TRACE_DATASETS, build_prompts, default_trace_path
    from inferd.bench.report import parse_goodput, parse_percentiles, parse_sla

    if args.action:
        raise InferdError(f"unknown bench action {args.action[0]!r} "
                          f"(did you mean `inferd bench report TRACE` or `inferd bench compare A B`?)")
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    clauses = parse_sla(args.sla, percentiles)
    sweep = None
    if args.sweep is not None:
        from inferd.bench.sweep import parse_sweep

        sweep = parse_sweep(args.sweep)
    if args.html:
        from inferd.bench.html import check_writable

        check_writable(args.html)
    rate = _rate(args.request_rate, "--request-rate")
    burst = _rate(args.burstiness, "--burstiness")
    speedup = _rate(args.trace_speedup, "--trace-speedup", allow_inf=False)
    replay = args.dataset in TRACE_DATASETS
    if args.trace_block_size < 1:
        raise InferdError("--trace-block-size must be at least 1")
    if args.mix is not None and args.dataset != "mixed":
        raise InferdError("--mix needs --dataset mixed")
    if args.dataset == "mixed":
        from inferd.bench.datasets import DEFAULT_MIX, parse_mix

        parse_mix(args.mix or DEFAULT_MIX)  # a bad spec fails before the server is reached
    if replay and sweep is not None and sweep[0] != "concurrency":
        raise InferdError(f"--sweep {args.sweep} sets request rates, but --dataset {args.dataset} sends at the "
                          f"trace's own times: use --trace-speedup, or --sweep concurrency:...")
    if args.num_prompts < 1:
        raise InferdError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InferdError("--max-concurrency must be at least 1")
    if args.warmup < 0:
        raise InferdError("--warmup must be >= 0")
    if not args.endpoint.startswith("/"):
        raise InferdError(f"bad --endpoint {args.endpoint!r}: expected a path such as /v1/completions")
    if args.dataset in ("jsonl", "sharegpt") and not args.dataset_path:
        raise InferdError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset_path and not os.path.isfile(os.path.expanduser(args.dataset_path)):
        raise InferdError(f"dataset file not found: {args.dataset_path}")
    extra = None
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise InferdError("--extra-body must be a JSON object")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None

    from inferd.bench.http import Client
    from inferd.bench.runner import endpoint_type
    from inferd.bench.tokenizer import resolve_tokenizer

    Client(args.base_url)  # validates the URL
    models = preflight(args.base_url, api_key)
    model = args.model or (models[0] if models else None)
    tok, tok_id = resolve_tokenizer(args.tokenizer, args.base_url, model, api_key)
    prompts, warnings = build_prompts(args.dataset, args.num_prompts, tok, args.input_len, args.output_len,
                                      args.seed, args.dataset_path, args.prefix_families, args.question_len,
                                      mix=args.mix, block_size=args.trace_block_size, speedup=speedup)
    if replay and args.request_rate.strip().lower() != "inf":
        warnings.append(f"--request-rate {args.request_rate} is ignored: --dataset {args.dataset} sends each "
                        f"request at its time in the trace (scale them with --trace-speedup)")
    cfg = {"base_url": args.base_url, "endpoint": args.endpoint,
           "endpoint_type": endpoint_type(args.endpoint) if args.endpoint_type == "auto" else args.endpoint_type,
           "model": model,
           "tokenizer": tok_id, "dataset": args.dataset, "dataset_path": args.dataset_path,
           "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
           **({"prefix_families": args.prefix_families, "question_len": args.question_len}
              if args.dataset in ("prefix-families", "multi-turn") else {}),
           **({"mix": args.mix} if args.dataset == "mixed" else {}),
           **({"dataset_path": args.dataset_path or default_trace_path(args.dataset), "arrivals": "trace",
               "trace_speedup": speedup} if replay else {}),
           **({"trace_block_size": args.trace_block_size} if args.dataset == "mooncake-trace" else {}),
           "request_rate": _safe(rate), "burstiness": _safe(burst), "max_concurrency": args.max_concurrency,
           "seed": args.seed, "warmup": args.warmup, "percentiles": percentiles, "goodput": goodput,
           "timeout": args.timeout, "extra_body": extra, "api_key": api_key}
    trace_offsets = [p.arrival_ns for p in prompts] if replay else None

    def offsets_for(r: float) -> list[int]:  # a trace's own arrival times, whatever the rate
        return trace_offsets if trace_offsets is not None else arrival_offsets_ns(len(prompts), r, burst, args.seed)

    runner = _Runner(args, cfg, prompts, tok, warnings, offsets_for)
    if sweep is not None:
        return _sweep(args, runner, sweep, rate, clauses, percentiles)
    load = (f"arrivals from the trace ({prompts[-1].arrival_ns / 1e9:.1f} s, speedup {speedup:g})" if replay
            else f"rate {_safe(rate)}/s, burstiness {_safe(burst)}")
    sys.stderr.write(f"inferd bench: {len(prompts)} requests to {args.base_url}{args.endpoint} (model {model}), "
                     f"{load}, max concurrency {args.max_concurrency or 'unlimited'}\n")
    res, requests = runner.run(rate, args.max_concurrency, trace=args.trace)
    return _emit(res, requests, args, clauses)


class _Runner:
    """One timed run at a given load, with the options every run of the invocation shares."""

    def __init__(self, args, cfg, prompts, tok, warnings, offsets_for):
        self.args, self.cfg, self.prompts, self.tok, self.warnings = args, cfg, prompts, tok, warnings
        self.offsets_for = offsets_for
        self.metrics_ok: bool | None = None if args.server_metrics else False

    def run(self, rate: float, conc: int | None, trace: str | None = None, label: str = "inferd bench",
            warmup: int | None = None) -> tuple[dict, list[dict]]:
        from inferd.bench import crosscheck as cc
        from inferd.bench.progress import Progress, want_progress
        from inferd.bench.report import result_from_lines, trace_lines, write_trace
        from inferd.bench.runner import run_benchmark

        trace_arrivals = self.cfg.get("arrivals") == "trace"
        cfg = dict(self.cfg, request_rate="trace" if trace_arrivals else _safe(rate), max_concurrency=conc)
        if warmup is not None:
            cfg["warmup"] = warmup
        base, key = cfg["base_url"], cfg.get("api_key")
        scraped: dict = {}

        def before():
            if self.metrics_ok is not False:
                scraped["before"] = cc.scrape(base, key)
                self.metrics_ok = scraped["before"] is not None

        progress = Progress(len(self.prompts), label=label) if want_progress(self.args.progress) else None
        trace_recs = run_benchmark(cfg, self.prompts, self.offsets_for(rate), self.tok, self.warnings,
                                   progress=progress, on_start=before)
        requests = [r for r in trace_recs if r.get("type") == "request"]
        if self.args.server_metrics:  # kept in the trace, so that `bench report` shows the same check
            after = None
            if scraped.get("before") is not None:
                n_ok = sum(1 for r in requests if r.get("ok") and not r.get("warmup"))
                after = cc.settled_after(base, key, scraped["before"], n_ok)
            trace_recs[-1]["server_metrics"] = {"before": scraped.get("before"), "after": after}
        lines = trace_lines(trace_recs)
        if trace:
            write_trace(trace, lines)
        return result_from_lines(lines), requests


def _sweep(args, runner: "_Runner", sweep, rate: float, clauses, percentiles) -> int:
    from inferd.bench.crosscheck import sweep_lines
    from inferd.bench.report import check_sla, write_csv, write_json
    from inferd.bench.sweep import SWEEP_FORMAT, auto_rates, capacity, goodput_rate, point_label, points_table, samples

    kind, values = sweep
    points = []

    def one(pkind, value, x, label, conc, r, warm):
        sys.stderr.write(f"inferd bench: sweep point {label}: {len(runner.prompts)} requests\n")
        res, requests = runner.run(r, conc, trace=_suffixed(args.trace, label), label=label, warmup=warm)
        if args.csv:
            write_csv(_suffixed(args.csv, label), requests)
        bad = check_sla(res, clauses) if clauses else []
        if res["completed"] == 0:
            bad = bad or ["no request succeeded"]
        p = {"label": label, "kind": pkind, "value": _safe(value), "x": x, "sla_ok": (not bad) if clauses else None,
             "violations": bad, "slo_attainment": res.get("slo_attainment"), "result": res,
             "samples": samples(requests)}
        points.append(p)
        r99, att = res.get("p99_ttft_ms"), res.get("slo_attainment")
        sys.stderr.write(f"inferd bench: {label}: {res['completed']} ok, {res['failed']} failed, "
                         f"{res['request_throughput'] or 0:.2f} req/s, p99 TTFT "
                         f"{'-' if r99 is None else f'{r99:.1f}'} ms"
                         + ("" if att is None else f", SLO attainment {100 * att:.1f}%")
                         + ("" if not clauses else (", meets the SLA" if not bad else ", misses the SLA: " + "; ".join(bad)))
                         + "\n")
        return p

    warm = args.warmup
    if kind == "concurrency":
        for c in values:
            one("concurrency", c, c, point_label("concurrency", c), c, rate, warm)
            warm = 0  # the server is warm after the first point
        load_label = "concurrency (requests in flight)"
    elif kind == "rate":
        for r in values:
            x = r if math.isfinite(r) else None
            one("rate", r, x, point_label("rate", r), args.max_concurrency, r, warm)
            warm = 0
        finite = [p["x"] for p in points if p["x"] is not None]
        for p in points:  # inf is drawn at its achieved throughput, or beyond the last finite rate
            if p["x"] is None:
                p["x"] = max([p["result"]["request_throughput"] or 0] + [v * 1.5 for v in finite]) or 1.0
        load_label = "request rate (req/s)"
    else:
        sync = one("sync", 1, None, "sync (c=1)", 1, float("inf"), warm)
        sync["x"] = sync["result"]["request_throughput"]
        sat = one("saturation", float("inf"), None, "saturation", None, float("inf"), 0)
        sat["x"] = sat["result"]["request_throughput"]
        for r in auto_rates(sync["x"], sat["x"], int(values[0])):
            one("rate", r, r, point_label("rate", r), None, r, 0)
        load_label = "request rate (req/s; sync and saturation at their achieved rate)"
    points.sort(key=lambda p: (p["x"] is None, p["x"] or 0))
    first = points[0]["result"]
    doc = {"format": SWEEP_FORMAT, "version": 1, "sweep": args.sweep, "mode": kind, "load_label": load_label,
           "date": first.get("date"), "base_url": first.get("base_url"), "endpoint": first.get("endpoint"),
           "model_id": first.get("model_id"), "dataset": first.get("dataset"), "num_prompts": len(runner.prompts),
           "percentiles": percentiles, "sla": args.sla, "sla_clauses": [list(c) for c in clauses],
           "goodput_slos_ms": first.get("goodput_slos_ms"), "points": points, "capacity": capacity(points),
           "goodput_rate": goodput_rate(points)}
    print("\n".join([points_table(doc)] + sweep_lines(points)), flush=True)
    if args.result_json:
        write_json(args.result_json, doc)
    if args.html:
        from inferd.bench.html import sweep_page, write_html

        write_html(args.html, sweep_page(doc))
    if all(p["result"]["completed"] == 0 for p in points):
        sys.stderr.write("inferd: error: every request of every sweep point failed\n")
        return 2
    if clauses and doc["capacity"] is None:
        sys.stderr.write(f"inferd: SLA violated at every sweep point ({args.sla})\n")
        return EXIT_SLA
    return 0


def main(args) -> int:
    if args.action and args.action[0] == "report":
        return cmd_report(args)
    if args.action and args.action[0] == "compare":
        from inferd.bench.compare import cmd_compare

        return cmd_compare(args.action[1:])
    return cmd_run(args)

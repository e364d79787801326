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
    from inferd.bench.report import check_sla, console_table, write_csv, write_json

    print(console_table(res), flush=True)
    if args.result_json:
        write_json(args.result_json, res)
    if args.csv:
        write_csv(args.csv, requests)
    if res["completed"] == 0 and res["failed"]:
        first = res["errors"][0] if res["errors"] else "no reason recorded"
        sys.stderr.write(f"inferd: error: all {res['failed']} requests failed ({first})\n")
        return 2
    bad = check_sla(res, clauses)
    if bad:
        sys.stderr.write("inferd: SLA violated: " + "; ".join(bad) + "\n")
        return EXIT_SLA
    return 0


def cmd_report(args) -> int:
    from inferd.bench.metrics import compute_result
    from inferd.bench.report import parse_sla, read_trace

    if len(args.action) != 2:
        raise InferdError("usage: inferd bench report TRACE.jsonl [--result-json F] [--csv F] [--sla ...]")
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


def cmd_run(args) -> int:
    from inferd.bench.arrivals import arrival_offsets_ns
    from inferd.bench.datasets import build_prompts
    from inferd.bench.report import parse_goodput, parse_percentiles, parse_sla, result_from_lines, trace_lines, write_trace
    from inferd.bench.runner import run_benchmark
    from inferd.bench.tokenizer import resolve_tokenizer

    if args.action:
        raise InferdError(f"unknown bench action {args.action[0]!r} (did you mean `inferd bench report TRACE`?)")
    percentiles = parse_percentiles(args.percentiles)
    goodput = parse_goodput(args.goodput)
    clauses = parse_sla(args.sla, percentiles)
    rate = _rate(args.request_rate, "--request-rate")
    burst = _rate(args.burstiness, "--burstiness")
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

    Client(args.base_url)  # validates the URL
    models = preflight(args.base_url, api_key)
    model = args.model or (models[0] if models else None)
    tok, tok_id = resolve_tokenizer(args.tokenizer, args.base_url, model, api_key)
    prompts, warnings = build_prompts(args.dataset, args.num_prompts, tok, args.input_len, args.output_len,
                                      args.seed, args.dataset_path)
    offsets = arrival_offsets_ns(len(prompts), rate, burst, args.seed)
    cfg = {"base_url": args.base_url, "endpoint": args.endpoint,
           "endpoint_type": "chat" if "chat" in args.endpoint else "completions", "model": model,
           "tokenizer": tok_id, "dataset": args.dataset, "dataset_path": args.dataset_path,
           "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
           "request_rate": _safe(rate), "burstiness": _safe(burst), "max_concurrency": args.max_concurrency,
           "seed": args.seed, "warmup": args.warmup, "percentiles": percentiles, "goodput": goodput,
           "timeout": args.timeout, "extra_body": extra, "api_key": api_key}
    sys.stderr.write(f"inferd bench: {len(prompts)} requests to {args.base_url}{args.endpoint} (model {model}), "
                     f"rate {_safe(rate)}/s, burstiness {_safe(burst)}, max concurrency {args.max_concurrency or 'unlimited'}\n")
    trace = run_benchmark(cfg, prompts, offsets, tok, warnings)
    lines = trace_lines(trace)
    if args.trace:
        write_trace(args.trace, lines)
    res = result_from_lines(lines)
    return _emit(res, [r for r in trace if r.get("type") == "request"], args, clauses)


def main(args) -> int:
    if args.action and args.action[0] == "report":
        return cmd_report(args)
    return cmd_run(args)

"""`inferd router`: check the arguments, then serve the front with uvicorn."""
from __future__ import annotations

import logging
import sys

from inferd.errors import InferdError

log = logging.getLogger("inferd")


def add_router_args(p):
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="TCP port to listen on")
    p.add_argument("--backend", action="append", default=None, metavar="URL",
                   help="an OpenAI-compatible server (repeat): inferd, vLLM, llama-server, SGLang, ...")
    p.add_argument("--backends-file", default=None, help="YAML: a list of backend URLs (or of {url: ...})")
    p.add_argument("--prefill", action="append", default=None, metavar="URL",
                   help="a prefill worker (inferd serve --role prefill; repeat): requests are prefilled there, then "
                        "decoded by a --decode worker that pulls their KV")
    p.add_argument("--decode", action="append", default=None, metavar="URL",
                   help="a decode worker (inferd serve --role decode; repeat), with --prefill")
    p.add_argument("--disagg-min-prompt-chars", type=int, default=0,
                   help="with --prefill: prompts shorter than this many characters go straight to a decode worker")
    p.add_argument("--policy", default="prefix", choices=["prefix", "least_loaded", "round_robin", "kv_events"],
                   help="prefix: the backend that served the longest prefix of the prompt, unless loads are uneven; "
                        "kv_events: the backend whose KV pool holds the longest prefix, from its KV events")
    p.add_argument("--kv-events-endpoint", action="append", default=None, metavar="PUB[,REPLAY]",
                   help="kv_events policy: a backend's --kv-events-config endpoint (and replay endpoint), one per "
                        "--backend, in the same order")
    p.add_argument("--tokenizer", default=None,
                   help="kv_events policy: the backends' tokenizer (a .gguf, a Hugging Face folder or "
                        "tokenizer.json; default: the embedded default model's)")
    p.add_argument("--block-size", type=int, default=16, help="kv_events policy: the backends' --block-size")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health/metrics checks")
    p.add_argument("--require-all-backends", action="store_true",
                   help="exit (2) at start if any backend does not answer /health with 200")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a backend may take between reads")
    p.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                   help="a larger request body gets 413 before it is read whole")
    p.add_argument("--prefix-chunk-chars", type=int, default=64,
                   help="prefix policy: characters per hashed chunk (the match granularity)")
    p.add_argument("--prefix-cache-chunks", type=int, default=1 << 16,
                   help="prefix policy: chunks remembered per backend (LRU)")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="prefix policy: follow a backend's cache when it has at least this share of the prompt")
    p.add_argument("--balance-abs-threshold", type=float, default=4,
                   help="prefix policy: loads further apart than this (and the rel. threshold) go to the least loaded")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="prefix policy: loads are uneven when the busiest has this many times the idlest's "
                        "(and --balance-abs-threshold more)")
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")


def run(args) -> int:
    import httpx
    import uvicorn

    from inferd.router.app import create_router_app
    from inferd.router.backends import parse_backends

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s (router): %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    prefill = None
    if args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise InferdError("--prefill and --decode go together (at least one of each)")
        if args.backend or args.backends_file:
            raise InferdError("with --prefill/--decode the decode workers are the backends: drop --backend")
        prefill = parse_backends(args.prefill, None)
        urls = parse_backends(args.decode, None)
        if set(prefill) & set(urls):
            raise InferdError("a URL is both a --prefill and a --decode worker (for one worker doing both, start it "
                              "with --role both and give it as --backend)")
    else:
        urls = parse_backends(args.backend, args.backends_file)
    if args.disagg_min_prompt_chars < 0:
        raise InferdError("--disagg-min-prompt-chars must be >= 0")
    if args.health_interval <= 0:
        raise InferdError("--health-interval must be > 0")
    if args.require_all_backends:
        for u in (prefill or []) + urls:
            try:
                r = httpx.get(u + "/health", timeout=5)
                if r.status_code != 200:
                    raise InferdError(f"backend {u}: /health answered {r.status_code} (--require-all-backends)")
            except httpx.HTTPError as e:
                raise InferdError(f"backend {u} is unreachable ({type(e).__name__}; --require-all-backends)") from None
    kv_events = tokenizer = None
    if args.policy == "kv_events":
        kv_events, tokenizer = kv_events_setup(args, urls, prefill)
    elif args.kv_events_endpoint:
        raise InferdError("--kv-events-endpoint is for --policy kv_events")
    app = create_router_app(urls, args.policy, args.health_interval, args.request_timeout,
                            args.max_request_body_bytes, args.prefix_chunk_chars, args.prefix_cache_chunks,
                            args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold,
                            prefill_urls=prefill, disagg_min_chars=args.disagg_min_prompt_chars,
                            kv_events=kv_events, tokenizer=tokenizer, block_size=args.block_size)
    if prefill:
        log.info("routing (%s) prefill on %s, decode on %s, on http://%s:%d", args.policy, ", ".join(prefill),
                 ", ".join(urls), args.host, args.port)
    else:
        log.info("routing (%s) over %s on http://%s:%d", args.policy, ", ".join(urls), args.host, args.port)
    app.state.draining = False

    class Server(uvicorn.Server):
        # SIGTERM/SIGINT: open dashboard streams end at their next event (they never would by themselves),
        # open requests finish, then exit 0; a second signal exits at once. Not uvicorn's handler: it
        # re-raises the signal after shutdown, so a clean exit would read as killed.
        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True
                return
            app.state.draining = True
            self.should_exit = True

    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)).run()
    return 0


def kv_events_setup(args, urls: list[str], prefill) -> tuple[dict, object]:
    """--kv-events-endpoint (one per backend) and the tokenizer, checked before serving."""
    from inferd.gguf_file import default_model_path
    from inferd.router.kv_index import parse_endpoint
    from inferd.tokenizer import Tokenizer

    if prefill:
        raise InferdError("--policy kv_events routes --backend servers (not --prefill/--decode workers yet)")
    eps = args.kv_events_endpoint or []
    if len(eps) != len(urls):
        raise InferdError(f"--policy kv_events needs one --kv-events-endpoint per backend ({len(urls)} backends, "
                          f"{len(eps)} endpoints)")
    if args.block_size < 1:
        raise InferdError("--block-size must be at least 1")
    pairs = {}
    for u, e in zip(urls, eps):
        pub, replay = parse_endpoint(e)
        if not pub.startswith(("tcp://", "ipc://")) or (replay and not replay.startswith(("tcp://", "ipc://"))):
            raise InferdError(f"--kv-events-endpoint {e!r}: not a ZeroMQ address (tcp://HOST:PORT[,tcp://HOST:PORT])")
        pairs[u] = (pub, replay)
    path = args.tokenizer or default_model_path()
    try:
        tok = Tokenizer.load(path)
    except OSError as e:
        raise InferdError(f"--tokenizer {path}: {e.strerror or e}") from None
    return pairs, tok

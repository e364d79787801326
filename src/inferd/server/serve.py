"""`inferd serve`: load the model, start the engine thread, run uvicorn."""
from __future__ import annotations

import logging
import os
import sys

from inferd.engine.client import EngineClient
from inferd.errors import InferdError

log = logging.getLogger("inferd")


FAULT_EXIT_CODE = 3
FAULT_GRACE_S = 2.0  # in-flight requests get their error bodies, then the process exits


def _exit_soon(reason: str):
    """The engine process died: /health already answers 503 (the client is dead); exit non-zero so
    that a supervisor restarts the server, after a grace period for the open responses."""
    import threading

    log.error("engine process failed (%s): exiting with %d in %.0f s", reason, FAULT_EXIT_CODE, FAULT_GRACE_S)
    t = threading.Timer(FAULT_GRACE_S, lambda: os._exit(FAULT_EXIT_CODE))
    t.daemon = True
    t.start()


def _exit_when_drained(llm, timeout: float):
    """One of several engines died: its requests already failed; the others' open requests get
    up to `timeout` to finish, then the process exits non-zero (see server.data_parallel)."""
    import threading
    import time

    def wait():
        deadline = time.monotonic() + timeout
        while llm.open_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(FAULT_GRACE_S)  # the last responses leave the socket
        os._exit(FAULT_EXIT_CODE)

    log.error("an engine process failed (%s): no new requests; exiting with %d once the other engines' "
              "open requests finish (at most %.0f s)", llm.dead, FAULT_EXIT_CODE, timeout)
    threading.Thread(target=wait, daemon=True).start()


def serve(args) -> int:
    import uvicorn

    from inferd.config import EngineConfig
    from inferd.server.app import create_app
    from inferd.server.limits import Limits
    from inferd.server.metrics import Metrics

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.max_waiting < 0:
        raise InferdError("--max-waiting must be >= 0")
    cfg = EngineConfig.from_args(args)
    api_key = args.api_key or os.environ.get("INFERD_API_KEY")
    metrics_box = {}

    def on_step(snap, engine: int = 0):  # the metrics exist once the model is loaded; no step runs before
        if "m" in metrics_box:
            metrics_box["m"].on_step(snap, engine)

    def on_finish(out, engine: int = 0):
        if "m" in metrics_box:
            metrics_box["m"].on_finish(out, engine)

    dp = args.data_parallel_size
    if dp < 1:
        raise InferdError("--data-parallel-size must be >= 1")
    from inferd.distributed.kv_transfer import parse_kv_transfer_config

    kv_cfg = parse_kv_transfer_config(cfg.kv_transfer_config, cfg.role)  # a bad config fails before the model loads
    if kv_cfg is not None and dp > 1:
        raise InferdError("--kv-transfer-config / --role run one engine per server: start one server per "
                          "prefill or decode worker instead of --data-parallel-size")
    if dp > 1 and args.engine_in_process:
        raise InferdError("--data-parallel-size > 1 runs each engine in its own process: drop --engine-in-process")
    llm = start_engine(cfg, args, on_step, on_finish)
    if llm.info.tokenizer is None:
        llm.shutdown()
        raise InferdError("the server needs a model with a tokenizer")
    info = llm.info
    name = args.served_model_name or info.model_name
    aliases = {n for n in (args.model, info.model_name) if n}
    metrics = Metrics(name, speculative=info.speculative, engines=dp, kv_transfer=kv_cfg is not None)
    for i, c in enumerate(getattr(llm, "clients", [llm])):
        cache = c.info.cache
        metrics.cache_info(i, cache["block_size"], cache["num_blocks"], cache["dtype"], cache["prefix_caching"])
    metrics_box["m"] = metrics
    limits = Limits.from_args(args)
    app = create_app(llm, name, api_key=api_key, metrics=metrics, aliases=aliases, limits=limits,
                     allowed_origins=parse_origins(args.allowed_origins),
                     prompt_tokens_details=args.enable_prompt_tokens_details)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("serving %s on %s://%s:%d (OpenAI API under /v1)", name, scheme, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            timeout_graceful_shutdown=args.drain_timeout,
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    try:
        DrainingServer(config, app.state).run()
    finally:
        llm.shutdown()
    return 0


def start_engine(cfg, args, on_step, on_finish) -> EngineClient:
    """The server's engine client: one core process (the default), N of them behind a group
    (--data-parallel-size), or the engine on a thread of this process (--engine-in-process)."""
    from dataclasses import replace

    from inferd.engine.core_client import EngineCoreClient

    kw = dict(max_waiting=args.max_waiting, on_step=on_step, on_finish=on_finish)
    if args.data_parallel_size > 1:
        from inferd.distributed.data_parallel import EngineGroup

        def start(i, cpus, **hooks):
            return EngineCoreClient(replace(cfg, threads=cfg.threads or len(cpus)), max_waiting=args.max_waiting,
                                    cpus=cpus, name=f"inferd-engine-core-{i}", **hooks)

        group = EngineGroup(start, args.data_parallel_size, **kw, policy=args.data_parallel_routing,
                            on_fault=lambda reason: _exit_when_drained(group, args.drain_timeout))
        return group
    if args.engine_in_process:
        from inferd.engine.async_engine import AsyncLLM  # torch in this process only in this mode

        return AsyncLLM.from_config(cfg, **kw)
    return EngineCoreClient(cfg, **kw, on_fault=_exit_soon)


def parse_origins(value: str | None) -> list[str] | None:
    """--allowed-origins as a JSON list (vLLM's form) or comma-separated."""
    import json

    if not value:
        return None
    if value.lstrip().startswith("["):
        try:
            out = json.loads(value)
        except json.JSONDecodeError:
            raise InferdError("--allowed-origins: not a JSON list of strings") from None
        if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
            raise InferdError("--allowed-origins: not a JSON list of strings")
        return out
    return [x.strip() for x in value.split(",") if x.strip()]


def DrainingServer(config, state):
    """uvicorn's server with the shutdown a supervisor expects: the first SIGTERM/SIGINT stops
    accepting (new requests on open connections get 503) and lets open requests finish within
    --drain-timeout, then the process exits 0; a second signal of either kind exits at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit:
                log.warning("second signal: exiting now")
                self.force_exit = True
                return
            state.draining = True
            log.info("signal %d: draining open requests (at most %.0f s), then exiting", sig,
                     config.timeout_graceful_shutdown)
            # not uvicorn's handler: it re-raises the signal after shutdown, so a drained exit would
            # read as killed by SIGTERM instead of 0
            self.should_exit = True

    return Server(config)

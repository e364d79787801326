"""`inferd serve`: load the model, start the engine thread, run uvicorn."""
from __future__ import annotations

import logging
import os
import sys

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


def serve(args) -> int:
    import uvicorn

    from inferd.config import EngineConfig
    from inferd.engine.async_engine import AsyncLLM
    from inferd.engine.engine import LLMEngine
    from inferd.server.app import create_app
    from inferd.server.metrics import Metrics

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.max_waiting < 0:
        raise InferdError("--max-waiting must be >= 0")
    cfg = EngineConfig.from_args(args)
    api_key = args.api_key or os.environ.get("INFERD_API_KEY")
    metrics_box = {}

    def on_step(snap):  # the metrics exist once the model is loaded; no step runs before
        if "m" in metrics_box:
            metrics_box["m"].on_step(snap)

    def on_finish(out):
        if "m" in metrics_box:
            metrics_box["m"].on_finish(out)

    if args.engine_in_process:
        engine = LLMEngine(cfg)
        model_name, speculative = engine.loaded.source.name, engine.spec is not None
        llm = AsyncLLM(engine, max_waiting=args.max_waiting, on_step=on_step, on_finish=on_finish)
    else:
        from inferd.engine.core import EngineCoreClient

        llm = EngineCoreClient(cfg, max_waiting=args.max_waiting, on_step=on_step, on_finish=on_finish,
                               on_fault=_exit_soon)
        engine = llm.engine
        model_name, speculative = engine.model_name, engine.speculative
    if engine.tokenizer is None:
        llm.shutdown()
        raise InferdError("the server needs a model with a tokenizer")
    name = args.served_model_name or model_name
    aliases = {n for n in (args.model, model_name) if n}
    metrics_box["m"] = metrics = Metrics(name, speculative=speculative)
    app = create_app(llm, name, api_key=api_key, metrics=metrics, aliases=aliases)
    log.info("serving %s on http://%s:%d (OpenAI API under /v1)", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()
    return 0

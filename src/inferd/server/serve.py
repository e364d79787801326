"""`inferd serve`: load the model, start the engine thread, run uvicorn."""
from __future__ import annotations

import logging
import os
import sys

from inferd.errors import InferdError

log = logging.getLogger("inferd")


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
    engine = LLMEngine(cfg)
    if engine.tokenizer is None:
        raise InferdError("the server needs a model with a tokenizer")
    name = args.served_model_name or engine.loaded.source.name
    aliases = {n for n in (args.model, engine.loaded.source.name) if n}
    metrics = Metrics(name, speculative=engine.spec is not None)
    llm = AsyncLLM(engine, max_waiting=args.max_waiting, on_step=metrics.on_step, on_finish=metrics.on_finish)
    app = create_app(llm, name, api_key=args.api_key or os.environ.get("INFERD_API_KEY"), metrics=metrics,
                     aliases=aliases)
    log.info("serving %s on http://%s:%d (OpenAI API under /v1)", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()
    return 0

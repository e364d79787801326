"""`inferd serve`: load the model, start the engine thread, run uvicorn."""
from __future__ import annotations

import contextlib
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
    t = threading.Timer(FAULT_GRACE_S, _fault_exit)
    t.daemon = True
    t.start()


def _fault_exit():
    """os._exit skips atexit: the engines' socket directories are removed first."""
    from inferd.distributed import tmpdirs

    tmpdirs.remove_all()
    os._exit(FAULT_EXIT_CODE)


@contextlib.contextmanager
def _sigterm_unwinds():
    """While models load (before uvicorn takes the signals over), SIGTERM unwinds like Ctrl-C does,
    through the engine client's cleanup (its core process, its socket directory), instead of
    Python's default of dying on the spot; the exit code stays a SIGTERM's, 143."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig, _frame):
        log.info("signal %d while loading: stopping", sig)
        raise SystemExit(128 + sig)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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
        _fault_exit()

    log.error("an engine process failed (%s): no new requests; exiting with %d once the other engines' "
              "open requests finish (at most %.0f s)", llm.dead, FAULT_EXIT_CODE, timeout)
    threading.Thread(target=wait, daemon=True).start()


def serve(args) -> int:
    import asyncio

    import uvicorn

    from inferd.server.app import create_app
    from inferd.server.generation import Served
    from inferd.server.limits import Limits
    from inferd.server.metrics import Metrics
    from inferd.server.models import Models

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.max_waiting < 0:
        raise InferdError("--max-waiting must be >= 0")
    specs = model_specs(args)
    single = len(specs) == 1
    api_key = args.api_key or os.environ.get("INFERD_API_KEY")
    box: dict = {}  # the metrics (once built) and the server's event loop (once running)

    dp = args.data_parallel_size
    if dp < 1:
        raise InferdError("--data-parallel-size must be >= 1")
    from inferd.distributed.kv_transfer import parse_kv_transfer_config

    kv_cfg = parse_kv_transfer_config(specs[0].config.kv_transfer_config, specs[0].config.role)  # fails before loading
    if kv_cfg is not None and dp > 1:
        raise InferdError("--kv-transfer-config / --role run one engine per server: start one server per "
                          "prefill or decode worker instead of --data-parallel-size")
    if kv_cfg is not None and not single:
        raise InferdError("--kv-transfer-config / --role serve one model: start one server per model")
    from inferd.distributed.kv_events import parse_kv_events_config

    if parse_kv_events_config(specs[0].config.kv_events_config) is not None and not single:
        raise InferdError("--kv-events-config publishes one model's blocks: start one server per model")
    if any(s.config.distributed_executor_backend == "ray" and s.config.tensor_parallel_size > 1 for s in specs):
        from inferd.distributed.ray_address import check_address

        check_address()  # an unreachable RAY_ADDRESS fails here, before an engine process starts
    if dp > 1 and args.engine_in_process:
        raise InferdError("--data-parallel-size > 1 runs each engine in its own process: drop --engine-in-process")
    if not single and args.engine_in_process:
        raise InferdError("several models run each in its own engine process: drop --engine-in-process")
    limits = Limits.from_args(args)
    store = responses_store(args)  # a bad bound fails before any model loads
    models: Models | None = None

    def start(spec):
        name = spec.name

        def on_step(snap, engine: int = 0):  # the metrics exist once the first model is loaded
            if "m" in box:
                box["m"].on_step(snap, engine, None if single else name)

        def on_finish(out, engine: int = 0):
            if "m" in box:
                box["m"].on_finish(out, engine, None if single else name)

        def on_fault(reason: str):
            if single:
                return (_exit_when_drained(box["llm"], args.drain_timeout) if dp > 1 else _exit_soon(reason))
            loop = box.get("loop")
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(models.engine_failed, models.find(name), reason)

        client = start_engine(spec.config, args, on_step, on_finish, on_fault)
        if client.info.tokenizer is None:
            client.shutdown()
            raise InferdError("the server needs a model with a tokenizer")
        if single:
            box["llm"] = client  # what a data-parallel fault waits on
        return client

    def served(spec, client):
        if single:  # named by the model itself once loaded (unless --served-model-name), answering to both
            spec.name = args.served_model_name or client.info.model_name
            spec.aliases.add(client.info.model_name)
        srv = Served(client, spec.name, limits)
        srv.prompt_details = args.enable_prompt_tokens_details
        srv.reasoning_parser = args.reasoning_parser
        if "m" in box:
            cache_series(spec, client)
        return srv

    def cache_series(spec, client):
        for i, c in enumerate(getattr(client, "clients", [client])):
            cache = c.info.cache
            box["m"].cache_info(i, cache["block_size"], cache["num_blocks"], cache["dtype"],
                                cache["prefix_caching"], None if single else spec.name)

    def on_change(entry, event):
        if "m" in box:
            load = None
            if event == "loaded" and entry.served is not None:
                info = getattr(entry.served.llm, "info", None)
                load = getattr(info, "load", None)
            box["m"].model_event(entry.name, event, entry.load_seconds if event == "loaded" else None, load)

    models = Models(specs, start, served, max_loaded=args.max_loaded_models or 0,
                    memory_budget=parse_budget(args.models_memory_budget), on_change=on_change)
    try:
        with _sigterm_unwinds():
            if single:  # loaded before the server listens, as before: a model that cannot load fails the command
                models.load_now(models.default)
            else:
                for e in models.entries:
                    if e.spec.preload:
                        try:
                            models.load_now(e)
                        except InferdError as err:
                            log.error("model %s failed to load at start: %s (it stays unloaded)", e.name, err)
    except BaseException:  # the models loaded before the failure or the signal stop with it
        models.shutdown()
        raise
    speculative = any(s.config.speculative_method for s in specs)
    metrics = Metrics(specs[0].name, speculative=speculative, engines=dp, kv_transfer=kv_cfg is not None,
                      kv_tier=any(s.config.kv_tier is not None for s in specs),
                      kv_events=parse_kv_events_config(specs[0].config.kv_events_config) is not None)
    for s in specs[1:]:
        metrics.add_model(s.name, dp)
    box["m"] = metrics
    for e, srv in models.loaded_served():  # models loaded before the metrics existed
        cache_series(e.spec, srv.llm)
        on_change(e, "loaded")

    async def started():
        box["loop"] = asyncio.get_running_loop()
        models.watch()

    app = create_app(models, api_key=api_key, metrics=metrics, limits=limits,
                     allowed_origins=parse_origins(args.allowed_origins),
                     on_start=started, store=store)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("serving %s on %s://%s:%d (OpenAI's API under /v1, Anthropic's /v1/messages, Ollama's /api)",
             ", ".join(models.names()), scheme, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            timeout_graceful_shutdown=args.drain_timeout,
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    try:
        DrainingServer(config, app.state).run()
    finally:
        models.shutdown()
    return 0


def responses_store(args):
    """The Responses API's store, bounded by its three flags (server/openai/store.py)."""
    from inferd.config import parse_bytes
    from inferd.server.openai.store import ResponseStore

    if args.responses_store_entries < 0 or args.responses_store_ttl < 0:
        raise InferdError("--responses-store-entries and --responses-store-ttl must be >= 0")
    return ResponseStore(args.responses_store_entries, parse_bytes(args.responses_store_bytes),
                         args.responses_store_ttl)


DEFAULT_KEEP_ALIVE_S = 300.0  # with several models; one model alone stays loaded


def model_specs(args) -> list:
    """`--model` (repeatable, NAME=PATH to name one) and the YAML config's `models:` list -> the
    served models, each with its engine configuration (the flags, and a YAML entry's own options)."""
    from dataclasses import replace

    from inferd.config import EngineConfig
    from inferd.server.models import ModelSpec

    given = args.model if isinstance(args.model, list) else [args.model] if args.model else []
    entries: list[dict] = [split_named(m) for m in given]
    for i, raw in enumerate(getattr(args, "models", None) or []):
        if not isinstance(raw, dict):
            raise InferdError(f"models[{i}] in the config must be a mapping (model: PATH, name: ID, options...)")
        entries.append({str(k).replace("-", "_"): v for k, v in raw.items()})
    if not entries:
        entries = [{"model": None}]
    multi = len(entries) > 1
    if multi and args.served_model_name:
        raise InferdError("--served-model-name names one model: with several, name each as --model NAME=PATH "
                          "or with name: in the config's models list")
    # with several models each --lora-modules adapter goes to the one it fits (attach_flag_adapters)
    flag_adapters = getattr(args, "lora_modules", None) if multi else None
    keep = args.keep_alive
    if keep is None:
        keep = DEFAULT_KEEP_ALIVE_S if multi else -1
    base = EngineConfig.from_args(_without(args, *(("model", "lora_modules") if flag_adapters else ("model",))))
    fields = EngineConfig.field_names()
    specs, seen = [], set()
    for i, ent in enumerate(entries):
        ent = dict(ent)
        path = ent.pop("model", None)
        path = None if path is None else str(path)
        name = ent.pop("name", None)
        preload = bool(ent.pop("preload", args.preload))
        ka = ent.pop("keep_alive", keep)
        bad = sorted(set(ent) - fields)
        if bad:
            raise InferdError(f"models[{i}]: unknown option {bad[0]!r}")
        cfg = replace(base, model=path, **ent).validate()
        if name is None:
            name = args.served_model_name or (path if path else "smollm2-135m")
        aliases = set()
        if path and not multi:
            aliases.add(path)
        elif path and os.path.basename(os.path.normpath(path)) != name:
            aliases.add(os.path.basename(os.path.normpath(path)))
        if name in seen:
            raise InferdError(f"two models are named {name!r}: name them apart with --model NAME=PATH")
        seen.add(name)
        specs.append(ModelSpec(name=str(name), config=cfg, aliases=aliases, preload=preload or not multi,
                               keep_alive=parse_keep_alive(ka), source_path=path if path and os.path.exists(path)
                               else None))
    if flag_adapters:
        attach_flag_adapters(specs, flag_adapters)
    return specs


def attach_flag_adapters(specs: list, flags: list) -> None:
    """`--lora-modules` beside several models: each adapter into the config of the model it fits
    (inferd.engine.adapters), after the adapters a YAML entry gave its model itself."""
    from inferd.config import lora_module
    from inferd.engine.adapters import assign_adapters

    placed = assign_adapters([lora_module(f) for f in flags], [(s.name, s.aliases, s.config.model, s.config.load_format) for s in specs])
    for s in specs:
        if placed[s.name]:
            s.config.lora_modules = [*(s.config.lora_modules or []), *placed[s.name]]
            s.config.validate()
            log.info("model %s: LoRA adapters %s", s.name, ", ".join(m.split("=", 1)[0] for m in placed[s.name]))


def split_named(spec: str) -> dict:
    """`--model NAME=PATH` -> {name, model}; a plain path (even one holding '=') -> {model}."""
    if "=" in spec and not os.path.exists(spec):
        name, path = spec.split("=", 1)
        if name and "/" not in name and path:
            return {"name": name, "model": path}
    return {"model": spec}


def parse_keep_alive(v) -> float | None:
    """Seconds idle before a model unloads; a negative value: never (None)."""
    try:
        s = float(v)
    except (TypeError, ValueError):
        raise InferdError(f"keep_alive must be a number of seconds (-1: never), not {v!r}") from None
    return None if s < 0 else s


def parse_budget(v) -> int | None:
    if v in (None, "", 0, "0"):
        return None
    from inferd.config import parse_bytes

    return parse_bytes(v)


def _without(args, *names):
    import argparse

    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in names})


def start_engine(cfg, args, on_step, on_finish, on_fault) -> EngineClient:
    """The server's engine client: one core process (the default), N of them behind a group
    (--data-parallel-size), or the engine on a thread of this process (--engine-in-process)."""
    from dataclasses import replace

    from inferd.engine.core_client import EngineCoreClient

    kw = dict(max_waiting=args.max_waiting, on_step=on_step, on_finish=on_finish)
    if args.data_parallel_size > 1:
        from inferd.distributed.data_parallel import EngineGroup

        def start(i, cpus, **hooks):
            return EngineCoreClient(replace(cfg, threads=cfg.threads or len(cpus), data_parallel_rank=i),
                                    max_waiting=args.max_waiting,
                                    cpus=cpus, name=f"inferd-engine-core-{i}", **hooks)

        return EngineGroup(start, args.data_parallel_size, **kw, policy=args.data_parallel_routing, on_fault=on_fault)
    if args.engine_in_process:
        from inferd.engine.async_engine import AsyncLLM  # torch in this process only in this mode

        return AsyncLLM.from_config(cfg, **kw)
    return EngineCoreClient(cfg, **kw, on_fault=on_fault)


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

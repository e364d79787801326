"""inferd as a Ray Serve application: an OpenAI ingress over a deployment of engine replicas.

    serve run inferd.ray.serve:app                      # the default model, one replica
    serve run config.yaml                               # import_path: inferd.ray.serve:build_app, args: {...}

Two deployments (the shape of Ray Serve LLM's `build_openai_app`):
- `InferdIngress`: the same FastAPI app as `inferd serve` (inferd.server: completions, chat,
  streaming, errors, /metrics), holding a `RayEngineClient` instead of an engine process. It
  tokenizes, renders chat templates and detokenizes; it takes no CPU of its own from Ray.
- `InferdEngine`: the replicas, each one engine (in a core process the replica starts, as
  `inferd serve` does), scaled by Serve's `autoscaling_config` on ongoing requests, health-checked (a dead
  engine fails `check_health`, and Serve replaces the replica), and chosen per request by
  `inferd.ray.router.PrefixRouter` (the prefix policy of `inferd router`) unless `routing:
  pow2` asks for Serve's own power-of-two choices.

`build_app(args)` takes:
    model: PATH (default: the embedded SmolLM2)     served_model_name: ID
    engine: {EngineConfig options: dtype, quantization, kv_cache_memory, max_num_seqs, role, ...}
    num_replicas: N | autoscaling_config: {min_replicas, max_replicas, target_ongoing_requests, ...}
    ray_actor_options: {num_cpus: 1, ...}            max_ongoing_requests: 32
    routing: prefix | pow2                           api_key: KEY
    enable_prompt_tokens_details: false              stream_interval_ms: 50 (outputs sent together)
    prefill: {same keys}  (with it: disaggregated prefill/decode, inferd.ray.disagg)
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from ray import serve
from ray.serve.config import RequestRouterConfig

log = logging.getLogger("inferd")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # a replica's log lines, as inferd serve's

DEFAULTS = {"model": None, "served_model_name": None, "engine": {}, "num_replicas": 1, "autoscaling_config": None,
            "ray_actor_options": {"num_cpus": 1}, "max_ongoing_requests": 32, "routing": "prefix", "api_key": None,
            "prefill": None, "enable_prompt_tokens_details": False, "stream_interval_ms": 50}


def engine_config(model: str | None, options: dict, cpus: float | None):
    """The EngineConfig of a replica: `inferd serve`'s defaults (--quantization auto: a GGUF file
    runs from its own blocks), `options` over them, threads = the replica's CPUs."""
    from inferd.cli import build_parser
    from inferd.config import EngineConfig
    from inferd.errors import InferdError

    opts = {str(k).replace("-", "_"): v for k, v in (options or {}).items()}
    bad = sorted(set(opts) - EngineConfig.field_names())
    if bad:
        raise InferdError(f"engine: unknown option {bad[0]!r}")
    cfg = replace(EngineConfig.from_args(build_parser().parse_args(["serve"])), model=model, **opts)
    if not cfg.threads and cpus:
        cfg.threads = max(1, int(cpus))
    return cfg.validate()


class EngineReplica:
    """One engine, in a core process of its own (inferd serve's EngineCoreClient): the replica's
    event loop, which answers Serve's calls and queue-length probes and streams the outputs, does
    not share a GIL with the scheduler. `generate` streams RequestOutputs back to the ingress, in lists: every item of a
    Ray streaming call costs a message and a wake-up in two processes, so after the first output
    the ones that come within `stream_interval_ms` travel together (Ray Serve LLM batches its
    streams the same way); a finished output goes at once."""

    def __init__(self, model: str | None, options: dict, stream_interval_ms: float = 50):
        import ray

        from inferd.engine.core_client import EngineCoreClient

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        from inferd.ray.disagg import producer_on_this_node

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        options = producer_on_this_node(options, ray.util.get_node_ip_address())
        self.llm = EngineCoreClient(engine_config(model, options, cpus))
        self.interval = max(0.0, float(stream_interval_ms)) / 1e3

    def info(self):
        return self.llm.info

    async def generate(self, prompt_ids: list[int], params, request_id: str, kv_transfer_params: dict | None = None,
                       lora: str | None = None):
        batch, sent = [], 0.0
        async for out in self.llm.generate(prompt_ids, params, request_id, None, kv_transfer_params, lora):
            batch.append(out)
            now = time.monotonic()
            if out.finished or now - sent >= self.interval:
                yield batch
                batch, sent = [], now
        if batch:
            yield batch

    async def state(self, steps: int = 100) -> list[dict]:
        return await self.llm.state(steps)

    def check_health(self):
        if self.llm.dead:  # Serve replaces an unhealthy replica
            raise RuntimeError(f"engine stopped: {self.llm.dead}")

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


@serve.ingress()
class OpenAIIngress:
    """The OpenAI API of `inferd serve`, over the engine deployment."""

    async def __init__(self, engine, args: dict, prefill=None):
        from inferd.ray.client import RayEngineClient
        from inferd.server.app import create_app
        from inferd.server.generation import Served
        from inferd.server.limits import Limits
        from inferd.server.metrics import Metrics
        from inferd.server.models import Models, ModelSpec

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        info = await engine.info.remote()
        name = args.get("served_model_name") or info.model_name
        metrics = Metrics(name)
        limits = Limits()
        client = RayEngineClient(engine, info, on_finish=metrics.on_finish)
        if prefill is not None:
            from inferd.ray.disagg import DisaggregatedClient

            client = DisaggregatedClient(RayEngineClient(prefill, await prefill.info.remote()), client)
        self.client = client
        spec = ModelSpec(name=name, config=None, aliases={info.model_name, str(args.get("model") or "")} - {""})

        def served(s, c):
            srv = Served(c, s.name, limits)
            srv.prompt_details = bool(args.get("enable_prompt_tokens_details"))
            return srv
        self.models = Models([spec], lambda s: client, served)
        self.models.load_now(self.models.default)
        self.asgi = create_app(self.models, api_key=args.get("api_key"), metrics=metrics, limits=limits)
        self.asgi.add_api_route("/v1/ray/replica_failures", self.failures, methods=["GET"], include_in_schema=False)
        log.info("inferd ingress for %s over Ray Serve replicas", name)

    async def failures(self):
        """Requests a replica failed under (the replica died): counted here, where they were answered."""
        return {"failures": self.client.failures, "paths": getattr(self.client, "paths", None)}

    def __serve_build_asgi_app__(self):
        return self.asgi


def engine_deployment(name: str, a: dict):
    """The engine deployment of options `a` (replicas or autoscaling, actor options, router)."""
    opts = {"name": name, "ray_actor_options": a["ray_actor_options"], "max_ongoing_requests": a["max_ongoing_requests"],
            "health_check_period_s": 2, "health_check_timeout_s": 60, "graceful_shutdown_timeout_s": 5}
    if a.get("autoscaling_config"):
        opts["autoscaling_config"] = a["autoscaling_config"]
    else:
        opts["num_replicas"] = a["num_replicas"]
    if a["routing"] == "prefix":
        opts["request_router_config"] = RequestRouterConfig(request_router_class="inferd.ray.router:PrefixRouter")
    elif a["routing"] != "pow2":
        from inferd.errors import InferdError

        raise InferdError(f"routing: {a['routing']!r} (choose prefix, pow2)")
    engine_config(a["model"], a["engine"], None)  # a bad option fails here, at build time, in one line
    return serve.deployment(EngineReplica).options(**opts).bind(a["model"], a["engine"], a["stream_interval_ms"])


def build_app(args: dict | None = None):
    """The application of a Serve config's `args` (or `serve run inferd.ray.serve:build_app k=v`)."""
    from inferd.errors import InferdError

    a = {**DEFAULTS, **(args or {})}
    unknown = sorted(set(a) - set(DEFAULTS))
    if unknown:
        raise InferdError(f"inferd.ray.serve: unknown option {unknown[0]!r} (known: {', '.join(DEFAULTS)})")
    prefill = None
    if a["prefill"] is not None:
        from inferd.ray.disagg import prefill_options

        a, p = prefill_options(a)
        prefill = engine_deployment("InferdPrefill", p)
    engine = engine_deployment("InferdEngine", a)
    ingress = serve.deployment(OpenAIIngress).options(name="InferdIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, a, prefill)


app = build_app()

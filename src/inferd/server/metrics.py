"""Prometheus metrics from the engine's own timing events, named as vLLM names them (inferd: prefix).

Every series has an `engine` label ("0", "1", ... with --data-parallel-size), as vLLM's do. The
ones Kubernetes LLM routers read (the Gateway API Inference Extension's endpoint picker, llm-d,
KServe) are exposed a second time under their vLLM names, same values, so inferd can stand where
they expect vLLM: see VLLM_NAMES.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# inferd name -> the vLLM names it is also exposed as (gpu_cache_usage_perc: vLLM before 0.10, which
# older endpoint pickers still read)
VLLM_NAMES = {
    "inferd:num_requests_running": ("vllm:num_requests_running",),
    "inferd:num_requests_waiting": ("vllm:num_requests_waiting",),
    "inferd:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "inferd:cache_config_info": ("vllm:cache_config_info",),
    "inferd:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "inferd:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "inferd:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "inferd:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "inferd:prompt_tokens": ("vllm:prompt_tokens",),
    "inferd:generation_tokens": ("vllm:generation_tokens",),
    "inferd:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "inferd:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "inferd:num_preemptions": ("vllm:num_preemptions",),
    "inferd:request_success": ("vllm:request_success",),
    "inferd:lora_requests_info": ("vllm:lora_requests_info",),
    "inferd:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "inferd:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "inferd:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "inferd:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


class _Renamed:
    """A collector that re-exposes another registry's families under other names."""

    def __init__(self, source: CollectorRegistry, names: dict[str, tuple[str, ...]]):
        self.source, self.names = source, names

    def collect(self):
        for fam in self.source.collect():
            for new in self.names.get(fam.name, ()):
                out = Metric(new, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(new + s.name[len(fam.name):], s.labels, s.value, s.timestamp, s.exemplar)
                yield out

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


def _advance(counters: dict, now: dict, last: dict, prefix: str, labels: dict):
    """Each counter by how much its engine-side running total (now[key]) grew since the last
    snapshot (last[prefix + key]); every series exists from the first snapshot on, at 0."""
    for key, counter in counters.items():
        value = now.get(key, 0)
        if value > last[prefix + key]:
            counter.labels(**labels).inc(value - last[prefix + key])
        else:
            counter.labels(**labels)
        last[prefix + key] = value


class Metrics:
    def __init__(self, model_name: str, speculative: bool = False, engines: int = 1, kv_transfer: bool = False,
                 kv_tier: bool = False, kv_events: bool = False):
        self.registry = r = CollectorRegistry()
        L = ["model_name", "engine"]
        self.model_name = model_name
        self.aliases = CollectorRegistry()
        self.aliases.register(_Renamed(r, VLLM_NAMES))
        self.ttft = Histogram("inferd:time_to_first_token_seconds", "Time to first token.", L,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("inferd:inter_token_latency_seconds", "Time between consecutive tokens.", L,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("inferd:e2e_request_latency_seconds", "End-to-end request latency.", L,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("inferd:request_queue_time_seconds", "Time waiting before first scheduled.", L,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("inferd:num_requests_running", "Sequences in the running batch.", L, registry=r)
        self.waiting = Gauge("inferd:num_requests_waiting", "Requests waiting to be scheduled.", L, registry=r)
        self.kv_usage = Gauge("inferd:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", L, registry=r)
        self.prompt_tokens = Counter("inferd:prompt_tokens", "Prompt tokens processed.", L, registry=r)
        self.gen_tokens = Counter("inferd:generation_tokens", "Tokens generated.", L, registry=r)
        self.pc_queries = Counter("inferd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  L, registry=r)
        self.pc_hits = Counter("inferd:prefix_cache_hits", "Prompt tokens found in the prefix cache.", L,
                               registry=r)
        self.preemptions = Counter("inferd:num_preemptions", "Preemptions.", L, registry=r)
        self.requests = Counter("inferd:request_success", "Finished requests by reason.",
                                L + ["finished_reason"], registry=r)
        self.steps = Counter("inferd:engine_steps", "Engine steps (forward passes) run.", L, registry=r)
        # vLLM's: the adapters of running and waiting requests as labels, the value the time of the
        # reading (LoRA-aware routers, e.g. the Gateway API Inference Extension, read the newest series)
        self.lora_info = Gauge("inferd:lora_requests_info", "LoRA adapters of running and waiting requests.",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        # one series per route and dialect (OpenAI, Anthropic, Ollama) and status: which APIs are used
        self.http_requests = Counter("inferd:http_requests", "HTTP requests answered, by route, API dialect "
                                     "(openai, anthropic, ollama) and status.", ["route", "dialect", "status"],
                                     registry=r)
        self.cache_config = Gauge("inferd:cache_config_info", "KV cache configuration (value 1).",
                                  L + ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
                                  registry=r)
        self.computed = Counter("inferd:prompt_tokens_computed", "Prompt tokens this engine computed (not found in "
                                "the prefix cache, not pulled from a prefill worker).", L, registry=r)
        keys = ["queries", "hits", "preempt", "steps", "computed"]
        self.kv = None
        if kv_transfer:
            LC = L + ["connector"]
            self.kv = {
                "bytes": Counter("inferd:kv_transfer_bytes", "KV bytes pulled into this engine's pool.", LC,
                                 registry=r),
                "tokens": Counter("inferd:kv_transfer_tokens", "Prompt tokens whose KV was pulled.", LC, registry=r),
                "transfers": Counter("inferd:kv_transfers", "Completed KV pulls.", LC, registry=r),
                "failures": Counter("inferd:kv_transfer_failures", "KV pulls that failed (no answer, lease gone, "
                                    "wrong form).", LC, registry=r),
                "recomputes": Counter("inferd:kv_transfer_recomputes", "Requests whose prompt was recomputed here "
                                      "because their KV could not be pulled.", LC, registry=r),
                "bytes_sent": Counter("inferd:kv_transfer_bytes_sent", "KV bytes this producer sent over the "
                                      "network.", LC, registry=r),
                "leases": Counter("inferd:kv_leases", "Prompt KV leases this producer made.", LC, registry=r),
                "lease_confirmed": Counter("inferd:kv_lease_confirmed", "Leases freed on a consumer's "
                                           "confirmation.", LC, registry=r),
                "lease_expired": Counter("inferd:kv_lease_expiries", "Leases freed because no consumer confirmed "
                                         "them in time.", LC, registry=r),
            }
            self.kv_seconds = Histogram("inferd:kv_transfer_seconds", "Time of one KV pull (request to confirmed).",
                                        LC, buckets=LATENCY_BUCKETS, registry=r)
            self.kv_leased = Gauge("inferd:kv_leased_blocks", "KV blocks held under leases.", LC, registry=r)
            keys += ["kv_" + k for k in self.kv]
        self.tier = None
        if kv_tier:
            LT = L + ["medium"]
            self.tier = {
                "hits": Counter("inferd:kv_tier_hits", "Requests that loaded prompt blocks from the KV tier.", LT,
                                registry=r),
                "hit_tokens": Counter("inferd:kv_tier_loaded_tokens", "Prompt tokens whose KV was loaded from the KV "
                                      "tier instead of computed.", LT, registry=r),
                "loaded_bytes": Counter("inferd:kv_tier_loaded_bytes", "Bytes read from the KV tier into the pool.",
                                        LT, registry=r),
                "stored_blocks": Counter("inferd:kv_tier_stored_blocks", "Blocks this engine wrote to the KV tier.",
                                         LT, registry=r),
                "stored_bytes": Counter("inferd:kv_tier_stored_bytes", "Bytes this engine wrote to the KV tier.", LT,
                                        registry=r),
                "evicted_blocks": Counter("inferd:kv_tier_evicted_blocks", "Blocks this engine deleted from the KV "
                                          "tier to keep it under --kv-tier-size.", LT, registry=r),
                "store_errors": Counter("inferd:kv_tier_store_errors", "Blocks the KV tier could not write (a full "
                                        "disk, say): they stay in the pool only.", LT, registry=r),
                "store_skipped": Counter("inferd:kv_tier_store_skipped", "Blocks not written because too many "
                                         "writes were pending.", LT, registry=r),
            }
            self.tier_bad = Counter("inferd:kv_tier_bad_blocks", "Tier blocks found unusable and deleted, by reason "
                                    "(truncated, corrupt, mismatch): each a miss, computed instead.",
                                    LT + ["reason"], registry=r)
            self.tier_size = Gauge("inferd:kv_tier_size_bytes", "Bytes in the KV tier (this engine's view).", LT,
                                   registry=r)
            self.tier_seconds = Histogram("inferd:kv_tier_load_seconds", "Time to load one request's blocks from "
                                          "the KV tier.", LT, buckets=LATENCY_BUCKETS, registry=r)
            keys += ["tier_" + k for k in self.tier] + ["tier_" + k for k in ("truncated", "corrupt", "mismatch")]
        self.events = None
        if kv_events:
            self.events = {
                "batches": Counter("inferd:kv_events_published", "KV event batches published (one per step with "
                                   "events).", L, registry=r),
                "dropped": Counter("inferd:kv_events_dropped", "KV event batches dropped (publisher queue full).", L,
                                   registry=r),
                "blocks_stored": Counter("inferd:prefix_cache_blocks_stored", "Prefix blocks made findable "
                                         "(BlockStored events' hashes).", L, registry=r),
                "blocks_removed": Counter("inferd:prefix_cache_blocks_removed", "Findable blocks evicted from the "
                                          "pool (BlockRemoved events' hashes).", L, registry=r),
            }
            keys += ["ev_" + k for k in self.events]
        self.spec = None
        if speculative:
            self.spec = {
                "num_drafts": Counter("inferd:spec_decode_num_drafts", "Sequence-steps that verified guesses.", L,
                                      registry=r),
                "num_draft_tokens": Counter("inferd:spec_decode_num_draft_tokens", "Speculative tokens verified.",
                                            L, registry=r),
                "num_accepted_tokens": Counter("inferd:spec_decode_num_accepted_tokens",
                                               "Speculative tokens accepted.", L, registry=r),
                "num_emitted_tokens": Counter("inferd:spec_decode_num_emitted_tokens",
                                              "Tokens emitted by verify steps (accepted + the target's own).", L,
                                              registry=r),
                "draft_time": Counter("inferd:spec_decode_draft_time_seconds", "Time spent proposing.", L,
                                      registry=r),
                "verify_time": Counter("inferd:spec_decode_verify_time_seconds",
                                       "Time of target forwards that verified guesses, with acceptance.", L,
                                       registry=r),
                "num_verified_rows": Counter("inferd:spec_decode_num_verified_rows",
                                             "Rows of verify chunks (guesses + 1 each).", L, registry=r),
                "num_proposed_tokens": Counter("inferd:spec_decode_num_proposed_tokens",
                                               "Guesses the suffix proposer made, before the grammar and the cost "
                                               "model.", L, registry=r),
                "num_cost_skipped_tokens": Counter("inferd:spec_decode_num_cost_skipped_tokens",
                                                   "Guesses not verified: their expected acceptance did not pay for "
                                                   "their rows.", L, registry=r),
                "num_cost_skipped_drafts": Counter("inferd:spec_decode_num_cost_skipped_drafts",
                                                   "Sequence-steps whose whole draft the cost model skipped.", L,
                                                   registry=r),
                "num_grammar_cut_tokens": Counter("inferd:spec_decode_num_grammar_cut_tokens",
                                                  "Guesses cut before verification because the request's grammar "
                                                  "forbids them.", L, registry=r),
                "num_cache_drafts": Counter("inferd:spec_decode_num_cache_drafts",
                                            "Drafts taken from the shared cache of other requests' outputs.", L,
                                            registry=r),
            }
            self.spec_pos = Counter("inferd:spec_decode_num_accepted_tokens_per_pos",
                                    "Verify steps whose guess at this position was accepted.", L + ["position"],
                                    registry=r)
            self.spec_rate = Gauge("inferd:spec_decode_draft_acceptance_rate", "Accepted / proposed tokens.", L,
                                   registry=r)
            self.spec_len = Gauge("inferd:spec_decode_mean_accepted_length",
                                  "Mean accepted guesses per verify step.", L, registry=r)
            keys += list(self.spec)
        # the native paged attention kernels (csrc/cpu/attention_ops.cpp): proof of which path ran and how
        # much of it, per engine since its start
        self.attention = {
            "prefill_calls": Counter("inferd:attention_prefill_calls", "Prefill attention calls through the paged "
                                     "flash kernel (chunks x layers).", L, registry=r),
            "prefill_tiles": Counter("inferd:attention_prefill_tiles", "Query tile x key tile products the paged "
                                     "prefill attention computed.", L, registry=r),
            "decode_calls": Counter("inferd:attention_decode_calls", "Split-decode attention calls (steps x "
                                    "layers).", L, registry=r),
            "decode_splits": Counter("inferd:attention_decode_splits", "Key splits the split-decode attention "
                                     "computed and merged.", L, registry=r),
            "int8_rows": Counter("inferd:kv_cache_int8_rows_written", "K and V rows (a token's kv head each) "
                                 "quantized into an int8 KV cache.", L, registry=r),
        }
        keys += ["attn_" + k for k in self.attention]
        self._keys = keys
        self._last: dict[tuple[str, int], dict] = {}
        ML = ["model_name"]
        self.model_loaded = Gauge("inferd:model_loaded", "1 while the model is loaded, else 0.", ML, registry=r)
        self.model_loads = Counter("inferd:model_loads", "Times the model was loaded.", ML, registry=r)
        self.model_unloads = Counter("inferd:model_unloads", "Times the model was unloaded, by reason (keep_alive, "
                                     "evicted, api, failed).", ML + ["reason"], registry=r)
        self.model_load_time = Histogram("inferd:model_load_seconds", "Time to load the model (start of its engine "
                                         "to ready).", ML, buckets=LATENCY_BUCKETS, registry=r)
        self.model_weight_bytes = Gauge("inferd:model_weight_bytes", "Bytes the model's built layers hold (a GGUF's "
                                        "token table read in place from the file is not counted).", ML, registry=r)
        self.model_load_peak = Gauge("inferd:model_load_peak_rss_bytes", "The engine process's peak resident memory "
                                     "at the end of its load (mapped file pages counted).", ML, registry=r)
        self.dense_fallback = Gauge("inferd:dense_fallback_layers", "Projections served dense because their GGUF "
                                    "type has no kernel, by type.", ML + ["type"], registry=r)
        self.add_model(model_name, engines)

    def add_model(self, name: str, engines: int = 1):
        """Series for another model's engines (a server with several models: inferd.server.models)."""
        self.model_loaded.labels(model_name=name).set(0)
        self.model_loads.labels(model_name=name)
        for e in range(engines):  # every engine's series exist (at 0) before its first step
            self._last[(name, e)] = dict.fromkeys(self._keys, 0)
            lab = self.labels(e, name)
            for g in (self.running, self.waiting, self.kv_usage):
                g.labels(**lab).set(0)
            for c in (self.steps, self.prompt_tokens, self.gen_tokens, self.pc_queries, self.pc_hits, self.computed,
                      self.ttft, self.itl, self.e2e, self.queue):
                c.labels(**lab)

    def model_event(self, name: str, event: str, seconds: float | None = None, load: dict | None = None):
        """A model loaded (its engines' counters start again from 0; `load`: its load report) or unloaded
        (`event`: the reason)."""
        if event == "loaded":
            for key, gauge in (("weight_bytes", self.model_weight_bytes), ("peak_rss_bytes", self.model_load_peak)):
                if (load or {}).get(key) is not None:
                    gauge.labels(model_name=name).set(load[key])
            for kind, n in (load or {}).get("dense_fallback", {}).items():
                self.dense_fallback.labels(model_name=name, type=kind).set(n)
            self.model_loaded.labels(model_name=name).set(1)
            self.model_loads.labels(model_name=name).inc()
            if seconds is not None:
                self.model_load_time.labels(model_name=name).observe(seconds)
            for key in self._last:
                if key[0] == name:
                    self._last[key] = dict.fromkeys(self._keys, 0)
        elif event in ("keep_alive", "evicted", "api", "failed", "unloaded"):
            self.model_loaded.labels(model_name=name).set(0)
            self.model_unloads.labels(model_name=name, reason=event).inc()
            for key in self._last:
                if key[0] == name:
                    lab = self.labels(key[1], name)
                    for g in (self.running, self.waiting, self.kv_usage):
                        g.labels(**lab).set(0)

    def watch_store(self, store):
        """The Responses API's store: its size read at every scrape (it is bounded: store.py)."""
        r = self.registry
        Gauge("inferd:responses_store_entries", "Responses kept for previous_response_id and GET /v1/responses.",
              registry=r).set_function(lambda: len(store))
        Gauge("inferd:responses_store_bytes", "Bytes of the kept responses and their conversations (JSON).",
              registry=r).set_function(lambda: store.stats()["bytes"])
        Gauge("inferd:responses_store_evictions", "Responses evicted from the store (its bounds or time to live) "
              "since the start.", registry=r).set_function(lambda: store.evicted)

    def on_response(self, route: str, dialect: str, status: int):
        self.http_requests.labels(route=route, dialect=dialect, status=str(status)).inc()

    def labels(self, engine: int = 0, model: str | None = None) -> dict:
        return {"model_name": model or self.model_name, "engine": str(engine)}

    def cache_info(self, engine: int, block_size: int, num_blocks: int, dtype: str, prefix_caching: bool,
                   model: str | None = None):
        self.cache_config.labels(**self.labels(engine, model), block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                                 cache_dtype=dtype, enable_prefix_caching=str(bool(prefix_caching))).set(1)

    def on_step(self, snap, engine: int = 0, model: str | None = None):
        """After every engine step, with its EngineSnapshot: gauges and counter deltas."""
        lab, last = self.labels(engine, model), self._last[(model or self.model_name, engine)]
        self.running.labels(**lab).set(snap.running)
        self.waiting.labels(**lab).set(snap.waiting)
        self.kv_usage.labels(**lab).set(snap.kv_used / snap.kv_total)
        for key, now, counter in (("queries", snap.prefix_queries, self.pc_queries),
                                  ("hits", snap.prefix_hits, self.pc_hits),
                                  ("preempt", snap.preemptions, self.preemptions),
                                  ("steps", snap.steps, self.steps),
                                  ("computed", snap.prefill_tokens, self.computed)):
            if now > last[key]:
                counter.labels(**lab).inc(now - last[key])
            last[key] = now
        if self.kv is not None and snap.kv is not None:
            kl = {**lab, "connector": snap.kv["connector"]}
            _advance(self.kv, snap.kv, last, "kv_", kl)
            for secs in snap.kv["seconds"]:
                self.kv_seconds.labels(**kl).observe(secs)
            self.kv_leased.labels(**kl).set(snap.kv.get("leased_blocks", 0))
        t = getattr(snap, "tier", None)
        if self.tier is not None and t is not None:
            tl = {**lab, "medium": t["medium"]}
            _advance(self.tier, t, last, "tier_", tl)
            for reason in ("truncated", "corrupt", "mismatch"):
                _advance({reason: self.tier_bad}, t, last, "tier_", {**tl, "reason": reason})
            self.tier_size.labels(**tl).set(t["bytes"])
            for secs in t["seconds"]:
                self.tier_seconds.labels(**tl).observe(secs)
        if self.events is not None and snap.events is not None:
            now = {**snap.events, "blocks_stored": snap.blocks_stored, "blocks_removed": snap.blocks_removed}
            _advance(self.events, now, last, "ev_", lab)
        if getattr(snap, "attention", None) is not None:
            _advance(self.attention, snap.attention, last, "attn_", lab)
        lo = getattr(snap, "lora", None)
        if lo is not None:
            self.lora_info.clear()  # one series: the current sets
            self.lora_info.labels(max_lora=str(lo["max_loras"]), running_lora_adapters=",".join(lo["running"]),
                                  waiting_lora_adapters=",".join(lo["waiting"])).set(time.time())
        if self.spec is not None and snap.spec is not None:
            _advance(self.spec, snap.spec, last, "", lab)
            for j, n in enumerate(snap.spec.get("accepted_per_pos") or []):
                key = f"pos_{j}"
                grown = n - last.get(key, 0)
                if grown > 0:
                    self.spec_pos.labels(position=str(j), **lab).inc(grown)
                last[key] = n
            self.spec_rate.labels(**lab).set(snap.spec["acceptance_rate"])
            self.spec_len.labels(**lab).set(snap.spec["mean_accepted_length"])

    def on_finish(self, out, engine: int = 0, model: str | None = None):
        """Engine thread, for each finished sequence: its latencies from the engine's events."""
        lab = self.labels(engine, model)
        t = out.timings
        if out.index == 0:
            self.prompt_tokens.labels(**lab).inc(out.num_prompt_tokens)
        self.gen_tokens.labels(**lab).inc(out.num_output_tokens)
        self.requests.labels(finished_reason=out.finish_reason or "abort", **lab).inc()
        if t is None or out.finish_reason == "abort":  # an abort's latencies are when its client left
            return
        if t.ttft is not None:
            self.ttft.labels(**lab).observe(t.ttft)
        if t.queue_time is not None:
            self.queue.labels(**lab).observe(t.queue_time)
        if t.e2e is not None:
            self.e2e.labels(**lab).observe(t.e2e)
        for a, b in zip(t.token_times, t.token_times[1:]):
            self.itl.labels(**lab).observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.aliases)

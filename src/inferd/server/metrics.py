"""Prometheus metrics from the engine's own timing events, named as vLLM names them (inferd: prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self, model_name: str, speculative: bool = False):
        self.registry = r = CollectorRegistry()
        L = ["model_name"]
        self.labels = {"model_name": model_name}
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
        self._last = {"queries": 0, "hits": 0, "preempt": 0}
        self.spec = None
        if speculative:
            self.spec = {
                "num_drafts": Counter("inferd:spec_decode_num_drafts", "Sequence-steps that verified guesses.", L,
                                      registry=r),
                "num_draft_tokens": Counter("inferd:spec_decode_num_draft_tokens", "Speculative tokens proposed.",
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
            }
            self.spec_rate = Gauge("inferd:spec_decode_draft_acceptance_rate", "Accepted / proposed tokens.", L,
                                   registry=r)
            self.spec_len = Gauge("inferd:spec_decode_mean_accepted_length",
                                  "Mean accepted guesses per verify step.", L, registry=r)
            self._last.update({k: 0 for k in self.spec})

    def on_step(self, snap):
        """After every engine step, with its EngineSnapshot: gauges and counter deltas."""
        lab = self.labels
        self.running.labels(**lab).set(snap.running)
        self.waiting.labels(**lab).set(snap.waiting)
        self.kv_usage.labels(**lab).set(snap.kv_used / snap.kv_total)
        for key, now, counter in (("queries", snap.prefix_queries, self.pc_queries),
                                  ("hits", snap.prefix_hits, self.pc_hits),
                                  ("preempt", snap.preemptions, self.preemptions)):
            if now > self._last[key]:
                counter.labels(**lab).inc(now - self._last[key])
            self._last[key] = now
        if self.spec is not None and snap.spec is not None:
            for key, counter in self.spec.items():
                now = snap.spec[key]
                if now > self._last[key]:
                    counter.labels(**lab).inc(now - self._last[key])
                self._last[key] = now
            self.spec_rate.labels(**lab).set(snap.spec["acceptance_rate"])
            self.spec_len.labels(**lab).set(snap.spec["mean_accepted_length"])

    def on_finish(self, out):
        """Engine thread, for each finished sequence: its latencies from the engine's events."""
        lab = self.labels
        t = out.timings
        if out.index == 0:
            self.prompt_tokens.labels(**lab).inc(out.num_prompt_tokens)
        self.gen_tokens.labels(**lab).inc(len(out.output_ids))
        self.requests.labels(finished_reason=out.finish_reason or "abort", **lab).inc()
        if t is None:
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
        return generate_latest(self.registry)

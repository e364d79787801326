"""LLMEngine.step(): schedule -> run the model -> sample -> append, stop, free.

The engine's boundary is message-shaped: `add_request` takes a request in, `step` returns
RequestOutput messages (the tokens each request gained this step). `LLM` wraps it for offline use;
the server drives the same loop from its own thread.
"""
from __future__ import annotations

import copy
import itertools
import logging
import os
import time

import torch

from inferd.config import EngineConfig, available_memory_bytes, lora_module
from inferd.distributed.comm import CollectiveError
from inferd.engine.client import EngineInfo
from inferd.engine.interface import Engine
from inferd.engine.kv_cache import BlockManager
from inferd.engine.output import detokenize, record_token
from inferd.engine.processor import check_request
from inferd.engine.request import Request, RequestOutput, SamplingParams, Status
from inferd.engine.sampler import build_batch, sample, top_logprobs
from inferd.engine.scheduler import ScheduledBatch, Scheduler
from inferd.engine.state import STEP_HISTORY, History, engine_state
from inferd.engine.stats import EngineSnapshot, EngineStats, StepStats  # noqa: F401  (re-exported)
from inferd.engine.structured import advance
from inferd.errors import InferdError
from inferd.faults import Faults
from inferd.gguf_file import default_model_path
from inferd.model.config import attention_scale, attention_windows
from inferd.worker.attention import PagedAttention
from inferd.worker.kv_pool import KVPool, kv_cache_dtype, kv_layout
from inferd.worker.runner import ModelRunner
from inferd.worker.spec_attention import SpecPagedAttention

log = logging.getLogger("inferd")

CPU_KV_DEFAULT_FRACTION = 0.2
CPU_KV_DEFAULT_CAP = 2 * 1024**3


class LLMEngine(Engine):
    def __init__(self, config: EngineConfig | None = None, loaded=None, draft_loaded=None, **overrides):
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise InferdError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        self.config = cfg.validate()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tp = None  # TensorParallelGroup: rank 0's end, when the model is split over ranks
        if cfg.tensor_parallel_size > 1:
            if loaded is not None:
                raise InferdError("tensor parallelism loads the model on every rank: pass a model path, not a loaded model")
            from inferd.distributed.tp_group import TensorParallelGroup

            self.tp = TensorParallelGroup(cfg, cfg.tensor_parallel_size)
        try:
            self._build(cfg, loaded, draft_loaded)
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise

    def _build(self, cfg: EngineConfig, loaded, draft_loaded):
        if loaded is None:
            from inferd.loading.loader import load_model

            loaded = load_model(cfg.load_config(), shard=self.tp.shard if self.tp is not None else None)
        self.loaded = loaded
        if getattr(loaded.model, "encoder", False):
            raise InferdError(f"{loaded.config.architecture} is an encoder (embedding) model: it runs with "
                              "--runner pooling (or auto), not generate")
        self.load_report = dict(getattr(loaded, "report", None) or {})  # how the load went (loading.report)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.model_config = mcfg
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise InferdError(f"max_model_len {self.max_model_len} exceeds the model's context "
                              f"length {mcfg.max_position_embeddings}")
        kv_dtype = self._kv_dtype()
        # under tensor parallelism, this rank's KV heads (the pool of every rank has the same blocks)
        n_kv = self.model.layers[0].n_kv if self.tp is not None else mcfg.num_key_value_heads
        window = attention_windows(mcfg, self.max_model_len)
        # sliding-window and full layers in KV groups of their own (Gemma 2/3): window blocks go back
        layout = kv_layout(window, mcfg.num_hidden_layers)
        self.kv_layout = layout
        per_block = KVPool.bytes_per_block(layout.group_size, cfg.block_size, n_kv, mcfg.head_dim, kv_dtype)
        num_blocks = cfg.num_kv_blocks or max(1, self._kv_bytes() // per_block - (layout.num_groups > 1))
        from inferd.distributed.kv_transfer import parse_kv_transfer_config
        from inferd.distributed.kv_transfer.transfer import KVTransfer

        kv_cfg = parse_kv_transfer_config(cfg.kv_transfer_config, cfg.role)
        shared = kv_cfg is not None and kv_cfg.producer and kv_cfg.kv_connector == "SharedMemoryConnector"
        if kv_cfg is not None and layout.num_groups > 1:
            raise InferdError("disaggregated prefill/decode does not carry sliding-window KV groups yet "
                              f"({mcfg.architecture}): serve this model without --kv-transfer-config")
        # with KV groups, one more block: NULL, where a window group's released blocks point
        self.pool = KVPool(layout.group_size, num_blocks + (layout.num_groups > 1), cfg.block_size, n_kv,
                           mcfg.head_dim, kv_dtype, self.model.device, shared=shared)
        self._fit_context(cfg, num_blocks)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          layout.extra_windows)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.scheduling)
        # with speculation, verify chunks (k + 1 query rows) go through the decode kernel as single rows
        attention = SpecPagedAttention if cfg.speculative_method is not None else PagedAttention
        if self.tp is not None:
            self.tp.setup({"num_blocks": num_blocks, "block_size": cfg.block_size, "window": window,
                           "kv_dtype": str(kv_dtype).replace("torch.", ""),
                           "speculative": cfg.speculative_method is not None})
        self.lora = None  # LoRAManager (inferd.worker.lora), with --enable-lora
        if cfg.enable_lora:
            from inferd.worker.lora import LoRAManager

            shard = None
            if self.tp is not None:  # rank 0's share of each adapter, as of its layers
                from inferd.distributed.tensor_parallel import shard_lora, shard_of

                mine = shard_of(mcfg, 0, cfg.tensor_parallel_size)
                shard = lambda w: shard_lora(w, mine, mcfg)  # noqa: E731
            self.lora = LoRAManager(self.model, mcfg, cfg.max_loras, cfg.max_lora_rank, shard)
            for spec in cfg.lora_modules or []:
                name, path = lora_module(spec)
                self.lora.add(name, path)
            self.scheduler.max_loras = cfg.max_loras
        # verify chunks of every length the configuration allows (k + 1 rows) go through the decode kernel
        rows = {"max_rows": cfg.num_speculative_tokens + 1} if cfg.speculative_method is not None else {}
        self.runner = ModelRunner(self.model, attention(self.pool, mcfg.head_dim, window, scale=attention_scale(mcfg),
                                                        layout=layout, softcap=mcfg.attn_logit_softcapping, **rows),
                                  cfg.enforce_eager,
                                  comm=self.tp.comm if self.tp is not None else None, lora=self.lora)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, set[str]] = {}  # client request id -> live sequence ids
        self.stats = EngineStats()
        self.faults = Faults()
        # process-wide counters of the CPU attention kernels: this engine counts from here (none on a GPU,
        # where loading them would only compile CPU code)
        self._attention_base = None
        if self.model.device.type == "cpu":
            from inferd.kernels import native

            self._attention_base = native.attention_counters()
        self.keep_history = False  # the whole step history (tests); the dashboard's ring is always kept
        self.history = History()
        self.aborted: list[RequestOutput] = []  # see take_aborted
        self._ids = itertools.count()
        self.eos_ids = set(self.tokenizer.eos_token_ids) if self.tokenizer else (
            {mcfg.eos_token_id} if isinstance(mcfg.eos_token_id, int) else set(mcfg.eos_token_id or []))
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB (%s), %s%s", num_blocks, cfg.block_size,
                 num_blocks * per_block / 2**20, self._kv_dtype_why(kv_dtype), self._kv_size_why(),
                 f": up to {num_blocks * cfg.block_size} tokens in flight" if layout.num_groups == 1 else
                 f"; {layout.num_groups} KV groups of {layout.group_size} layers (windows {list(layout.windows)})")
        self._kv_beyond_pool(cfg, layout)
        self.kv = None  # KVTransfer: this engine's end of disaggregated prefill/decode
        if kv_cfg is not None:
            if cfg.speculative_method == "draft" and kv_cfg.consumer:
                raise InferdError("a KV consumer cannot run a draft model (the draft has no KV of a pulled prompt): "
                                  "use --speculative-method ngram")
            self.kv = KVTransfer(self, kv_cfg)
        self.structured = None  # MaskPrefetch over Grammars: made by the first constrained request
        self.spec = None
        if cfg.speculative_method is not None:
            from inferd.engine.speculative.decoder import SpecDecoder

            self.spec = SpecDecoder(self, draft_loaded)
            log.info("speculative decoding: %s, %d tokens%s", cfg.speculative_method, cfg.num_speculative_tokens,
                     f" (draft: {self.spec.draft_desc})" if self.spec.draft_desc else "")

    def _kv_beyond_pool(self, cfg: EngineConfig, layout):
        """The KV tier (--kv-tier) and the KV events publisher (--kv-events-config), both fed by the
        block manager, the one place blocks are born and die."""
        from inferd.distributed.kv_events import EventLog, EventPublisher, parse_kv_events_config

        bm = self.block_manager
        ev = parse_kv_events_config(cfg.kv_events_config)
        self.publisher = None
        if ev is not None:
            bm.events = EventLog()
            rank = cfg.data_parallel_rank
            self.publisher = EventPublisher(ev.for_rank(rank or 0), rank)
        self.tier = None
        if cfg.kv_tier is not None:
            if layout.num_groups > 1:
                raise InferdError(f"--kv-tier does not keep sliding-window KV groups yet ({self.model_config.architecture}): "
                                  "serve this model without --kv-tier")
            from inferd.engine.kv_tier import KVTier, fingerprint_fields

            bm.new_blocks = []
            self.tier = KVTier(self.pool, bm, fingerprint_fields(self), cfg.kv_tier, cfg.kv_tier_size,
                               events=ev is not None)
            self.scheduler.tier = self.tier

    def _after_step(self):
        """What the block manager logged this step: blocks for the tier to write, events to publish."""
        bm = self.block_manager
        if self.tier is not None:
            self.tier.write_through(bm.take_new_blocks())
        if self.publisher is not None:
            events = bm.events.take()
            if self.tier is not None:
                events += self.tier.take_events()
            self.publisher.publish(events)

    def info(self) -> EngineInfo:
        """What a client of this engine knows of it (inferd.engine.client)."""
        return EngineInfo(self.loaded.source.name, self.tokenizer, self.max_model_len, self.model_config.vocab_size,
                          self.spec is not None, os.getpid(), self.cache_info(),
                          architecture=self.model_config.architecture, model_path=self.loaded.source.path, load=self.load_report)

    def tokenizer_path(self) -> str | None:
        """The file another process loads this engine's tokenizer from (None: no tokenizer)."""
        if self.tokenizer is None:
            return None
        src = self.loaded.source
        return src.path if src.kind != "builtin" else default_model_path()

    def cache_info(self) -> dict:
        """The KV cache's configuration, as vLLM's cache_config_info labels it."""
        return {"block_size": self.config.block_size, "num_blocks": self.block_manager.num_blocks,
                "dtype": str(self._kv_dtype()).replace("torch.", ""),
                "prefix_caching": self.config.enable_prefix_caching}

    def _kv_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.config.kv_cache_dtype, self.model.dtype)

    def _fit_context(self, cfg: EngineConfig, num_blocks: int) -> None:
        """A context the KV cache can hold: with no --max-model-len, a model's declared context
        (Llama 3.1's 131,072) is clamped to the tokens the pool holds, in one line, as llama.cpp
        and Ollama size their context by default."""
        capacity = num_blocks * cfg.block_size
        if cfg.max_model_len is not None or cfg.num_kv_blocks is not None or self.max_model_len <= capacity:
            return
        log.info("max_model_len %d (the model's context) clamped to %d, what the KV cache holds: "
                 "--kv-cache-memory or --max-model-len set it", self.max_model_len, capacity)
        self.max_model_len = capacity

    def _kv_dtype_why(self, kv_dtype) -> str:
        name = str(kv_dtype).replace("torch.", "")
        if kv_dtype == torch.int8:
            from inferd.worker.kv_pool import row_width

            hd = self.model_config.head_dim
            return (f"int8: --kv-cache-dtype; {hd} int8 codes and an fp16 scale per 32 values, "
                    f"{row_width(torch.int8, hd) / hd:.4g} bytes a value")
        if self.config.kv_cache_dtype != "auto":
            return f"{name}: --kv-cache-dtype"
        # the activations' dtype: bf16 where the model computes in bf16 (--dtype auto on a CPU with
        # AVX512-BF16); float32 under int8 activations, whose paged attention measured faster on a
        # float32 cache than on a bf16 one (docs/quantization.md)
        return f"{name}: the model's activations, --kv-cache-dtype auto"

    def _kv_size_why(self) -> str:
        cfg = self.config
        if cfg.num_kv_blocks:
            return "num_kv_blocks"
        if cfg.kv_cache_memory:
            return "--kv-cache-memory"
        if self.model.device.type == "cuda":
            return f"--gpu-memory-utilization {cfg.gpu_memory_utilization}"
        return (f"the CPU default: {CPU_KV_DEFAULT_FRACTION:.0%} of available memory, at most "
                f"{CPU_KV_DEFAULT_CAP / 2**30:.0f} GiB (--kv-cache-memory sets it)")

    def _kv_bytes(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory:
            return int(cfg.kv_cache_memory)
        if self.model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            used_by_others = total - free
            return max(0, int(total * cfg.gpu_memory_utilization) - used_by_others)
        return int(min(CPU_KV_DEFAULT_CAP, CPU_KV_DEFAULT_FRACTION * available_memory_bytes()))

    # -- requests -------------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival: float | None = None,
                    kv_transfer_params: dict | None = None, lora: str | None = None) -> str:
        params = params or SamplingParams()
        if lora is not None:
            if self.lora is None:
                raise InferdError(f"LoRA adapter {lora!r} asked of an engine without adapters (--enable-lora)")
            self.lora.check(lora)
        prompt_ids = check_request(prompt, params, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                   self.config.block_size, self.num_kv_blocks, self.kv_layout.extra_windows,
                                   self.config.max_num_batched_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.groups:
            raise InferdError(f"duplicate request id {rid!r}")
        kind, remote = None, None
        if kv_transfer_params is not None:
            if self.kv is None:
                raise InferdError("kv_transfer_params need a server started with --kv-transfer-config or --role")
            kind, remote = self.kv.parse(kv_transfer_params, prompt_ids, params)
        req = Request(rid, prompt_ids, params, arrival)
        req.lora = lora
        if params.structured_outputs is not None:
            req.matcher = self.grammars().matcher(params.structured_outputs)
        if params.num_samples > 1:
            req.fork_into = params.num_samples
        self._attach(req)
        if kind == "import":
            req.remote = remote
            self.kv.start_import(req)
        else:
            req.kv_export = kind == "export"
            self.scheduler.add(req)
        return rid

    def control(self, op: str, **args):
        """An operator's command between two steps: load_lora(name, path), unload_lora(name) (refused
        while a live request uses the adapter: nothing in flight is dropped), list_loras()."""
        from inferd.errors import Busy

        if op in ("load_lora", "unload_lora", "list_loras") and self.lora is None:
            raise InferdError("this model is served without LoRA adapters: start it with --enable-lora")
        if op == "load_lora":
            ad = self.lora.add(args.get("name"), args.get("path"))
            if self.tp is not None:  # every rank holds its share of every adapter
                self.tp.comm.send_obj(("lora", "add", ad.name, args.get("path")))
            return {"name": ad.name, "rank": ad.rank}
        if op == "unload_lora":
            name = args.get("name")
            self.lora.check(name)
            using = sum(1 for r in self.requests.values() if r.lora == name)
            if using:
                raise Busy(f"LoRA adapter {name!r} has {using} requests in flight: not unloaded")
            self.lora.remove(name)
            if self.tp is not None:
                self.tp.comm.send_obj(("lora", "remove", name, None))
            return {"name": name}
        if op == "list_loras":
            return sorted(self.lora.adapters)
        raise InferdError(f"unknown engine command {op!r}")

    def grammars(self):
        """The llguidance side of structured output, built on first use (its tokenizer bridge costs
        ~0.7 s, paid only by servers that are sent constraints)."""
        if self.structured is None:
            from inferd.engine.structured import Grammars, MaskPrefetch

            self.structured = MaskPrefetch(Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids),
                                           overlap=True if self.model.device.type == "cuda" else None)
        return self.structured.grammars

    def housekeeping(self) -> bool:
        """Work outside steps (KV leases to free, pulled KV to admit); the serving loops call it
        when idle too. True if anything changed."""
        changed = self.kv.housekeeping() if self.kv is not None else False
        self._after_step()
        return changed

    def close(self):
        if self.tier is not None:
            self.tier.close()  # its queued writes finish: their events go out below
        if self.publisher is not None:
            self._after_step()
            self.publisher.close()
        if self.structured is not None:
            self.structured.close()
        if self.kv is not None:
            self.kv.close()
        if self.tp is not None:
            self.tp.close()

    def _attach(self, req: Request):
        self.requests[req.request_id] = req
        self.groups.setdefault(req.group, set()).add(req.request_id)
        if self.tokenizer is not None:
            from inferd.tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=req.params.skip_special_tokens)
        if req.params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None]

    def _detach(self, req: Request):
        if req.finished:
            self.history.finish(req)
        self.requests.pop(req.request_id, None)
        g = self.groups.get(req.group)
        if g is not None:
            g.discard(req.request_id)
            if not g:
                del self.groups[req.group]

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its n samples); its blocks are freed at once."""
        ids = list(self.groups.get(request_id, ()))
        if not ids:
            return False
        now = time.monotonic()
        for rid in ids:
            req = self.requests[rid]
            if self.kv is None or not self.kv.abort(req):
                self.scheduler.remove(req)
            req.status = Status.FINISHED
            req.finish_reason = "abort"
            req.timings.finished = now
            self._detach(req)
            self.aborted.append(RequestOutput(req.group, [], list(req.output_ids), True, "abort", None, req.num_prompt,
                                              req.timings, index=req.index, num_output_tokens=len(req.output_ids)))
        if self.spec is not None:
            self.spec.release_finished()
        return True

    def snapshot(self) -> EngineSnapshot:
        bm = self.block_manager
        kv = self.kv.snapshot() if self.kv is not None else None
        lora = None
        if self.lora is not None:
            sched = self.scheduler
            lora = {"running": sorted({r.lora for r in sched.running if r.lora is not None}),
                    "waiting": sorted({r.lora for r in sched.waiting if r.lora is not None}),
                    "max_loras": self.lora.max_loras}
        tier = self.tier.snapshot() if self.tier is not None else None
        events = None
        if self.publisher is not None:
            events = {"batches": self.publisher.published, "dropped": self.publisher.dropped}
        return EngineSnapshot(len(self.scheduler.running), self.num_waiting(), bm.num_used, bm.num_blocks,
                              bm.queries, bm.hits, self.stats.preemptions, self.spec_counters(), self.stats.steps, kv,
                              self.stats.prefill_tokens, lora, tier, events, bm.stored, bm.removed,
                              attention=self.attention_counters())

    def attention_counters(self) -> dict | None:
        """The native attention kernels' counters since this engine was built (they are process-wide)."""
        if self._attention_base is None:
            return None
        from inferd.kernels import native

        now = native.attention_counters()
        return {k: v - self._attention_base[k] for k, v in now.items()}

    def num_waiting(self) -> int:
        """Queued requests, with those whose prompt KV is still on its way from a producer."""
        pulls = self.kv is not None and self.kv.connector is not None
        loading = len(self.tier.loading) if self.tier is not None else 0
        return len(self.scheduler.waiting) + loading + (len(self.kv.blocked) + len(self.kv.pending) if pulls else 0)

    def spec_counters(self) -> dict | None:
        if self.spec is None:
            return None
        st = self.spec.stats
        spec = {k: getattr(st, k) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                            "num_emitted_tokens", "draft_time", "verify_time", "num_verified_rows",
                                            "num_proposed_tokens", "num_cost_skipped_tokens",
                                            "num_cost_skipped_drafts", "num_grammar_cut_tokens", "num_cache_drafts",
                                            "num_budget_cut_tokens", "num_cost_probes",
                                            "num_explored", "num_skipped")}
        spec.update(acceptance_rate=st.acceptance_rate, mean_accepted_length=st.mean_accepted_length,
                    accepted_per_pos=list(st.accepted_per_pos), method=self.spec.method)
        return spec

    def state(self, steps: int = STEP_HISTORY) -> dict:
        """What the dashboard shows of this engine (inferd.engine.state); call between steps."""
        return engine_state(self, steps)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.kv is not None and self.kv.busy())

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs = self._step()
        self._after_step()
        return self.take_aborted() + outs if self.aborted else outs

    def take_aborted(self) -> list[RequestOutput]:
        """The finished outputs of requests aborted since the last call: nobody reads their streams any
        more, but the metrics count them (finish reason "abort", the tokens they got)."""
        out, self.aborted = self.aborted, []
        return out

    def _step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        if self.kv is not None:
            self.kv.housekeeping()
        spec = self.spec
        if spec is not None:
            spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if spec is not None:
            spec.after_schedule(batch)
        if not batch.requests:
            if self.tier is not None and self.tier.busy():  # prompts loading from the tier: they will run
                self.tier.wait(0.005)
                return []
            if self.kv is not None and (self.kv.busy() or self.kv.leased_blocks()):
                # KV on its way, or blocks held by leases a consumer will confirm (or that will
                # expire): nothing can run now, but something will
                self.kv.wait(0.005)
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("scheduler cannot admit any request (KV cache too small?)")
            return []
        t_fwd = time.monotonic()
        if self.structured is not None:  # the next tokens' masks, computed while the model runs
            self.structured.start([r for r, n in zip(batch.requests, batch.num_new)
                                   if r.matcher is not None and r.num_computed + n - len(r.spec_tokens) == r.num_tokens])
        try:
            self.faults.hit("forward")
            logits, idx, prompt_rows = self.runner.execute(batch.requests, batch.num_new)
        except CollectiveError:  # a tensor-parallel rank is gone: the engine cannot go on
            raise
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the engine goes on
            if self.tp is not None:  # rank 0 failed mid-step: its ranks are out of step
                raise CollectiveError(f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}") from e
            if self.structured is not None:
                self.structured.wait()
            return self._fail(batch.requests, e, "the forward pass")
        t_forward = time.monotonic() - t_fwd
        if self.structured is not None:
            self.structured.wait()
        outputs: list[RequestOutput] = []
        if spec is not None and any(batch.requests[i].spec_tokens for i in idx):
            logits, idx, verified = self._split_spec_rows(batch, logits, idx)
        else:
            verified = []
        for req, n in zip(batch.requests, batch.num_new):
            if req.spec_tokens:
                continue  # its computed length is known only once its guesses are verified
            req.num_computed += n
            req.max_computed = max(req.max_computed, req.num_computed)
            self.block_manager.register_full_blocks(req)
        for i, (first, rows) in prompt_rows.items():
            try:
                self._prompt_logprobs(batch.requests[i], first, rows)
            except Exception as e:  # noqa: BLE001
                outputs.extend(self._fail([batch.requests[i]], e, "prompt logprobs"))
        if verified:
            try:
                outputs.extend(spec.verify(verified))
            except Exception as e:  # noqa: BLE001
                outputs.extend(self._fail([r for r, _ in verified], e, "verifying speculative tokens"))
            spec.stats.verify_time += time.monotonic() - t_fwd
        keep = [(j, batch.requests[i]) for j, i in enumerate(idx) if not batch.requests[i].finished]
        forks = [r for _, r in keep if r.fork_into]
        if forks:
            keep = [(j, r) for j, r in keep if not r.fork_into]
            for parent in forks:
                self._fork(parent)
        if keep:
            reqs = [r for _, r in keep]
            rows = [j for j, _ in keep]
            if rows != list(range(logits.shape[0])):  # a copy of [rows, vocab] only when some row left
                logits = logits[rows]
            for req, tok, lp in self._sample(reqs, logits, outputs):
                try:
                    outputs.append(self._append(req, tok, time.monotonic(), lp))
                except Exception as e:  # noqa: BLE001 - detokenizing, stop strings: this request only
                    outputs.extend(self._fail([req], e, "output processing"))
        self.stats.sample_events += len(outputs)
        if spec is not None:
            spec.release_finished()
        dt = time.monotonic() - t0
        if spec is not None:
            spec.observe_step(dt, t_forward, sum(batch.num_new))
        self._record(batch, dt)
        return outputs

    def _sample(self, reqs: list[Request], logits: torch.Tensor, outputs: list):
        """(request, token, logprob entry) for each request. Sampling is batched; if the batch
        fails, each request is sampled alone so that only the one at fault fails."""
        try:
            self.faults.hit("sample")
            b = build_batch(reqs, self.model_config.vocab_size, self.eos_ids)
            if self.structured is not None:
                b.allowed = self.constraint_masks(reqs)
            tokens, lps = sample(logits, b)
            return [(r, t, lps[j] if lps else None) for j, (r, t) in enumerate(zip(reqs, tokens.tolist()))]
        except Exception as e:  # noqa: BLE001
            if len(reqs) == 1:
                outputs.extend(self._fail(reqs, e, "sampling"))
                return []
        out = []
        for j, r in enumerate(reqs):
            out.extend(self._sample([r], logits[j:j + 1], outputs))
        return out

    def constraint_masks(self, reqs, rows_each=None) -> tuple | None:
        """Structured output: (row indices, bool [r, vocab]) for the logits rows of constrained
        requests; rows_each[i] rows per request (1 + its guesses when verifying, else 1)."""
        self.structured.inline += self.structured.fill(reqs)  # what the forward did not overlap, at once
        idx, masks = [], []
        off = 0
        for i, r in enumerate(reqs):
            n = rows_each[i] if rows_each else 1
            if r.matcher is not None:
                idx.extend(range(off, off + n))
                masks.append(self.structured.masks_for(r)[:n])
            off += n
        return (torch.tensor(idx), torch.cat(masks)) if idx else None

    def _fail(self, reqs: list[Request], e: BaseException, where: str) -> list[RequestOutput]:
        """End these sequences with an error (their blocks freed), logged once with its traceback.
        Blocks are registered in the prefix cache only after a forward succeeds, so nothing a failed
        step wrote can be found by a later request."""
        reqs = [r for r in reqs if not r.finished]
        log.error("%s failed for %d sequence(s) (%s); they end with an error, the engine goes on",
                  where, len(reqs), ", ".join(r.request_id for r in reqs[:8]), exc_info=e)
        msg = f"{where} failed: {type(e).__name__}: {e}"
        now = time.monotonic()
        outs = []
        for req in reqs:
            self.scheduler.remove(req)
            req.status = Status.FINISHED
            req.finish_reason = "error"
            req.timings.finished = now
            self._detach(req)
            outs.append(RequestOutput(req.group, [], req.output_ids, True, "error", None, req.num_prompt,
                                      req.timings, error=msg, index=req.index, num_output_tokens=len(req.output_ids)))
        if self.spec is not None:
            self.spec.release_finished()
        self.stats.failed += len(outs)
        return outs

    def _split_spec_rows(self, batch: ScheduledBatch, logits: torch.Tensor, idx: list[int]):
        """Separate the k + 1 logits rows of each sequence verifying guesses from the one-row rest."""
        keep, keep_idx, verified = [], [], []
        off = 0
        for i in idx:
            req = batch.requests[i]
            m = 1 + len(req.spec_tokens)
            if req.spec_tokens:
                verified.append((req, logits[off:off + m]))
            else:
                keep.append(off)
                keep_idx.append(i)
            off += m
        return logits[keep], keep_idx, verified

    def append_tokens(self, req: Request, toks: list[int], lps=None) -> RequestOutput:
        """Append tokens in order through the usual stop handling; what follows a stop is dropped.
        One RequestOutput carries them all."""
        now = time.monotonic()
        outs = []
        for j, tok in enumerate(toks):
            outs.append(self._append(req, tok, now, lps[j] if lps else None))
            if req.finished:
                break
        o = outs[-1]
        if len(outs) > 1:
            o.new_token_ids = [t for x in outs for t in x.new_token_ids]
            o.text_delta = "".join(x.text_delta for x in outs)
            o.logprobs = [lp for x in outs for lp in x.logprobs] if lps else None
            o.prompt_logprobs = outs[0].prompt_logprobs
            o.prompt_ids = outs[0].prompt_ids
        return o

    def _prompt_logprobs(self, req: Request, first: int, rows: torch.Tensor):
        """rows[j] are the logits at prompt position first + j, which predict token first + j + 1."""
        if req.prompt_logprobs is None or len(req.prompt_logprobs) != first + 1:
            return  # recomputed after a preemption: already recorded
        targets = torch.tensor(req.prompt_ids[first + 1: first + 1 + rows.shape[0]])
        info = top_logprobs(rows, targets, [req.params.prompt_logprobs] * rows.shape[0])
        req.prompt_logprobs.extend(info)

    def _fork(self, parent: Request):
        """A request for n > 1 samples has computed its prompt once: split it into n sequences
        that share its full prompt blocks (ref counts) and recompute only the partial tail block,
        so no sequence ever writes into a shared block."""
        bm = self.block_manager
        bs = self.config.block_size
        keep_blocks = (parent.num_computed - 1) // bs  # at least one token left for each child
        sched = self.scheduler
        for i in range(parent.fork_into):
            params = copy.copy(parent.params)
            params.n, params.best_of = 1, None
            child = Request(f"{parent.request_id}#{i}", parent.prompt_ids, params, parent.timings.arrived,
                            group=parent.group, index=i)
            child.timings.first_scheduled = parent.timings.first_scheduled
            child.lora = parent.lora
            bm.fork(parent, child, keep_blocks)
            if parent.matcher is not None:
                child.matcher = parent.matcher.deep_copy()
            child.max_computed = parent.max_computed
            child.prefix_hit_tokens = parent.prefix_hit_tokens
            child.remote_tokens = parent.remote_tokens
            child.status = Status.RUNNING
            child.num_prefill_chunks = parent.num_prefill_chunks
            self._attach(child)
            if parent.prompt_logprobs is not None:
                child.prompt_logprobs = parent.prompt_logprobs if i == 0 else None
            sched.running.append(child)
            sched.static_batch.add(child.request_id) if sched.mode == "static" else None
        sched.remove(parent)
        self._detach(parent)
        parent.status = Status.FINISHED
        self.stats.forks += 1

    def _append(self, req: Request, tok: int, now: float, lp=None) -> RequestOutput:
        record_token(req, tok, now, lp, self.eos_ids, self.max_model_len)
        self.stats.generated_tokens += 1
        if req.matcher is not None:
            advance(req, tok)
        if req.detok is not None:
            self.faults.hit("detokenize")
            delta = detokenize(req, tok)
        else:
            delta = ""
        kv_params = None
        if req.finish_reason is not None:
            req.status = Status.FINISHED
            req.timings.finished = now
            if req.kv_export:
                kv_params = self.kv.export(req)  # its prompt blocks stay, leased to a consumer
            else:
                self.scheduler.remove(req)
            self._detach(req)
        first = len(req.output_ids) == 1
        return RequestOutput(req.group, [tok], req.output_ids, req.finished, req.finish_reason,
                             req.stop_reason, req.num_prompt, req.timings, index=req.index, text_delta=delta,
                             logprobs=[lp] if lp is not None else None,
                             prompt_logprobs=req.prompt_logprobs if first else None,
                             prompt_ids=req.prompt_ids if first else None, kv_transfer_params=kv_params,
                             num_cached_tokens=req.prefix_hit_tokens + req.remote_tokens if req.finished else 0,
                             num_output_tokens=len(req.output_ids))

    def _record(self, batch: ScheduledBatch, dt: float):
        s = self.stats
        s.steps += 1
        s.fused_steps = self.runner.fused_steps  # the runner alone knows which path a forward took
        s.eager_decode_steps = self.runner.eager_decode_steps
        s.prefill_tokens += batch.num_prefill_tokens
        s.decode_tokens += batch.num_decode_tokens
        s.recompute_tokens += batch.num_recompute_tokens
        s.preemptions += len(batch.preempted)
        n = len(batch.requests)
        s.max_batch_seqs = max(s.max_batch_seqs, n)
        if batch.num_prefill_tokens + batch.num_recompute_tokens and batch.num_decode_tokens:
            s.max_mixed_batch_seqs = max(s.max_mixed_batch_seqs, n)
        used = self.block_manager.num_used
        s.peak_kv_blocks = max(s.peak_kv_blocks, used)
        for req, k in zip(batch.requests, batch.num_new):
            if req.num_computed <= req.num_prompt and req.num_preemptions == 0 and k > 0:
                req.num_prefill_chunks += 1
                s.max_prefill_chunks = max(s.max_prefill_chunks, req.num_prefill_chunks)
        self.history.step(s.steps, n, batch.num_prefill_tokens, batch.num_decode_tokens, batch.num_recompute_tokens,
                          len(batch.preempted), used, dt)
        if self.keep_history:
            s.history.append(StepStats(n, batch.num_prefill_tokens, batch.num_decode_tokens,
                                       batch.num_recompute_tokens, len(batch.preempted), used, dt))


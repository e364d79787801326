"""Batch -> tensors -> forward -> logits: the only place the scheduler's plan meets the model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from inferd.model import fused_decode
from inferd.model.llama import LlamaModel
from inferd.worker.attention import PagedAttention

log = logging.getLogger("inferd")


@dataclass
class StepPlan:
    """One step as the model sees it: picklable, so that rank 0 can hand it to the other ranks of a
    tensor-parallel group, which run exactly the same forward."""
    ids: list[int]
    block_tables: list[list[int]]
    starts: list[int]
    num_new: list[int]
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    sample_idx: list[int]  # their requests' batch indices
    prompt_spans: dict = field(default_factory=dict)  # batch index -> (first prompt position, row a, row b)
    kv_tables: list | None = None  # per request, its tables of KV groups 1.. (sliding-window layers)
    lora_slots: list[int] | None = None  # per request its LoRA slot (-1: none); None: no adapter in the step
    lora_writes: list | None = None  # (slot, adapter) written for this step: the other ranks repeat them
    # per request: its chunk is its last known token and its guesses (the attention may take those rows
    # as decode rows); None (a plan made elsewhere, one row a sequence): every short chunk may
    verify: list[bool] | None = None


class ModelRunner:
    def __init__(self, model: LlamaModel, attention: PagedAttention, enforce_eager: bool = False, comm=None,
                 lora=None):
        self.model = model
        # LoRA adapters (inferd.worker.lora.LoRAManager, handed in): each step's rows -> slots; the
        # model's WithLoRA wrappers and the fused step add the deltas
        self.lora = lora
        self.lora_fused_steps = 0  # decode steps with adapter rows run as one C++ call
        self.lora_eager_steps = 0  # other steps with adapter rows
        self.attn = attention
        self.device = model.device
        # tensor parallelism (inferd.distributed): this rank's collectives; rank 0 also sends each
        # step's plan to the others and receives the gathered logits
        self.comm = comm
        # The one place that decides fused vs eager (as nano-vllm's runner owns eager vs CUDA graph):
        # a qualifying model runs its decode-only steps as one C++ call, every other step eagerly.
        # Under tensor parallelism always eagerly: the fused step has no all-reduce inside its layer loop.
        self.fused = None if enforce_eager or comm is not None else fused_decode.build(model)
        # announced only where it will run: a model that qualifies may still meet an attention (its KV
        # cache dtype, its kernel) the fused step cannot serve, and then nothing may claim the path
        why = None if self.fused is None else self.fused.unusable_with(attention)
        if why is not None:
            log.info("decode-only steps: eager (%s)", why)
            self.fused = None
        elif self.fused is not None:
            log.info("decode-only steps: fused C++ call (all layers in one native call; steps with prompt "
                     "tokens run eagerly)")
        elif enforce_eager:
            log.info("decode-only steps: eager (--enforce-eager)")
        self.fused_steps = 0  # steps whose hidden states the fused call produced (EngineStats.fused_steps)
        self.eager_decode_steps = 0  # one-token-per-sequence steps the eager forward computed instead
        # each rank's slice of the vocabulary, for the logits gather (set by the tensor-parallel rewrite)
        self.vocab_widths = getattr(model, "tp_vocab_widths", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, decode_only: bool = False,
                lora_rows: bool = False) -> torch.Tensor:
        if self.fused is not None:
            hidden = self.fused(input_ids, positions, self.attn)
            if hidden is not None:
                self.fused_steps += 1
                self.lora_fused_steps += lora_rows
                return hidden
        self.lora_eager_steps += lora_rows
        if decode_only:
            self.eager_decode_steps += 1
        return self.model(input_ids, positions, self.attn)

    def plan(self, requests: list, num_new: list[int]) -> StepPlan:
        """Which token each row of the flat batch is, and which rows' logits are wanted."""
        ids: list[int] = []
        starts = []
        sample_rows, sample_idx = [], []
        prompt_spans = {}
        verify = []
        row = 0
        for i, (req, n) in enumerate(zip(requests, num_new)):
            c = req.num_computed
            p = req.num_prompt
            spec = req.spec_tokens  # speculative guesses follow the known tokens in the chunk
            n_all, n = n, n - len(spec)
            if c + n <= p:
                ids.extend(req.prompt_ids[c:c + n])
            elif c >= p:
                ids.extend(req.output_ids[c - p:c - p + n])
            else:
                ids.extend(req.prompt_ids[c:])
                ids.extend(req.output_ids[: c + n - p])
            starts.append(c)
            if req.params.prompt_logprobs is not None and c < p - 1:
                end = min(c + n, p - 1)
                prompt_spans[i] = (c, row, row + end - c)
            ids.extend(spec)
            verify.append(bool(spec) and n == 1 and c + 1 == req.num_tokens)
            row += n_all
            if c + n == req.num_tokens:
                # with guesses, every row of the chunk is a position to verify: k + 1 rows
                sample_rows.extend(range(row - 1 - len(spec), row))
                sample_idx.append(i)
        return StepPlan(ids, [r.block_table for r in requests], starts, list(num_new), sample_rows, sample_idx,
                        prompt_spans, [r.kv_tables for r in requests] if self.attn.layout is not None else None,
                        self.lora.slots_for(requests) if self.lora is not None else None,
                        self.lora.take_writes() if self.lora is not None else None,
                        verify)

    @torch.inference_mode()
    def execute(self, requests: list, num_new: list[int]):
        """Compute num_new[i] tokens of each request. Returns logits [S, vocab] (fp32) for the
        requests whose last known token was computed (they sample next; one row each, or
        1 + len(spec_tokens) rows for a request verifying guesses), their batch indices, and
        {batch index: (first prompt position, logits rows)} for requests that want prompt logprobs."""
        plan = self.plan(requests, num_new)
        if self.comm is not None:
            self.comm.send_obj(plan)
        return self.run(plan)

    @torch.inference_mode()
    def run(self, plan: StepPlan):
        """The forward of one plan (every rank of a tensor-parallel group runs it; only rank 0 gets
        logits back)."""
        positions = self.attn.prepare(plan.block_tables, plan.starts, plan.num_new, plan.kv_tables, verify=plan.verify)
        if self.lora is not None:
            if plan.lora_writes:
                self.lora.apply_writes(plan.lora_writes)
            self.lora.set_step(plan.lora_slots, plan.num_new)
        try:
            hidden = self.forward(torch.tensor(plan.ids, dtype=torch.long, device=self.device),
                                  positions.to(self.device), decode_only=all(n == 1 for n in plan.num_new),
                                  lora_rows=plan.lora_slots is not None)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        spans = plan.prompt_spans
        if not spans and not plan.sample_rows:
            return hidden.new_zeros(0, self.model.cfg.vocab_size, dtype=torch.float32), [], {}
        # one lm_head call (and under tensor parallelism one gather) for every row wanted
        rows = [r for _, a, b in spans.values() for r in range(a, b)] + plan.sample_rows
        sel = hidden if rows == list(range(hidden.shape[0])) else hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(sel)
        if self.comm is not None:
            logits = self.comm.gather_cols(logits, self.vocab_widths)
            if logits is None:  # not rank 0
                return None
        prompt_rows, off = {}, 0
        for i, (c, a, b) in spans.items():
            prompt_rows[i] = (c, logits[off: off + b - a])
            off += b - a
        return logits[off:], plan.sample_idx, prompt_rows

"""What a load will hold, from the file's header alone: the guard that refuses a model before a byte
of it is allocated, rather than the kernel's OOM killer halfway through.

Per layer, by the route the loader will take (inferd.loading.plan): a GGUF part with a kernel holds
its kernel's records (about the file's bytes: `RECORD_RATIO`), a part left dense holds its weights in
the model's dtype, the token table of a GGUF is read in place (its touched pages, not counted), and a
Hugging Face tensor is held in the model's dtype. Beside the weights: the KV cache and a working set
(the interpreter, torch and the tokenizer, plus one step's activations and logits).
"""
from __future__ import annotations

from dataclasses import dataclass

from inferd.errors import InferdError

GIB = 2**30
BASE_BYTES = 450 << 20  # Python, torch, the tokenizer and the engine's own objects, measured ~0.4 GiB
# a kernel's records for one GGUF block of the type, over the file's block: pack4's fp16 scale and
# min per 32 weights (Q4_0's file has only its d), the block kernel's per-pair headers
RECORD_RATIO = {"Q4_0": 20 / 18, "Q4_1": 1.0, "Q8_0": 1.0}
RECORD_DEFAULT = 1.05


@dataclass
class Estimate:
    weights: int  # bytes the built layers hold
    dense_layers: int  # projections that will be dense (a type without a kernel, or the method's choice)

    def need(self, kv_bytes: int, working: int) -> int:
        return self.weights + kv_bytes + working


def working_set(cfg, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """One step's activations (a few copies of the hidden state and the MLP's width per token) and
    its logits (one row per sequence), with the interpreter and libraries' base."""
    h, ff = cfg.hidden_size, cfg.intermediate_size
    acts = max_num_batched_tokens * (8 * h + 3 * ff) * 4
    logits = max(max_num_seqs, 1) * cfg.vocab_size * 4 * 2
    return BASE_BYTES + acts + logits


def estimate(plan, method: str | None, dtype_bytes: int, activations: bool = False) -> Estimate:
    """Bytes the layers of `plan` will hold under `method` (None/"none": dense)."""
    from inferd.quant.gguf_native import PROJECTIONS, kind_of

    total, dense = 0, 0
    for path, (parts, bias) in plan.linears.items():
        role = path.rsplit(".", 1)[-1]
        numel = sum(p.shape[0] * p.shape[1] for p in parts)
        kinds = [kind_of(p.type, p.shape) for p in parts] if plan.kind == "gguf" else [None]
        served = method == "gguf" and (role in PROJECTIONS or role == "lm_head") and None not in kinds
        if served:
            total += sum(int(p.nbytes * RECORD_RATIO.get(p.type, RECORD_DEFAULT)) for p in parts)
        elif method in ("int8", "int8-gptq"):
            total += int(numel * 1.07)
        elif method in ("int4", "int4-gptq", "awq"):
            total += int(numel * 0.57)
        else:
            total += numel * dtype_bytes
            dense += role in PROJECTIONS
    if plan.kind != "gguf":  # a float table; a GGUF's is read in place
        total += plan.embedding.shape[0] * plan.embedding.shape[1] * dtype_bytes
    return Estimate(total, dense)


def check_fits(name: str, est: Estimate, kv_bytes: int, working: int, available: int) -> None:
    """One line and exit 2 (an InferdError) when the load cannot fit, saying what would."""
    need = est.need(kv_bytes, working)
    if need <= available:
        return
    over = need - available
    hint = (f"lower --kv-cache-memory (by {over / GIB:.1f} GiB)" if kv_bytes >= over else
            "use a smaller model or a smaller quantization of it")
    raise InferdError(f"{name} needs about {need / GIB:.1f} GiB (weights {est.weights / GIB:.1f}, KV cache "
                      f"{kv_bytes / GIB:.1f}, working set {working / GIB:.1f}) and {available / GIB:.1f} GiB is "
                      f"available: {hint}")

"""Which fast paths an engine actually ran: the record a benchmark row is labelled from.

A row that says "W4A8, fused decode, bf16" is a claim about what ran; `engine_paths(engine)`
reads the answer from the engine itself (the kernel variant the native library chose, the layer
classes the model holds, the KV dtype, how many decode steps went through the fused C++ call), and
`check_label(label, paths)` refuses a label that claims a path the record shows did not run.

Nothing here imports torch or the kernels (the engine's dashboard state includes this record, and
the torch-free client seam imports that module): the engine's own objects are read instead, and
`check_label` is pure, for scripts that read a served engine's record (GET /v1/engine/state).
"""
from __future__ import annotations

import re
import sys

# Layer classes that take int8 activations (inferd.quant.w4a8), and the formats each label word claims.
INT8_ACTIVATION_LAYERS = {"W4A8Linear": "W4A8", "W8A8Linear": "W8A8", "BlocksLinear": "GGUF-A8"}
INT4_LAYERS = ("Int4Linear", "W4A8Linear")
INT8_LAYERS = ("Int8Linear", "W8A8Linear")
DENSE_LAYERS = ("Linear",)


def weight_formats(model) -> dict[str, int]:
    """How many linear layers of each class the model holds, e.g. {"W4A8Linear": 120, "W8A8Linear": 1}.
    A wrapper (tensor parallelism's RowParallel) is not a format: the layer it wraps is counted."""
    out: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("Linear"):
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def activation_quant(formats: dict[str, int]) -> str | None:
    """"W4A8", "W8A8", "GGUF-A8" (a GGUF's other block types) or several joined by "/" where layers
    take int8 activations; None where none do."""
    kinds = [v for k, v in INT8_ACTIVATION_LAYERS.items() if formats.get(k)]
    return "/".join(kinds) or None


def kernel_variant(kernel) -> str | None:
    """The ISA variant of the native kernels `kernel` (torch.ops.inferd) runs now, None without them."""
    return None if kernel is None else str(kernel.isa())


def _dtype(t) -> str:
    return str(t).replace("torch.", "")


def module_paths(model) -> dict:
    """What any torch model runs with (an inferd model or a transformers one, for a competitor's row):
    its activation dtype, its linear layer classes, the dtypes of its dense (nn.Linear) weights."""
    formats = weight_formats(model)
    dense = sorted({_dtype(m.weight.dtype) for m in model.modules()
                    if type(m).__name__ in DENSE_LAYERS and getattr(m, "weight", None) is not None})
    dtype = getattr(model, "dtype", None)
    head = getattr(model, "lm_head", None)
    quant = activation_quant(formats)
    return {"dtype": None if dtype is None else _dtype(dtype),
            "weight_formats": formats, "dense_weight_dtypes": dense,
            "lm_head": None if head is None else type(head).__name__,
            "activations": "int8" if quant else (None if dtype is None else _dtype(dtype)),
            "activation_quant": quant}


def engine_paths(engine) -> dict:
    """What ran in an LLMEngine: plain JSON data (it crosses the engine-core boundary)."""
    # An engine has torch loaded: read from sys.modules, so that importing this module (the torch-free
    # client seam imports inferd.engine.state) never loads it.
    torch = sys.modules["torch"]
    runner, stats, cfg = engine.runner, engine.stats, engine.config
    fused = getattr(runner, "fused", None)
    return {
        "engine": "inferd",
        "kernel_variant": kernel_variant(getattr(runner.attn, "kernel", None)),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **module_paths(engine.model),
        "kv_dtype": engine.cache_info()["dtype"],
        "fused_built": fused is not None,
        "fused_steps": stats.fused_steps,
        "steps": stats.steps,
        "eager_decode_steps": stats.eager_decode_steps,
        "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "tensor_parallel": _tp_paths(engine),
        "speculative_method": cfg.speculative_method,
        "speculative": _spec_paths(engine),
        "draft": _draft_paths(engine),
        "lora": _lora_paths(engine),
        "attention": attention_paths(runner.attn),
    }


def attention_paths(attn) -> dict:
    """Which attention ran over the paged cache: calls of each compiled path and of the torch
    fallback (with the reason it was taken), so that a long-context row that claims the tiled
    prefill or the split decode is held to what ran. Counts are per layer call."""
    return {"kernel": getattr(attn, "kernel", None) is not None,
            "decode_kernel_calls": attn.kernel_calls, "split_decode_calls": attn.split_decode_calls,
            "tiled_prefill_calls": attn.prefill_kernel_calls, "fallback_calls": attn.fallback_calls,
            "fallback_why": attn.fallback_why}


def _tp_paths(engine) -> dict | None:
    """Where the tensor-parallel ranks run, as the executor placed them (rank 0 first): a test or an
    operator reads the nodes from the engine itself, not from a cluster table that may trail it."""
    tp = getattr(engine, "tp", None)
    if tp is None:
        return None
    places = tp.placements or []
    return {"backend": tp.backend, "executor": engine.config.distributed_executor_backend,
            "nodes": len({p.node for p in places}), "rank_ips": [p.ip for p in places]}


def _lora_paths(engine) -> dict | None:
    """LoRA adapters: how many, the slots, and the steps that ran adapter rows (eagerly)."""
    lora = getattr(engine, "lora", None)
    if lora is None:
        return None
    return {"adapters": len(lora.adapters), "max_loras": lora.max_loras, "max_rank": lora.max_rank,
            "lora_steps": lora.lora_steps, "multi_adapter_steps": lora.multi_adapter_steps,
            "slot_writes": lora.slot_writes, "products_per_step": lora.applies_last}


def _spec_paths(engine) -> dict | None:
    """Speculation: its guesses per step, whether the cost model chose them, and where the guesses
    went (a row that claims suffix drafts or the cost model is held to these)."""
    spec = getattr(engine, "spec", None)
    if spec is None:
        return None
    st = spec.stats
    return {"method": spec.method, "num_speculative_tokens": spec.k, "cost_model": spec.cost is not None,
            "drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens, "accepted_tokens": st.num_accepted_tokens,
            "proposed_tokens": st.num_proposed_tokens, "cost_skipped_tokens": st.num_cost_skipped_tokens,
            "grammar_cut_tokens": st.num_grammar_cut_tokens, "cache_drafts": st.num_cache_drafts}


def _draft_paths(engine) -> dict | None:
    """A draft model's own record (its weights may be quantized apart from the target's)."""
    spec = getattr(engine, "spec", None)
    model = getattr(getattr(spec, "proposer", None), "model", None)
    if model is None:
        return None
    return {"desc": spec.draft_desc, **module_paths(model)}


# -- labels ---------------------------------------------------------------------------------------

# label word -> the dtype it claims (of the activations, `paths["dtype"]`)
_DTYPE_WORDS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                "fp16": "float16", "float16": "float16"}
_ISAS = ("generic", "avx2", "avx512", "avx512_vnni", "avx512_amx")  # inferd.kernels.native.ISAS
_NO_AMX = re.compile(r"\b(without|no|non)[ -]amx\b|\bamx off\b")


def _has(paths: dict, classes: tuple[str, ...]) -> bool:
    formats = paths.get("weight_formats") or {}
    return any(formats.get(c) for c in classes)


def _words(label: str) -> set[str]:
    return set(re.findall(r"[a-z0-9_]+", label.lower()))


# "KV int8", "int8 KV", "KV bf16": a claim about the KV cache's dtype, not the weights' or activations'
_KV_CLAIM = re.compile(r"\bkv[ -]?(?:cache[ -])?(int8|bf16|bfloat16|fp32|float32|fp16|float16)\b|"
                       r"\b(int8|bf16|bfloat16|fp32|float32|fp16|float16)[ -]kv\b")
_KV_WORDS = {**_DTYPE_WORDS, "int8": "int8"}


def label_problems(label: str, paths: dict) -> list[str]:
    """Each claim of `label` that `paths` does not back (a claim the record cannot show is unbacked)."""
    bad = []

    def need(ok: bool, claim: str, shows: str):
        if not ok:
            bad.append(f"{claim!r} but the record shows {shows}")

    for m in _KV_CLAIM.finditer(label.lower()):
        kv = _KV_WORDS[m.group(1) or m.group(2)]
        need(paths.get("kv_dtype") == kv, m.group(0), f"kv_dtype {paths.get('kv_dtype')}")
    label = _KV_CLAIM.sub(" ", label.lower())  # the rest of the label claims weights and activations
    low, words = label, _words(label)
    attn = paths.get("attention") or {}
    for claim, key in (("tiled prefill", "tiled_prefill_calls"), ("split decode", "split_decode_calls")):
        if claim in low:
            need((attn.get(key) or 0) > 0 and not attn.get("fallback_calls"), claim,
                 f"{key}={attn.get(key)}, fallback_calls={attn.get('fallback_calls')}")

    if "fused" in words:
        need((paths.get("fused_steps") or 0) > 0, "fused", f"fused_steps={paths.get('fused_steps')}")
    if "eager" in words:
        need(paths.get("fused_steps") == 0, "eager", f"fused_steps={paths.get('fused_steps')}")
    formats = paths.get("weight_formats")
    if "w4a8" in words:
        need(_has(paths, ("W4A8Linear",)), "W4A8", f"weight formats {formats}")
    if "gguf-a8" in low:
        need(_has(paths, ("BlocksLinear",)), "GGUF-A8", f"weight formats {formats}")
    if "w8a8" in words:
        need(_has(paths, ("W8A8Linear",)), "W8A8", f"weight formats {formats}")
    if "int4" in words:
        need(_has(paths, INT4_LAYERS), "int4", f"weight formats {formats}")
    if "int8" in words:
        need(_has(paths, INT8_LAYERS), "int8", f"weight formats {formats}")
    if "dense" in words:
        need(bool(formats) and set(formats) <= set(DENSE_LAYERS), "dense", f"weight formats {formats}")
    if "+lm_head" in low:
        need(paths.get("lm_head") not in (None, *DENSE_LAYERS), "+lm_head", f"lm_head {paths.get('lm_head')}")
    for w in sorted(words & set(_DTYPE_WORDS)):
        need(paths.get("dtype") == _DTYPE_WORDS[w], w, f"dtype {paths.get('dtype')}")
    for isa in sorted(words & set(_ISAS)):
        need(paths.get("kernel_variant") == isa, isa, f"kernel variant {paths.get('kernel_variant')}")
    if "amx" in words:
        # inferd's AMX is its avx512_amx kernel variant; a llama.cpp record says whether its build used AMX
        ran = paths.get("amx") if "amx" in paths else paths.get("kernel_variant") == "avx512_amx"
        claim = not _NO_AMX.search(low)
        need(bool(ran) == claim, "AMX" if claim else "without AMX",
             f"amx={paths.get('amx')}" if "amx" in paths else f"kernel variant {paths.get('kernel_variant')}")
    for spec, method in (("ngram", "ngram"), ("draft", "draft"), ("suffix", "suffix")):
        if spec in words:
            need(paths.get("speculative_method") == method, spec,
                 f"speculative_method={paths.get('speculative_method')}")
    if "cost model" in low:
        on = not re.search(r"\bno cost model", low)
        sp = paths.get("speculative") or {}
        need(bool(sp.get("cost_model")) == on, "cost model" if on else "no cost model", f"speculative {sp}")
    m = re.search(r"\btp\s*=\s*(\d+)", low)
    if m:
        need(paths.get("tensor_parallel_size") == int(m.group(1)), m.group(0),
             f"tensor_parallel_size={paths.get('tensor_parallel_size')}")
    return bad


def check_label(label: str, paths: dict) -> None:
    """Raise ValueError where the row's label claims a path that, by its record, did not run.
    What follows ", draft " in a label is a claim about the draft model: checked against
    paths["draft"], the rest against the target."""
    target, sep, draft = label.partition(", draft ")
    bad = label_problems(target, paths)
    if sep:
        bad += [f"draft {p}" for p in label_problems(draft, paths.get("draft") or {})]
    if bad:
        raise ValueError(f"row {label!r} claims what did not run: " + "; ".join(bad))

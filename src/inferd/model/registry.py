"""Which model families inferd serves: one record per family, naming its module and how a Hugging Face
folder and a GGUF file announce it.

Adding a family is one module in `inferd/model/` (built from `inferd.model.layers`, usually a small
subclass of the Llama layer) and one `Family` line here; the loader, the GGUF reader, the AWQ writer
and `docs/reference/models.md` all read this table.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from inferd.errors import InferdError


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    module: str  # the family's module under inferd.model, and its model class
    model_class: str
    hf: tuple[str, ...]  # config.json `architectures` (its `model_type` is `name`)
    gguf: tuple[str, ...]  # GGUF `general.architecture`
    # llama.cpp's converter interleaves the q/k rows of "normal"-RoPE families for its kernel; the
    # NeoX-RoPE ones (Qwen, Gemma, Phi-3) stay in Hugging Face's half-split order
    gguf_interleaved_qk: bool
    attention_bias: bool = False  # q/k/v bias when config.json does not say
    sliding_window: bool = False  # config.json's sliding_window applies unless use_sliding_window says not
    # GGUF tensor names that differ from the Llama table (loading/gguf.py), and what llama.cpp's
    # converter added to every norm weight (Gemma: it stores 1 + w)
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0
    tested: str = ""  # what the suite holds it to (docs/reference/models.md)
    # an encoder (bidirectional attention, no KV cache, no LM head): served by the pooling runner only
    encoder: bool = False


# Gemma's four norms a layer: llama.cpp calls the pre-MLP one ffn_norm, as Llama's single one
_GEMMA_NAMES = (("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
                ("post_attention_norm.weight", "post_attention_layernorm.weight"),
                ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"))

FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", "LlamaModel", ("LlamaForCausalLM",), ("llama",), True,
           tested="HF and GGUF (Llama 3 RoPE from rope_type or rope_freqs); the whole engine suite; TP"),
    # llama.cpp's converter writes Mistral as `llama` and drops its window; a `llama` file that keeps
    # it (llama.attention.sliding_window) is read as Mistral (loading/gguf.py)
    Family("mistral", "llama", "LlamaModel", ("MistralForCausalLM",), ("mistral",), True, sliding_window=True,
           tested="HF and GGUF (arch `llama` with `llama.attention.sliding_window`), past the window, the "
                  "window's count checked (one key more, one fewer, none: each differs from transformers); "
                  "a file as llama.cpp's converter writes it (no window) runs as Llama, as in llama.cpp"),
    Family("qwen2", "llama", "LlamaModel", ("Qwen2ForCausalLM",), ("qwen2",), False, attention_bias=True,
           tested="HF and GGUF (q/k/v biases); the engine; a llama-quantize Q4_K_M file served from its blocks "
                  "(a biased q/k/v whose parts differ in type)"),
    Family("qwen3", "qwen3", "Qwen3Model", ("Qwen3ForCausalLM",), ("qwen3",), False,
           tested="HF and GGUF; the engine; TP=2; structured output"),
    # Phi-3 is the Llama layer with q/k/v and gate/up stored fused, as inferd holds them anyway
    Family("phi3", "llama", "LlamaModel", ("Phi3ForCausalLM",), ("phi3",), False, sliding_window=True,
           gguf_names=(("attn_qkv.weight", "qkv_proj.weight"), ("ffn_up.weight", "gate_up_proj.weight")),
           tested="HF and GGUF (fused q/k/v and gate/up, sliding window, LongRoPE from config.json or the "
                  "rope_factors_long/short tensors); the engine; a llama-quantize Q4_K_M file served from its "
                  "blocks"),
    # llama.cpp's converter writes Mixtral as `llama` with an expert count (loading/gguf.py tells them apart)
    Family("mixtral", "moe", "MixtralModel", ("MixtralForCausalLM",), ("mixtral",), True,
           tested="HF and GGUF (as llama.cpp writes it: arch llama with experts); the engine; "
                  "one matmul per active expert; structured output; a llama-quantize Q4_K_M file, its 3-D "
                  "expert tensors served from their blocks"),
    Family("qwen3_moe", "moe", "Qwen3MoeModel", ("Qwen3MoeForCausalLM",), ("qwen3moe",), False,
           tested="HF and GGUF; the engine; int8 experts on the W8A8 kernel; TP=2 (whole experts a rank)"),
    Family("olmoe", "moe", "OlmoeModel", ("OlmoeForCausalLM",), ("olmoe",), False,
           tested="HF and GGUF; the engine; one matmul per active expert"),
    Family("gemma2", "gemma2", "Gemma2Model", ("Gemma2ForCausalLM",), ("gemma2",), False, sliding_window=True,
           gguf_names=_GEMMA_NAMES, gguf_norm_offset=1.0,
           tested="HF and GGUF (attention and final soft-capping, every other layer local, past the window); "
                  "the engine with KV groups (window blocks freed); TP=2; structured output"),
    Family("gemma3", "gemma3", "Gemma3Model", ("Gemma3ForCausalLM",), ("gemma3",), False, sliding_window=True,
           gguf_names=_GEMMA_NAMES, gguf_norm_offset=1.0,
           tested="HF and GGUF (local and global layers, past the window); the engine with KV groups; TP=2; "
                  "the real Gemma 3 270M Q4_K_M (`--model gemma3-270m`): transformers' tokens and tokenizer, "
                  "a 4k request holding the windows only, llama.cpp's chat format, structured output"),
    Family("bert", "bert", "BertModel", ("BertModel", "BertForMaskedLM", "BertForPreTraining"), (), False,
           encoder=True,
           tested="HF (an encoder: the pooling runner); the real all-MiniLM-L6-v2 (`--model all-minilm-l6-v2`) "
                  "against sentence-transformers, padding-free batches"),
)


def supported() -> str:
    return ", ".join(f.name for f in FAMILIES)


def by_name(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise InferdError(f"unsupported architecture {name!r} (supported: {supported()})")


def for_hf(architectures: list[str] | None, model_type: str | None) -> Family:
    """The family of a config.json: by `architectures`, else by `model_type`."""
    for a in architectures or ():
        for f in FAMILIES:
            if a in f.hf:
                return f
    for f in FAMILIES:
        if model_type in (f.name, f"{f.name}_text"):
            return f
    raise InferdError(f"unsupported architecture {architectures or model_type!r} (supported: {supported()})")


def for_gguf(arch: str | None) -> Family:
    for f in FAMILIES:
        if arch in f.gguf:
            return f
    archs = ", ".join(a for f in FAMILIES for a in f.gguf)
    raise InferdError(f"unsupported architecture in GGUF: {arch!r} (supported: {archs})")


def model_class(architecture: str) -> type:
    f = by_name(architecture)
    return getattr(importlib.import_module(f"inferd.model.{f.module}"), f.model_class)


def markdown() -> str:
    """The supported-models table (docs/reference/models.md is this, generated)."""
    rows = ["| family | Hugging Face class | GGUF architecture | module | tested |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | {', '.join(f'`{a}`' for a in f.hf)} | {', '.join(f'`{a}`' for a in f.gguf)} | "
                    f"`inferd/model/{f.module}.py` | {f.tested} |")
    return "\n".join(rows) + "\n"

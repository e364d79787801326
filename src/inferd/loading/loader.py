"""Resolve `--model` to files on disk and build a LlamaModel from them.

Accepted: the embedded models (None, "default", "smollm2-135m"; "gemma3-270m"), a `.gguf` file, a Hugging Face
folder (config.json + *.safetensors + tokenizer.json), or with `--load-format dummy` a built-in
config name. Nothing is ever downloaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

from inferd.config import LoadConfig, available_memory_bytes
from inferd.errors import InferdError
from inferd.gguf_file import DEFAULT_GGUF_FILE, default_model_path  # noqa: F401  (re-exported)
from inferd.loading.checks import check_config, check_gguf, read_config_json
from inferd.loading.source import DEFAULT_MODEL_NAMES, ModelSource, resolve_model  # noqa: F401  (re-exported)
from inferd.model.config import ModelConfig, builtin_config, config_from_hf
from inferd.model import registry
from inferd.model.layers import Linear, Rope
from inferd.model.llama import LlamaModel

log = logging.getLogger("inferd")

def resolve_dtype(dtype: str, device: str = "cpu", *, packed: bool = False, int8_activations: bool = False) -> torch.dtype:
    """`--dtype` -> a torch dtype; `auto` picks what the model's fastest path on this device takes
    (`packed`: PyTorch's packed int4/int8 weight kernels; `int8_activations`: inferd's W4A8/W8A8)."""
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        return auto_dtype(device, cpu_has_bf16(), packed=packed, int8_activations=int8_activations)
    if dtype not in table:
        raise InferdError(f"unknown dtype {dtype!r} (choose auto, float32, bfloat16, float16)")
    return table[dtype]


def auto_dtype(device: str, has_bf16: bool, *, packed: bool = False, int8_activations: bool = False) -> torch.dtype:
    """What `--dtype auto` means, on every CPU kind:
    - W4A8/W8A8 (`int8_activations`): float32. The kernels round activations to int8 themselves, and
      the fused decode step runs fp32 glue only; bf16 would put the model on the eager path.
    - PyTorch's packed int4/int8 kernels (`packed`): bfloat16, even without AVX512-BF16: with fp32
      inputs they take a path 8-11x slower (benchmarks/quant_decode.py, AVX2 and AVX-512 alike).
    - dense weights: bfloat16 where the CPU has native bf16 dot products (AVX512-BF16, AMX), else fp32.
    CUDA: bfloat16."""
    if device.startswith("cuda"):
        return torch.bfloat16
    if int8_activations:
        return torch.float32
    if packed or has_bf16:
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InferdError("CUDA is not available (this torch build or machine has no GPU); use --device cpu")
        return torch.device(device)
    if device != "cpu":
        raise InferdError(f"unknown device {device!r} (choose cpu or cuda)")
    return torch.device("cpu")


def _checked(make_config, where: str):
    """A ModelConfig from a file's metadata, bounded (checks.check_config) before anything of
    its shape is allocated; a missing or mistyped field is one clear error, not a KeyError."""
    try:
        cfg = make_config()
    except InferdError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise InferdError(f"model config of {where}: missing or invalid field ({type(e).__name__}: {e})") from None
    # 4 bits a parameter is the smallest form any path keeps: past that it cannot fit at all
    check_config(cfg, where, memory_bytes=available_memory_bytes(), bytes_per_param=0.5)
    return cfg


def load_safetensors_folder(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder under our (unfused) names, in memory: for an AWQ folder,
    whose packed codes are taken apart before the model is built (quant.awq_checkpoint)."""
    from inferd.loading.plan import safetensors_plan_names

    return {k: p.dense(p.get().dtype) for k, p in safetensors_plan_names(folder).items()}


_init_lock = threading.Lock()


@contextlib.contextmanager
def _no_default_init():
    """Skip nn.Linear's and nn.Embedding's random init while the model is built: every weight is
    overwritten anyway (and random init of 135M weights costs seconds)."""
    with _init_lock:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None, dtype, device,
                seed: int = 0) -> LlamaModel:
    if registry.by_name(cfg.architecture).encoder:  # BERT: its own names, no LM head (loading/encoder.py)
        from inferd.loading.encoder import build_encoder

        return build_encoder(cfg, state_dict, dtype, device, seed)
    """A dense model: random weights (`state_dict` None: tests, --load-format dummy) or the tensors
    of a state dict under our unfused names, each copied once into its layer."""
    if state_dict is not None:
        from inferd.loading.plan import memory_plan
        from inferd.model.planned import materialize

        model = build_skeleton(cfg, memory_plan(state_dict, cfg), dtype, device)
        materialize(model)
        tie_dense_head(model, cfg)
        return model
    # allocated where it runs, uninitialised (not on the meta device and then `to_empty`, whose
    # empty_like goes through torch's Python reference ops: ~1 s of every load)
    with torch.device(device), _no_default_init():
        model = registry.model_class(cfg.architecture)(cfg)
    _init_random(model, cfg, seed)
    model = model.to(dtype)
    return _finish(model, device)


def _finish(model: nn.Module, device) -> nn.Module:
    reset_rope(model, device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_skeleton(cfg: ModelConfig, plan, dtype, device) -> LlamaModel:
    """The model with no weights read yet: built on the meta device, every linear a placeholder
    holding its parts of the file (inferd.model.planned), the small tensors (norms) read now, the token
    table kept in the file's own type where it has one (model.gguf_embedding.GGUFEmbedding: read in place)."""
    from inferd.model.planned import PlannedLinear

    if device.type != "cpu":
        raise InferdError("loading from a file builds CPU models in this build")
    # no random init: on the meta device nn.Embedding's normal_ imports torch's decompositions (1.4 s)
    with torch.device("meta"), _no_default_init():
        model = registry.model_class(cfg.architecture)(cfg)
    cfg.tie_word_embeddings = plan.tied
    for path, (parts, bias_parts) in plan.linears.items():
        parent_path, _, name = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
            old = getattr(parent, name)
        except AttributeError:
            raise InferdError(f"the file has weights for {path}, which a {cfg.architecture} model of this "
                              "config does not have") from None
        if parts is None:
            raise InferdError(f"weights missing from the file: {path}.weight")
        try:
            setattr(parent, name, PlannedLinear(parts, bias_parts, old.in_features, old.out_features))
        except ValueError as e:
            raise InferdError(f"weight {path}: {e}, the config expects [{old.out_features}, {old.in_features}]") \
                from None
    model.embed_tokens = _embedding(plan.embedding, cfg, dtype)
    missing, taken = [], set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, PlannedLinear):
            continue
        if isinstance(mod, nn.Linear) and mod.weight.is_meta:
            missing.append(f"{mod_name}.weight")
            continue
        for pname, param in list(mod._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{mod_name}.{pname}".lstrip(".")
            part = plan.tensors.get(full)
            if part is None:
                missing.append(full)
                continue
            if tuple(part.shape) != tuple(param.shape):
                raise InferdError(f"weight {full} has shape {tuple(part.shape)}, config expects {tuple(param.shape)}")
            mod._parameters[pname] = nn.Parameter(part.dense(dtype), requires_grad=False)
            taken.add(full)
    if missing:
        raise InferdError(f"weights missing from the file: {sorted(missing)[:5]}")
    unread = plan.unused + sorted(set(plan.tensors) - taken)
    if unread:  # a tensor under a name nothing maps is a weight the model would silently go without
        log.warning("%d tensors of the file are read by no layer: %s", len(unread), ", ".join(unread[:5]))
    return _finish(model, device)


def _embedding(part, cfg: ModelConfig, dtype) -> nn.Module:
    """The token table: a GGUF's in its own type, read in place; else a float table."""
    if tuple(part.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise InferdError(f"weight embed_tokens.weight has shape {tuple(part.shape)}, config expects "
                          f"{(cfg.vocab_size, cfg.hidden_size)}")
    if hasattr(part, "raw"):
        from inferd.model.gguf_embedding import GGUFEmbedding

        return GGUFEmbedding(part, dtype)
    with torch.device("meta"), _no_default_init():
        emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    emb.weight = nn.Parameter(part.dense(dtype), requires_grad=False)
    return emb


def tie_dense_head(model: nn.Module, cfg: ModelConfig) -> bool:
    """A tied model whose head and table are both dense floats holds the matrix once."""
    head, emb = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)  # an encoder has no head
    if not cfg.tie_word_embeddings or type(head) is not Linear or not isinstance(emb, nn.Embedding):
        return False
    if head.weight.shape != emb.weight.shape or head.weight.dtype != emb.weight.dtype or head.bias is not None:
        return False
    head.weight = emb.weight
    return True


def reset_rope(model: nn.Module, device):
    """After .to(dtype): the RoPE frequencies stay fp32 whatever the weights are (every table: Gemma's
    local layers have their own)."""
    for m in model.modules():
        if isinstance(m, Rope):
            m.reset(device)


def _init_random(model: LlamaModel, cfg: ModelConfig, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: object | None
    source: ModelSource
    report: dict = dataclasses.field(default_factory=dict)  # how the load went (inferd.loading.report)


def load_model(model=None, shard=None, **options) -> LoadedModel:
    """Build a model from a LoadConfig (`model` may be one), or from its fields as keywords (the
    model path and options; keywords override a given config). See LoadConfig for each option.
    `shard(model)`: a rewrite applied after quantizing and before the codes are packed for a kernel
    (tensor parallelism's `apply_tp`: the codes are cut, not the kernels' layouts)."""
    cfg = model if isinstance(model, LoadConfig) else LoadConfig(model=model)
    if options:
        unknown = set(options) - LoadConfig.field_names()
        if unknown:
            raise TypeError(f"load_model() got unexpected options {sorted(unknown)}")
        cfg = dataclasses.replace(cfg, **options)
    with _gc_paused():
        return _load(cfg, shard)


@contextlib.contextmanager
def _gc_paused():
    """No cyclic collection while a model loads: a GGUF's tokenizer is ~10^5 strings, and every few
    hundred new objects woke the collector, whose full passes walked all of them (0.6 s of a 2.3 s
    1B Q4_K_M load, 2 cores). Loading makes no cycles worth collecting; the next pass after it does."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load(lc: LoadConfig, shard=None) -> LoadedModel:
    from inferd import quant
    from inferd.loading.report import LoadReport

    if lc.load_format not in ("auto", "gguf", "safetensors", "dummy"):
        raise InferdError(f"unknown load format {lc.load_format!r} (choose auto, gguf, safetensors, dummy)")
    report = LoadReport()
    dev = resolve_device(lc.device)
    src = resolve_model(lc.model, lc.load_format)
    if lc.quantization == "auto" and src.kind != "gguf":
        lc = dataclasses.replace(lc, quantization="none")  # an AWQ folder still serves as awq (below)
    method = quant.method(lc.quantization)
    dummy = lc.load_format == "dummy"
    tok = reader = plan = sd = None
    checkpoint = {}
    if src.kind == "builtin":
        cfg = builtin_config(src.name)
        if lc.with_tokenizer and src.name.lower().startswith("smollm2"):
            tok = _load_tokenizer(default_model_path())
    elif src.kind == "gguf":
        from inferd.gguf_file import open_gguf, read_metadata
        from inferd.loading import gguf as G
        from inferd.loading.plan import gguf_plan

        header = check_gguf(src.path)  # before the gguf reader trusts a count or an offset
        reader = open_gguf(src.path, header)
        meta = read_metadata(reader)
        cfg = _checked(lambda: G.config_from_metadata(meta, G.rope_tensors(reader)), src.path)
        plan = None if dummy else gguf_plan(reader, cfg)
        if lc.quantization == "auto":
            lc = auto_quantization(lc, plan, dev, dummy)
            method = quant.method(lc.quantization)
        if lc.with_tokenizer:
            tok = _tokenizer_from_meta(meta)
    else:
        from inferd.loading.plan import memory_plan, safetensors_plan
        from inferd.quant.awq_checkpoint import read_quant_config, take_awq_linears

        cfg = _checked(lambda: config_from_hf(read_config_json(os.path.join(src.path, "config.json"))), src.path)
        awq = None if dummy else read_quant_config(src.path)
        if awq is not None:
            if lc.quantization not in (None, "none", "awq"):
                raise InferdError(f"{src.path} is an AWQ checkpoint: it serves as --quantization awq, not {lc.quantization}")
            method = quant.method("awq")  # an AWQ folder is served as what it is
            sd = load_safetensors_folder(src.path)
            checkpoint = {"parts": take_awq_linears(sd, cfg, awq["group_size"]), "group_size": awq["group_size"]}
            plan = memory_plan(sd, cfg)
        elif not dummy and registry.by_name(cfg.architecture).encoder:
            sd = load_safetensors_folder(src.path)  # an encoder (BERT) is small and has its own names
        elif not dummy:
            plan = safetensors_plan(src.path, cfg)
        if lc.with_tokenizer and os.path.isfile(os.path.join(src.path, "tokenizer.json")):
            tok = _load_tokenizer(src.path)
    name = "awq" if checkpoint else (lc.quantization or "none")
    if method is not None and registry.by_name(cfg.architecture).encoder:
        raise InferdError(f"--quantization {name}: encoder models ({cfg.architecture}) are served unquantized")
    if method is not None and "gguf" in method.needs and (src.kind != "gguf" or dummy):
        raise InferdError("--quantization gguf needs a .gguf model file")
    if method is not None and "checkpoint" in method.needs and not checkpoint:
        raise InferdError("--quantization awq needs an AWQ checkpoint folder (quantization_config.quant_method "
                          "awq); make one with `inferd quantize --method awq`")
    if lc.quantize_activations and (method is None or dev.type != "cpu" or lc.dense_quant):
        raise InferdError("--quantize-activations applies to quantized weights: add --quantization "
                          "int4, int4-gptq, gguf, awq (W4A8) or int8, int8-gptq (W8A8)" if method is None else
                          "--quantize-activations is a CPU kernel for packed weights")
    tdtype = resolve_dtype(lc.dtype, lc.device, packed=method is not None and not lc.dense_quant,
                           int8_activations=lc.quantize_activations)
    if lc.dtype == "auto":
        log.info("--dtype auto: %s", str(tdtype)[6:])
    if plan is None:
        net = build_model(cfg, sd, tdtype, dev)
    else:
        guard(src, plan, cfg, lc, name, tdtype)
        report.begin(plan, reader, tdtype)
        net = build_skeleton(cfg, plan, tdtype, dev)

    def fp32_copy():
        from inferd.model.planned import materialize

        if net.dtype == torch.float32 and not any(True for _ in _planned(net)):
            return net
        copy = build_model(cfg, None, torch.float32, dev) if plan is None else build_skeleton(cfg, plan, torch.float32, dev)
        materialize(copy)
        return copy

    def calibration(n_samples: int, seqlen: int):
        from inferd.data import calibration_ids

        if tok is None:
            raise InferdError(f"{name} calibrates on WikiText-2 and needs the model's tokenizer")
        return calibration_ids(tok, n_samples, seqlen)

    ctx = quant.QuantContext(name, lc.quant_group_size, lc.quantize_lm_head, lc.dense_quant, lc.quantize_activations,
                             cfg, plan, checkpoint, calibration if tok is not None else None,
                             fp32_copy, (src.kind, src.path or src.name),
                             on_dense=report.on_dense if name == "gguf" else None, release=report.release,
                             lm_head_type=head_type(lc, name))
    for line in quant.apply(net, ctx, shard):
        log.info("%s", line)
    tie_dense_head(net, cfg)
    report.end(net)
    for line in report.lines():
        log.info("%s", line)
    return LoadedModel(net, cfg, tok, src, report.as_dict())


def head_type(lc: LoadConfig, method: str) -> str | None:
    """--lm-head-quantization's GGUF type, or None; one line where it cannot apply."""
    from inferd.quant.kquants import HEAD_TYPES

    name = (lc.lm_head_quantization or "none").lower()
    if name == "none":
        return None
    if name not in HEAD_TYPES:
        raise InferdError(f"--lm-head-quantization {lc.lm_head_quantization!r}: choose none, {', '.join(HEAD_TYPES)}")
    if method != "gguf" or lc.dense_quant:
        raise InferdError(f"--lm-head-quantization {name} rounds a GGUF file's output layer as served from its "
                          "blocks: it needs --quantization auto (or gguf) on a .gguf model")
    if not lc.quantize_lm_head:  # a Q4_0/Q4_1 head: already 4 bits (served re-rounded to int8)
        log.info("--lm-head-quantization %s: the output layer is not served from its own blocks here (a 4-bit "
                 "head, or gguf without --quantize-lm-head): it stays as it is", name)
        return None
    return HEAD_TYPES[name]


def guard(src: ModelSource, plan, cfg: ModelConfig, lc: LoadConfig, method: str, dtype) -> None:
    """Refuse, from the header alone, a load that cannot fit beside its KV cache and working set."""
    from inferd.config import parse_bytes
    from inferd.loading.memory import check_fits, estimate, working_set

    est = estimate(plan, method, torch.empty((), dtype=dtype).element_size(), lc.quantize_activations)
    kv = parse_bytes(lc.kv_cache_memory) if lc.kv_cache_memory else 0  # the default KV takes a share of what is left
    check_fits(src.name, est, kv, working_set(cfg, lc.max_num_batched_tokens, lc.max_num_seqs),
               available_memory_bytes())


def _planned(model):
    from inferd.model.planned import planned

    return planned(model)


def auto_quantization(lc: LoadConfig, plan, dev, dummy: bool = False) -> LoadConfig:
    """`--quantization auto` for a GGUF file: served from its own blocks, as llama.cpp serves it, with
    activations rounded to int8 (W4A8 / W8A8 / the block kernel) and the output layer from its own
    Q8_0 or block codes; `none` (the dequantized weights) where that cannot run: no native kernels,
    not the CPU, random weights, fp32-activation evaluation, or no layer of a type with a kernel."""
    from inferd.kernels import native
    from inferd.quant.gguf_native import head_has_kernel, plan_has_kernels

    if dummy or plan is None or dev.type != "cpu" or lc.dense_quant or native.ops() is None \
            or not plan_has_kernels(plan):
        return dataclasses.replace(lc, quantization="none")
    return dataclasses.replace(lc, quantization="gguf", quantize_activations=True,
                               quantize_lm_head=lc.quantize_lm_head or head_has_kernel(plan))


def _load_tokenizer(path: str):
    from inferd.tokenizer import Tokenizer

    return Tokenizer.load(path)


def _tokenizer_from_meta(meta: dict):
    from inferd.tokenizer import Tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        return None
    return Tokenizer.from_gguf_metadata(meta)


# -- AWQ calibrated in memory (inferd eval's awq config, inferd quantize) ------------------------

def awq_model(model: str | None, group_size: int, dtype: str = "auto", calib: str = "wikitext",
              n_samples: int = 32, seqlen: int = 512, grid: int = 20, clip: bool = True,
              progress=None):
    """Load `model` in fp32, AWQ it, and return (LoadedModel in `dtype` on the int4 kernels, AWQResult)."""
    from inferd.data import calibration_ids
    from inferd.quant.awq import attach, awq_quantize, check_group_size

    lm = load_model(model, dtype="float32")
    check_group_size(lm.config, group_size)
    if lm.tokenizer is None:
        raise InferdError("AWQ calibration needs a model with a tokenizer")
    if seqlen > lm.config.max_position_embeddings:
        raise InferdError(f"--calib-seqlen {seqlen} exceeds the model's context length {lm.config.max_position_embeddings}")
    ids = calibration_ids(lm.tokenizer, n_samples, seqlen, calib)
    res = awq_quantize(lm.model, ids, group_size, grid, clip, progress)
    tdtype = resolve_dtype(dtype, packed=True)
    if tdtype != torch.float32:
        lm.model.to(tdtype)
        reset_rope(lm.model, lm.model.device)
    attach(lm.model, res.codes, group_size)
    return lm, res

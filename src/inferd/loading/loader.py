"""Resolve `--model` to files on disk and build a LlamaModel from them.

Accepted: the embedded models (None, "default", "smollm2-135m"; "gemma3-270m"), a `.gguf` file, a Hugging Face
folder (config.json + *.safetensors + tokenizer.json), or with `--load-format dummy` a built-in
config name. Nothing is ever downloaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

from inferd.config import LoadConfig, available_memory_bytes
from inferd.errors import InferdError
from inferd.gguf_file import DEFAULT_GGUF_FILE, default_model_path  # noqa: F401  (re-exported)
from inferd.loading.checks import check_config, check_gguf, check_safetensors, read_config_json
from inferd.loading.source import DEFAULT_MODEL_NAMES, ModelSource, resolve_model  # noqa: F401  (re-exported)
from inferd.model.config import ModelConfig, builtin_config, config_from_hf
from inferd.model import registry
from inferd.model.layers import Rope
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


def _hf_key_to_ours(name: str) -> str:
    for prefix in ("model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("self_attn.", "").replace("mlp.", "").replace("block_sparse_moe.", "")


# one expert's SwiGLU weights as checkpoints name them: (gate, up, down), Mixtral's and the others'
_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


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
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise InferdError(f"no *.safetensors weights in model folder {folder}")
    sd = {}
    for f in files:
        check_safetensors(f)
        try:
            part = load_file(f)
        except Exception as e:
            raise InferdError(f"cannot read {f}: {e}") from None
        for k, v in part.items():
            sd[_hf_key_to_ours(k)] = v
    return sd


def fuse_state_dict(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Checkpoint names (q/k/v, gate/up separate) -> our fused qkv_proj / gate_up_proj."""
    sd = dict(sd)
    for i in range(num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}{n}_proj.{kind}" for n in "qkv"]
            if all(n in sd for n in names):
                sd[f"{p}qkv_proj.{kind}"] = torch.cat([sd.pop(n) for n in names], 0)
        gu = [f"{p}gate_proj.weight", f"{p}up_proj.weight"]
        if all(n in sd for n in gu):
            sd[f"{p}gate_up_proj.weight"] = torch.cat([sd.pop(n) for n in gu], 0)
        _fuse_experts(sd, p)
    return sd


def _fuse_experts(sd: dict, p: str):
    """Checkpoint expert weights (HF: experts.E.w1/w3/w2 or experts.E.gate/up/down_proj; GGUF: stacked
    experts.gate/up/down_proj [E, ...]) -> ours, one fused gate/up per expert: experts.E.gate_up_proj,
    experts.E.down_proj."""
    e = p + "experts."
    if f"{e}gate_proj" in sd:  # stacked (GGUF)
        gate, up, down = (sd.pop(f"{e}{n}") for n in ("gate_proj", "up_proj", "down_proj"))
        for i in range(gate.shape[0]):
            sd[f"{e}{i}.gate_up_proj.weight"] = torch.cat([gate[i], up[i]], 0)
            sd[f"{e}{i}.down_proj.weight"] = down[i]
        return
    for gate, up, down in _EXPERT_NAMES:
        i = 0
        while f"{e}{i}.{gate}.weight" in sd:
            sd[f"{e}{i}.gate_up_proj.weight"] = torch.cat([sd.pop(f"{e}{i}.{gate}.weight"),
                                                         sd.pop(f"{e}{i}.{up}.weight")], 0)
            sd[f"{e}{i}.down_proj.weight"] = sd.pop(f"{e}{i}.{down}.weight")
            i += 1


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
    # allocated where it runs, uninitialised (not on the meta device and then `to_empty`, whose
    # empty_like goes through torch's Python reference ops: ~1 s of every load)
    with torch.device(device), _no_default_init():
        model = registry.model_class(cfg.architecture)(cfg)
    if state_dict is None:
        _init_random(model, cfg, seed)
    else:
        state_dict = fuse_state_dict(state_dict, cfg.num_hidden_layers)
        if "lm_head.weight" not in state_dict:
            if not cfg.tie_word_embeddings:
                cfg.tie_word_embeddings = True  # GGUFs without output.weight share the embedding
        elif cfg.tie_word_embeddings and not torch.equal(state_dict["lm_head.weight"],
                                                          state_dict["embed_tokens.weight"]):
            cfg.tie_word_embeddings = False
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        else:
            model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.embed_tokens.weight))
        expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing = expected - state_dict.keys()
        if missing:
            raise InferdError(f"weights missing from checkpoint: {sorted(missing)[:5]}")
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in state_dict.items():
                if k in params:
                    if params[k].shape != v.shape:
                        raise InferdError(f"weight {k} has shape {tuple(v.shape)}, config expects {tuple(params[k].shape)}")
                    params[k].copy_(v)
    model = model.to(dtype)
    reset_rope(model, device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


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
    return _load(cfg, shard)


def _load(lc: LoadConfig, shard=None) -> LoadedModel:
    from inferd import quant

    if lc.load_format not in ("auto", "gguf", "safetensors", "dummy"):
        raise InferdError(f"unknown load format {lc.load_format!r} (choose auto, gguf, safetensors, dummy)")
    dev = resolve_device(lc.device)
    src = resolve_model(lc.model, lc.load_format)
    if lc.quantization == "auto" and src.kind != "gguf":
        lc = dataclasses.replace(lc, quantization="none")  # an AWQ folder still serves as awq (below)
    method = quant.method(lc.quantization)
    dummy = lc.load_format == "dummy"
    tok = reader = None
    checkpoint = {}
    if src.kind == "builtin":
        cfg = builtin_config(src.name)
        sd = None
        if lc.with_tokenizer and src.name.lower().startswith("smollm2"):
            tok = _load_tokenizer(default_model_path())
    elif src.kind == "gguf":
        from inferd.gguf_file import open_gguf, read_metadata
        from inferd.loading import gguf as G

        check_gguf(src.path)  # before the gguf reader trusts a count or an offset
        reader = open_gguf(src.path)
        if lc.quantization == "auto":
            lc = auto_quantization(lc, reader, dev, dummy)
            method = quant.method(lc.quantization)
        meta = read_metadata(reader)
        cfg = _checked(lambda: G.config_from_metadata(meta, G.rope_tensors(reader)), src.path)
        sd = None if dummy else G.load_gguf_state_dict(reader, cfg)
        if lc.with_tokenizer:
            tok = _tokenizer_from_meta(meta)
    else:
        from inferd.quant.awq_checkpoint import read_quant_config, take_awq_linears

        cfg = _checked(lambda: config_from_hf(read_config_json(os.path.join(src.path, "config.json"))), src.path)
        awq = None if dummy else read_quant_config(src.path)
        sd = None if dummy else load_safetensors_folder(src.path)
        if awq is not None:
            if lc.quantization not in (None, "none", "awq"):
                raise InferdError(f"{src.path} is an AWQ checkpoint: it serves as --quantization awq, not {lc.quantization}")
            method = quant.method("awq")  # an AWQ folder is served as what it is
            checkpoint = {"parts": take_awq_linears(sd, cfg, awq["group_size"]), "group_size": awq["group_size"]}
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
    net = build_model(cfg, sd, tdtype, dev)

    def fp32_copy():
        return net if net.dtype == torch.float32 else build_model(cfg, sd, torch.float32, net.device)

    def calibration(n_samples: int, seqlen: int):
        from inferd.data import calibration_ids

        if tok is None:
            raise InferdError(f"{name} calibrates on WikiText-2 and needs the model's tokenizer")
        return calibration_ids(tok, n_samples, seqlen)

    ctx = quant.QuantContext(name, lc.quant_group_size, lc.quantize_lm_head, lc.dense_quant, lc.quantize_activations,
                             cfg, reader, checkpoint, calibration if tok is not None else None,
                             fp32_copy, (src.kind, src.path or src.name))
    for line in quant.apply(net, ctx, shard):
        log.info("%s", line)
    return LoadedModel(net, cfg, tok, src)


def auto_quantization(lc: LoadConfig, reader, dev, dummy: bool = False) -> LoadConfig:
    """`--quantization auto` for a GGUF file: served from its own blocks, as llama.cpp serves it, with
    activations rounded to int8 (W4A8 / W8A8 / the block kernel) and the output layer from its own
    Q8_0 or block codes; `none` (the dequantized weights) where that cannot run: no native kernels,
    not the CPU, random weights, fp32-activation evaluation, or no layer of a type with a kernel."""
    from inferd.kernels import native
    from inferd.quant.gguf_native import head_has_kernel, layers_with_kernels

    if dummy or dev.type != "cpu" or lc.dense_quant or native.ops() is None or not layers_with_kernels(reader):
        return dataclasses.replace(lc, quantization="none")
    return dataclasses.replace(lc, quantization="gguf", quantize_activations=True,
                               quantize_lm_head=lc.quantize_lm_head or head_has_kernel(reader))


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

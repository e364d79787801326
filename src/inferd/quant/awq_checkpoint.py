"""AWQ checkpoints in the common Hugging Face layout ("GEMM" version), read and written.

Per linear layer with torch weight W [out, in] and groups of G input channels, the folder holds

    qweight  int32 [in, out / 8]     eight 4-bit codes per word, along the output dimension
    qzeros   int32 [in / G, out / 8] integer zero points, packed the same way
    scales   fp16  [in / G, out]

and W[o, i] = (q[i, o] - z[i // G, o]) * s[i // G, o]. Within a word, nibble k (bits 4k..4k+3)
holds output channel 8c + PACK_ORDER[k] -- the interleaving the GEMM kernels were written for.

In inferd's int4 form (w = q * scale + min) that is scale = s and min = -z * s: both products are
exact in fp32 (an fp16 scale times a 4-bit integer), so a checkpoint loads to exactly the weights it
describes.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from inferd.errors import InferdError

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


# -- packing ----------------------------------------------------------------------------------

def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int [R, C] in 0..15 -> int32 [R, C / 8] in the GEMM nibble order."""
    R, C = x.shape
    if C % 8:
        raise InferdError(f"cannot pack {C} columns into 32-bit words (need a multiple of 8)")
    if int(x.min()) < 0 or int(x.max()) > 15:
        raise InferdError("4-bit codes must lie in 0..15")
    cols = x.to(torch.int64).reshape(R, C // 8, 8)
    word = torch.zeros(R, C // 8, dtype=torch.int64)
    for k, ch in enumerate(PACK_ORDER):
        word |= cols[:, :, ch] << (4 * k)
    # int32 words as the checkpoints store them (two's complement)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> int32 [R, C] in 0..15 (inverse of pack_int4)."""
    R, n = w.shape
    w = w.to(torch.int32)
    out = torch.empty(R, n, 8, dtype=torch.int32)
    for k, ch in enumerate(PACK_ORDER):
        out[:, :, ch] = (w >> (4 * k)) & 0xF  # the mask also discards the sign bits of the shift
    return out.reshape(R, n * 8)


def to_affine_int4(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor):
    """Codes q [out, in], integer zeros z and fp16 scales s [out, in / G] -> (q, scale, min) of
    inferd's int4 form, fp32."""
    scale = s.float()
    return q.to(torch.int32), scale, -z.float() * scale


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    N, K = q.shape
    g = (q.reshape(N, K // group_size, group_size).float() - z.float()[..., None]) * s.float()[..., None]
    return g.reshape(N, K)


# -- reading ----------------------------------------------------------------------------------

QUANT_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def read_quant_config(folder: str) -> dict | None:
    """The folder's quantization_config when it is an AWQ one; errors on AWQ variants we cannot run."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, json.JSONDecodeError):
        return None  # the loader reports a missing or broken config.json
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "awq":
        return None
    bits = qc.get("bits", qc.get("w_bit", 4))
    group = qc.get("group_size", qc.get("q_group_size", 128))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise InferdError(f"AWQ checkpoint with {bits}-bit weights: only 4-bit is supported")
    if version != "gemm":
        raise InferdError(f"AWQ checkpoint version {version!r}: only the GEMM layout is supported")
    if not qc.get("zero_point", True):
        raise InferdError("AWQ checkpoint without zero points: only zero_point=true is supported")
    if group not in (32, 64, 128, 256):
        raise InferdError(f"AWQ group size {group}: the int4 kernel takes 32, 64, 128 or 256")
    return {"group_size": int(group)}


def take_awq_linears(sd: dict[str, torch.Tensor], cfg, group_size: int) -> dict:
    """Pop every layer's qweight/qzeros/scales out of `sd` (our key names, unfused) and return
    {(layer, fused name): (q [out, in], scale, zero)} in PyTorch's int4 layout, q/k/v and gate/up
    concatenated along the output as the model fuses them. In their place `sd` gets zero-stride
    placeholders of the float weight's shape so the model builds without materialising them."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        for fused, parts in QUANT_PARTS.items():
            keys = [f"layers.{i}.{p}" for p in parts]
            have = [f"{k}.qweight" in sd for k in keys]
            if not any(have):
                continue
            if not all(have):
                raise InferdError(f"layer {i}: {', '.join(parts)} must be all quantized or all float")
            qs, ss, zs = [], [], []
            for k in keys:
                try:
                    qw, qz, sc = sd.pop(f"{k}.qweight"), sd.pop(f"{k}.qzeros"), sd.pop(f"{k}.scales")
                except KeyError as e:
                    raise InferdError(f"AWQ checkpoint: {e.args[0]} is missing") from None
                K = qw.shape[0]
                N = qw.shape[1] * 8
                if K % group_size or tuple(qz.shape) != (K // group_size, N // 8) or tuple(sc.shape) != (K // group_size, N):
                    raise InferdError(f"AWQ checkpoint: {k} has qweight {tuple(qw.shape)}, qzeros {tuple(qz.shape)}, "
                                      f"scales {tuple(sc.shape)}, inconsistent with group size {group_size}")
                q = unpack_int4(qw).t().contiguous()
                z = unpack_int4(qz).t().contiguous()
                q, scale, mn = to_affine_int4(q, z, sc.to(torch.float16).t().contiguous())
                qs.append(q), ss.append(scale), zs.append(mn)
            out[(i, fused)] = (torch.cat(qs), torch.cat(ss), torch.cat(zs))
            sd[f"layers.{i}.{fused}.weight"] = torch.zeros(()).expand(sum(q.shape[0] for q in qs), qs[0].shape[1])
    if not out:
        raise InferdError("AWQ checkpoint without any qweight tensors")
    return out


def attach_awq_linears(model, parts: dict, group_size: int) -> int:
    from inferd.quant.linear import Int4Linear

    for (i, name), (q, scale, mn) in parts.items():
        layer = model.layers[i]
        lin = getattr(layer, name)
        if q.shape[0] % 16:
            raise InferdError(f"layer {i} {name}: {q.shape[0]} output rows; the int4 kernel needs a multiple of 16")
        setattr(layer, name, Int4Linear(q, scale, mn, group_size, lin.bias, model.dtype))
    return len(parts)


# -- writing ----------------------------------------------------------------------------------

def hf_config(cfg, group_size: int, extra: dict | None = None) -> dict:
    from inferd.model import registry

    d = {
        "architectures": [registry.by_name(cfg.architecture).hf[0]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                "zero_point": True, "version": "gemm", **(extra or {})},
    }
    if cfg.architecture == "mistral":
        d["sliding_window"] = cfg.sliding_window
    if cfg.architecture in ("qwen2", "qwen3"):
        d["use_sliding_window"] = False
    return d


def awq_state_dict(model, codes: dict, group_size: int) -> dict[str, torch.Tensor]:
    """Hugging Face names and layout: float tensors in fp16, quantized linears split back into
    q/k/v and gate/up and packed. `codes[(layer, fused name)] = (q, z, s)` as awq.quantize_layer
    returns them."""
    cfg = model.cfg
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.weight
    hd, nq, nk, ff = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    rows = {"qkv_proj": [nq * hd, nk * hd, nk * hd], "gate_up_proj": [ff, ff], "o_proj": None, "down_proj": None}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for fused, parts in QUANT_PARTS.items():
            sub = "self_attn." if fused in ("qkv_proj", "o_proj") else "mlp."
            q, z, s = codes[(i, fused)]
            split = rows[fused] or [q.shape[0]]
            bias = getattr(getattr(layer, fused), "bias", None)
            for name, qq, zz, ss, bb in zip(parts, q.split(split), z.split(split), s.split(split),
                                           bias.split(split) if bias is not None else [None] * len(parts)):
                key = f"{p}{sub}{name}."
                sd[key + "qweight"] = pack_int4(qq.t())
                sd[key + "qzeros"] = pack_int4(zz.t())
                sd[key + "scales"] = ss.t().to(torch.float16)
                if bb is not None:
                    sd[key + "bias"] = bb
    return {k: (v.detach().to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def save_tokenizer(tok, folder: str, source) -> None:
    """Make the folder self-contained: copy a HF folder's tokenizer files, or write them out for a
    tokenizer rebuilt from GGUF metadata (tokenizer.json, special tokens, chat template)."""
    if source is not None and source.kind == "hf" and os.path.isfile(os.path.join(source.path, "tokenizer.json")):
        for name in TOKENIZER_FILES:
            src = os.path.join(source.path, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(folder, name))
        return
    tok.backend.save(os.path.join(folder, "tokenizer.json"))
    name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_token_id),
          "eos_token": name(tok.eos_token_id), "pad_token": name(tok.pad_token_id),
          "unk_token": name(tok.unk_token_id), "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos),
          "clean_up_tokenization_spaces": False}
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in tc.items() if v is not None}, f, indent=2, ensure_ascii=False)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": sorted(tok.eos_token_ids)}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)


def save_awq(folder: str, model, codes: dict, group_size: int, tokenizer=None, source=None,
             quant_extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise InferdError(f"output folder {folder} exists and is not empty")
    os.makedirs(folder, exist_ok=True)
    save_file(awq_state_dict(model, codes, group_size), os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(model.cfg, group_size, quant_extra), f, indent=2)
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder, source)


def apply(model, ctx) -> str:
    """The registry's entry for `awq`: the int4 linears a checkpoint folder holds (read at load)."""
    if not ctx.checkpoint:
        raise InferdError("--quantization awq needs an AWQ checkpoint folder (quantization_config.quant_method "
                          "awq); make one with `inferd quantize --method awq`")
    if model.device.type != "cpu":
        raise InferdError("AWQ int4 kernels are CPU-only in this build")
    g = ctx.checkpoint["group_size"]
    n = attach_awq_linears(model, ctx.checkpoint["parts"], g)
    return f"AWQ checkpoint: {n} int4 linears (group {g})"

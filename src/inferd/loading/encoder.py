"""What the loader does differently for an encoder (BERT) and for any model served as a pooling
model: the encoder's weights into `inferd.model.bert`, and the pooling a model folder declares in
its sentence-transformers files.

sentence-transformers describes a model as a pipeline in `modules.json`: the transformer, then a
`Pooling` module (its `config.json` says mean, CLS, last token, ...), then optionally `Normalize`;
`sentence_bert_config.json` holds `max_seq_length`, the longest input the model was trained for
(all-MiniLM-L6-v2: 256, though its position table has 512 rows).
"""
from __future__ import annotations

import json
import os

import torch

from inferd.errors import InferdError
from inferd.model.config import ModelConfig
from inferd.model.pooling import PoolingConfig

# 1_Pooling/config.json's switches -> our modes (others: max, mean_sqrt_len, weightedmean: refused)
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
# modules sentence-transformers may list that compute nothing we skip
_ST_PASSIVE = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


def build_encoder(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None, dtype, device, seed: int = 0):
    from inferd.model import bert

    with torch.device(device):
        model = bert.BertModel(cfg)
    if state_dict is None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
    else:
        sd = bert.hf_state_dict(state_dict, cfg.num_hidden_layers)
        expected = model.state_dict()
        missing = sorted(expected.keys() - sd.keys())
        if missing:
            raise InferdError(f"weights missing from checkpoint: {missing[:5]}")
        with torch.no_grad():
            for k, p in expected.items():
                if p.shape != sd[k].shape:
                    raise InferdError(f"weight {k} has shape {tuple(sd[k].shape)}, config expects {tuple(p.shape)}")
                p.copy_(sd[k])
    model = model.to(dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def read_pooling(folder: str | None, override: str | None = None) -> PoolingConfig | None:
    """The pooling a sentence-transformers folder declares, or None where it has no modules.json;
    `override` (--pooling) replaces its mode, and a mode we lack is then no error."""
    if folder is None or not os.path.isfile(os.path.join(folder, "modules.json")):
        return None
    modules = _json(os.path.join(folder, "modules.json"))
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise InferdError(f"{folder}/modules.json: not a list of modules")
    mode, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind not in _ST_PASSIVE:
            raise InferdError(f"{folder}: sentence-transformers module {kind!r} is not supported "
                              f"(supported: Transformer, Pooling, Normalize)")
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            mode = override or _pooling_mode(folder, str(m.get("path", "")))
    max_len = None
    st = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(st):
        v = _json(st).get("max_seq_length")
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InferdError(f"{st}: max_seq_length {v!r} is not a positive integer")
            max_len = v
    return PoolingConfig(mode or "cls", normalize, max_len)


def _pooling_mode(folder: str, sub: str) -> str:
    path = os.path.realpath(os.path.join(folder, sub, "config.json"))
    if not path.startswith(os.path.realpath(folder) + os.sep):
        raise InferdError(f"{folder}/modules.json: pooling path {sub!r} is outside the model folder")
    cfg = _json(path)
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v is True]
    modes = [_ST_MODES.get(k) for k in on]
    if len(on) != 1 or modes[0] is None:
        raise InferdError(f"{path}: pooling {', '.join(on) or 'none'} is not supported (one of mean, cls, "
                          "last token); choose one with --pooling")
    return modes[0]


def _json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InferdError(f"cannot read {path}: {e}") from None

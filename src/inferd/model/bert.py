"""BERT, the encoder family (all-MiniLM-L6-v2, BGE, E5, ...): one flat token batch, like the decoders.

What differs from `llama`: every token sees its whole sequence (the attention backend passed in is
bidirectional within each sequence, `inferd.model.pooling_attention`), positions are a learned
table and not a rotation, a token-type row is added to each embedding, the norms are LayerNorms
after each residual add (post-norm), and the MLP is one GELU projection, not a gated one. There is
no KV cache and no LM head: the output is the last layer's hidden states, which a pooling step
(`inferd.model.pooling`) turns into one vector a sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferd.model.config import ModelConfig

# nn.Linear, not layers.Linear: an encoder's batches are many rows, where F.linear's x @ W^T with the
# bias fused (addmm) measured 1.3-1.7x faster than the decoders' (W @ x^T)^T on this CPU, fp32 and bf16
Linear = nn.Linear


def activation(name: str):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation {name!r}")


class BertLayer(nn.Module):
    """q/k/v stored fused into one matmul, as the decoders hold them."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.idx = idx
        h = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = Linear(h, 3 * self.n_heads * self.head_dim, bias=True)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=True)
        self.attention_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up_proj = Linear(h, cfg.intermediate_size, bias=True)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=True)
        self.output_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        t, nh = x.shape[0], self.n_heads
        qkv = self.qkv_proj(x).view(t, 3 * nh, self.head_dim)
        o = attn(self.idx, qkv[:, :nh], qkv[:, nh:2 * nh], qkv[:, 2 * nh:])
        x = self.attention_norm(self.o_proj(o).add_(x))
        return self.output_norm(self.down_proj(self.act(self.up_proj(x))).add_(x))


class BertModel(nn.Module):
    encoder = True  # no KV cache, no logits: the pooling runner's (inferd.engine.pooling)
    fused_decode = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.type_vocab_size), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg, i) for i in range(cfg.num_hidden_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_norm.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (positions restart at 0 in each sequence) -> hidden states [T, hidden].
        Token types default to 0, the first segment (an embedding request has one)."""
        x = self.embed_tokens(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x += self.token_type_embeddings.weight[0]
        else:
            x += self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, attn)
        return x


# Hugging Face's names (after an optional `bert.` prefix) -> ours; q/k/v are fused by `fuse_qkv`
_HF_NAMES = (
    ("embeddings.word_embeddings.", "embed_tokens."),
    ("embeddings.position_embeddings.", "position_embeddings."),
    ("embeddings.token_type_embeddings.", "token_type_embeddings."),
    ("embeddings.LayerNorm.", "embed_norm."),
    ("encoder.layer.", "layers."),
    (".attention.self.query.", ".q_proj."),
    (".attention.self.key.", ".k_proj."),
    (".attention.self.value.", ".v_proj."),
    (".attention.output.dense.", ".o_proj."),
    (".attention.output.LayerNorm.", ".attention_norm."),
    (".intermediate.dense.", ".up_proj."),
    (".output.dense.", ".down_proj."),
    (".output.LayerNorm.", ".output_norm."),
)


def hf_state_dict(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A BERT checkpoint's tensors under our names, q/k/v fused; heads (pooler, MLM) left out."""
    out = {}
    for name, t in sd.items():
        if name.startswith("bert."):
            name = name[len("bert."):]
        if not name.startswith(("embeddings.", "encoder.")) or name.endswith("position_ids"):
            continue
        for old, new in _HF_NAMES:
            name = name.replace(old, new)
        out[name] = t
    for i in range(num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}{n}_proj.{kind}" for n in "qkv"]
            if all(n in out for n in names):
                out[f"{p}qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names], 0)
    return out

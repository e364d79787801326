"""A linear layer whose weights are still in the file: the loader's placeholder between the model's
skeleton and the layer a quantization method builds.

The loader (inferd.loading.plan) gives every projection of the skeleton its `parts`: the file's
tensors stacked along the output rows (q, k, v for `qkv_proj`; gate, up for `gate_up_proj`; one
expert's slice of a 3-D expert tensor), each with the row order the model wants. A method then
builds its own layer from the parts (`gguf`: from their raw blocks; `int4`/`int8`: one layer's
dense weight at a time), and whatever is left is materialized dense (`materialize`), one layer at
a time, so no step of a load ever holds the whole model twice.

A part is duck-typed (inferd.loading.plan.Part): `shape` ((rows, cols), torch order), `type` (the
file's type name: a GGML type such as "Q4_K", or a torch dtype's name for safetensors), and
`dense(dtype)` (its rows dequantized, in that dtype); GGUF parts also have `raw()` and `rows`.
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.model.layers import Linear


class PlannedLinear(nn.Module):
    """Holds no weights: where they are (`parts`, `bias_parts`) and the layer's shape."""

    def __init__(self, parts: list, bias_parts: list | None, in_features: int, out_features: int):
        super().__init__()
        self.parts = list(parts)
        self.bias_parts = list(bias_parts) if bias_parts else None
        self.in_features, self.out_features = in_features, out_features
        rows = sum(p.shape[0] for p in self.parts)
        if rows != out_features or any(p.shape[1] != in_features for p in self.parts):
            raise ValueError(f"parts {[tuple(p.shape) for p in self.parts]} do not make a "
                             f"[{out_features}, {in_features}] layer")

    @property
    def types(self) -> list[str]:
        return [p.type for p in self.parts]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`, each part dequantized straight into its rows."""
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        a = 0
        for p in self.parts:
            n = p.shape[0]
            w[a:a + n] = p.dense(dtype)
            a += n
        return w

    def dense_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.bias_parts:
            return None
        return torch.cat([p.dense(dtype).reshape(-1) for p in self.bias_parts])

    def materialize(self, dtype: torch.dtype) -> Linear:
        """The dense layer (the `none` method's, and every method's fallback)."""
        lin = Linear(self.in_features, self.out_features, bias=self.bias_parts is not None, device="meta")
        lin.weight = nn.Parameter(self.dense_weight(dtype), requires_grad=False)
        if self.bias_parts is not None:
            lin.bias = nn.Parameter(self.dense_bias(dtype), requires_grad=False)
        return lin

    def take_rows(self, rows: torch.Tensor, take=None) -> "PlannedLinear":
        """Tensor parallelism's column cut, before anything is read: each part keeps its rows."""
        def cut(parts):
            return [parts[i].take_rows(mine) for i, mine in rows_by_part(rows, [p.shape[0] for p in parts])]

        return PlannedLinear(cut(self.parts), cut(self.bias_parts) if self.bias_parts else None,
                             self.in_features, int(rows.numel()))

    def take_cols(self, a: int, b: int, take=None) -> "PlannedLinear":
        """Tensor parallelism's row cut: input columns [a, b) of every part."""
        return PlannedLinear([p.take_cols(a, b) for p in self.parts], self.bias_parts, b - a, self.out_features)

    def dense_bytes(self, dtype: torch.dtype) -> int:
        return self.out_features * self.in_features * torch.empty((), dtype=dtype).element_size()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts={self.types}"


def rows_by_part(rows: torch.Tensor, counts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """Output rows `rows` of a layer stacked from parts of `counts` rows each -> (part index, its own
    rows among them) for every part that keeps any: how each layer of parts (this placeholder, the
    GGUF layers of inferd.quant.gguf_layer) takes tensor parallelism's column cut."""
    out, a = [], 0
    for i, n in enumerate(counts):
        mine = rows[(rows >= a) & (rows < a + n)] - a
        if mine.numel():
            out.append((i, mine))
        a += n
    return out


def children_of(model: nn.Module, kind: type | tuple[type, ...]):
    """(parent, attribute name, child) for every submodule of type `kind`: the walk of every pass that
    swaps a model's layers in place (the placeholders here, the GGUF layers' finalize, the rewrite to
    int8 activations)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                yield parent, name, child


def planned(model: nn.Module):
    """(parent, attribute name, PlannedLinear) for every placeholder left in the model."""
    return children_of(model, PlannedLinear)


def role(path: str) -> str:
    """What a linear is by its module path: "qkv_proj", "lm_head", ... (a tensor-parallel wrapper's
    `inner` is the layer it wraps)."""
    parts = [p for p in path.split(".") if p != "inner"]
    return parts[-1] if parts else path


def planned_paths(model: nn.Module):
    """(path, parent, attribute name, PlannedLinear) for every placeholder left in the model."""
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PlannedLinear):
                yield f"{path}.{name}".lstrip("."), parent, name, child


def materialize(model: nn.Module, dtype: torch.dtype | None = None, on_layer=None, release=None) -> int:
    """Every placeholder left -> its dense layer, one at a time; returns how many. `on_layer(name,
    layer)` is told of each (the loader counts and logs dense fallbacks), `release(parts)` after each
    (the loader drops the file pages it read)."""
    dtype = dtype or model.dtype
    n = 0
    for path, parent, name, lin in list(planned_paths(model)):
        if on_layer is not None:
            on_layer(path, lin)
        setattr(parent, name, lin.materialize(dtype))
        if release is not None:
            release(lin.parts)
        n += 1
    return n

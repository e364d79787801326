"""Rows of a GGUF tensor dequantized: the one dequantizer of the file's blocks.

Every reader of dense values goes through `dequantize_rows`: the loader's `none` route (each layer
dequantized straight into its rows), a row lookup of an embedding table kept in the file's type
(`GGUFEmbedding`), the dense fallback of a type without a kernel. The native kernel computes it
where it built; the `gguf` package's own block maths (`dequantize_numpy`) is the path without it
and the tests' oracle: the two agree bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inferd.errors import InferdError

_WHOLE_TENSOR = {"Q4_0", "Q4_1", "Q8_0"}


def dequantize_numpy(data: np.ndarray, type_name: str) -> np.ndarray:
    """The `gguf` package's dequantization of raw rows [N, bytes] (or F32/F16 values) -> float32
    [N, K]: the oracle, and the path without native kernels."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if qtype == GGMLQuantizationType.F32:
        return np.array(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    data = np.asarray(data)
    if qtype == GGMLQuantizationType.Q8_0:
        # d * q per 32-block, gguf's own product, in torch (threaded): the gguf package's numpy took
        # 9 s of Gemma 3 270M's load on its 262k-row embedding
        blk = data.reshape(-1, 34)
        d = torch.from_numpy(np.ascontiguousarray(blk[:, :2]).view(np.float16)).float()
        q = torch.from_numpy(np.ascontiguousarray(blk[:, 2:]).view(np.int8)).float()
        return (d * q).numpy().reshape(data.shape[0], -1)
    if type_name in _WHOLE_TENSOR:
        # the gguf package's own block maths, on every block of the tensor in one call: its
        # quants.dequantize walks row groups in Python (1.8 s of the default model's 2.2 s load)
        from gguf import GGML_QUANT_SIZES

        cls = getattr(quants, type_name)
        return cls.dequantize_blocks(data.reshape(-1, GGML_QUANT_SIZES[qtype][1])).reshape(data.shape[0], -1)
    try:
        arr = quants.dequantize(data, qtype)
    except NotImplementedError:
        raise InferdError(f"GGUF quantization type {type_name} is not supported") from None
    return np.asarray(arr, dtype=np.float32)



def ggml_type_id(type_name: str) -> int:
    """ggml's number of a type name ("Q4_K" -> 12)."""
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[type_name])


def mapped(raw: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only) numpy view of the file's mapping, no copy. torch warns that it
    could write through a read-only array: nothing here does (kernels only read their inputs)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def native_parts(parts: list):
    """(raw tensors, row orders) of plan parts for the native repack ops, or None without them."""
    from inferd.kernels import native

    ops = native.ops()
    if ops is None or not hasattr(ops, "repack_blocks"):
        return None
    return [mapped(np.asarray(p.raw())) for p in parts], [getattr(p, "rows", None) for p in parts]


def _native():
    from inferd.kernels import native

    ops = native.ops()
    return ops if ops is not None and hasattr(ops, "dequant_rows") else None


def dequantize_rows(raw: np.ndarray, type_name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` (all when None) of raw GGUF data [N, bytes a row] (F32/F16: values) -> float32
    torch [len(rows), K], freshly allocated. A 1-D tensor (a norm, a bias) comes back 1-D."""
    flat = raw.ndim == 1
    if flat:
        raw = raw.reshape(1, -1)
        if rows is not None:
            raise InferdError("a row order applies to matrices")
    if rows is not None:
        raw = raw[rows.numpy()]
    out = torch.from_numpy(np.require(dequantize_numpy(raw, type_name), requirements=["W", "C"]))
    return out.reshape(-1) if flat else out


class GGUFEmbedding(nn.Module):
    """The token table in the file's own type, read in place from the file's mapping: a lookup
    dequantizes just the rows it asks for. An 8B model's Q4_K table is 0.3 GB of the file instead of
    2.1 GB of float32, and only the rows ever looked up are read."""

    def __init__(self, part, dtype: torch.dtype):
        super().__init__()
        self.part = part  # inferd.loading.plan.GGUFPart (not a tensor: nothing to move or save)
        self.num_embeddings, self.embedding_dim = part.shape
        self.dtype = dtype

    @property
    def type(self) -> str:
        return self.part.type

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.part.raw(), self.part.type, ids.reshape(-1).cpu())
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def dense_rows(self, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) as a float table (tensor parallelism's vocabulary slice)."""
        return dequantize_rows(self.part.raw(), self.part.type, torch.arange(a, b)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.type}, {self.num_embeddings} x {self.embedding_dim}, mapped"

"""A GGUF's token table kept in the file's own type and read in place (`GGUFEmbedding`).

It sits with the model's other layers, below quantization and loading: all it needs is the file's
mapped rows and kernels.repack's dequantizer (the native kernel where it built, the `gguf` package's
own block maths otherwise, the two equal bit for bit: tests/test_repack.py).
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.kernels import repack


class GGUFEmbedding(nn.Module):
    """The token table in the file's own type, read in place from the file's mapping: a lookup
    dequantizes just the rows it asks for. An 8B model's Q4_K table is 0.3 GB of the file instead of
    2.1 GB of float32, and only the rows ever looked up are read."""

    in_place = True  # read by name where this class is not imported (tensor parallelism's vocabulary split)

    def __init__(self, part, dtype: torch.dtype):
        super().__init__()
        self.part = part  # inferd.loading.plan.GGUFPart (not a tensor: nothing to move or save)
        self.num_embeddings, self.embedding_dim = part.shape
        self.dtype = dtype
        self._raw = repack.raw_bytes(part.raw())  # a view of the mapping, made once (~40 us a call else)
        self._type = int(repack.ggml_type(part.type))
        self._native = part.type in repack.NATIVE_TYPES

    @property
    def type(self) -> str:
        return self.part.type

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from inferd.kernels.native import ops

        flat = ids.reshape(-1).to(torch.int64).cpu()
        k = ops() if self._native else None
        rows = k.dequant_rows(self._raw, flat, self._type) if k is not None else \
            repack.dequantize_rows(self._raw, flat, self._type)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.type}, {self.num_embeddings} x {self.embedding_dim}, mapped"

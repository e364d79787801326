"""GGUF tensors read where they lie: their raw bytes as torch tensors without a copy, and their rows
dequantized (csrc/cpu/repack.cpp's `dequant_rows`; the `gguf` package's dequantize without native
code).

A GGUF tensor's data is a view of the file's read-only mapping (inferd.gguf_file). torch.from_numpy
accepts such a view without copying but warns that torch cannot mark a tensor read-only; nothing
here writes to it, so that warning is silenced at the one place a view is made. The op wrappers of
the layers above (quant.gguf_layer.repack, through quant.gguf_blocks.stacked) take their parts
through `raw_bytes` too.

This lives with the kernels, below the model, the quantization and the loading code, so that any of
them (the loader's whole tensors, an embedding read from the file's rows at each step) can call it.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.kernels import native

# the GGUF types dequant_rows computes natively (everything inferd serves); others go through gguf
NATIVE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS")


def ggml_type(t):
    """A GGMLQuantizationType from itself, its name or its number."""
    from gguf import GGMLQuantizationType as Q

    try:
        return Q[t] if isinstance(t, str) else Q(int(t))
    except (KeyError, ValueError):
        raise InferdError(f"unknown GGUF tensor type {t!r}") from None


def _data(src):
    """A GGUF tensor object's data (inferd's GGUFTensor or gguf's ReaderTensor), else src itself."""
    return src.data if hasattr(src, "tensor_type") and hasattr(src, "data") else src


def raw_bytes(src) -> torch.Tensor:
    """A GGUF tensor's data as uint8 [rows, row bytes] sharing its memory: `src` a GGUF tensor
    object, a numpy array (the reader's read-only memmap views included; typed F32/F16 data is
    viewed as its bytes) or a torch tensor. A 1-D tensor is one row; leading axes (a mixture of
    experts' stack) are folded into the rows. Copies only what cannot be viewed: data whose
    innermost axis is not contiguous."""
    data = _data(src)
    if isinstance(data, torch.Tensor):
        t = data if data.dim() >= 2 else data.reshape(1, -1)
        t = t.reshape(-1, t.shape[-1])
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            t = t.contiguous()
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    a = np.asarray(data)
    if a.ndim == 0:
        raise InferdError("a GGUF tensor's data cannot be a scalar")
    a = a.reshape(1, -1) if a.ndim == 1 else a.reshape(-1, a.shape[-1])
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    a = a.view(np.uint8)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # read, never written (see the module's docstring)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(a)


def row_order(rows, n: int | None = None) -> torch.Tensor | None:
    """An optional row list (a permutation, or a subset of rows) as int64, for the repack ops."""
    if rows is None:
        return None
    r = torch.as_tensor(np.asarray(rows) if not isinstance(rows, torch.Tensor) else rows).reshape(-1)
    if r.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise InferdError(f"row indices must be integers (got {r.dtype})")
    r = r.to(torch.int64)
    if n is not None and r.numel() and (int(r.min()) < 0 or int(r.max()) >= n):
        raise InferdError(f"a row index lies outside the part's {n} rows")
    return r


def dequantize_rows(src, ids=None, type=None) -> torch.Tensor:
    """Rows of a GGUF tensor dequantized to float32 [len(ids), K] (ids None: every row, [N, K]; ids of
    another shape: [*ids.shape, K]), equal to gguf.quants.dequantize of those rows bit for bit.
    `src`: a GGUF tensor object (its type read from it) or its data with `type` (a GGMLQuantizationType,
    its name or number). Natively for every type in NATIVE_TYPES (a handful of ids run on the calling
    thread: an embedding lookup; many rows on torch's threads); the gguf package otherwise. Each call
    views the data afresh (~40 us); a caller at every step holds `raw_bytes(t)` and calls
    torch.ops.inferd.dequant_rows(raw, ids, int(type)) itself (~5 us for a few rows)."""
    if type is None:
        type = getattr(src, "tensor_type", None)
        if type is None:
            raise InferdError("dequantize_rows needs the GGUF type of raw data")
    qtype = ggml_type(type)
    raw = raw_bytes(src)
    N = raw.shape[0]
    if ids is None:
        idx = torch.arange(N)
    else:
        idx = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else np.asarray(ids))
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise InferdError(f"row ids must be integers (got {idx.dtype})")
        idx = idx.to(torch.int64)
    kernels = native.ops()
    if kernels is not None and qtype.name in NATIVE_TYPES:
        return kernels.dequant_rows(raw, idx, int(qtype))
    return _gguf_rows(raw, idx, qtype)


def _gguf_rows(raw: torch.Tensor, idx: torch.Tensor, qtype) -> torch.Tensor:
    """The gguf package's own dequantization of those rows (the fallback, and the oracle)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    N = raw.shape[0]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= N):
        raise InferdError(f"a row id lies outside the tensor's {N} rows")
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    if raw.shape[1] % nbytes:
        raise InferdError(f"{raw.shape[1]} bytes a row is not whole {qtype.name} blocks of {nbytes} bytes")
    K = raw.shape[1] // nbytes * weights
    rows = raw.numpy()[idx.reshape(-1).numpy()]
    try:
        out = np.asarray(dequantize(rows, qtype), dtype=np.float32).reshape(-1, K)
    except NotImplementedError:
        raise InferdError(f"GGUF type {qtype.name} cannot be dequantized") from None
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(*idx.shape, K)

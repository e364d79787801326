"""The tensor plan: for every module of the model, its parts in the weight file.

One route from a file to running layers (llama.cpp's loader keeps a map of name -> file offset and
hands each tensor to its backend once; this is ours):

    file (GGUF mapped, safetensors mapped)  ->  plan (module -> parts, from the family's names)
      ->  skeleton (the model built on the meta device: no weights)
      ->  each placeholder built by the quantization method from its parts (inferd.quant.apply)

A part is one tensor of the file (or one expert's slice of a 3-D expert tensor) with the row order
the model wants: llama.cpp's interleaved q/k rows are undone by a row permutation, never by a copy
of the tensor. Fusion (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, an expert's gate/up) is
a list of parts; norm offsets (Gemma's files store 1 + w) are a constant the part subtracts. Nothing
is read until a method asks a part for its raw blocks or its dense rows.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from inferd.errors import InferdError
from inferd.gguf_file import unpermute_qk

# -- parts --------------------------------------------------------------------------------------


@dataclass(eq=False)
class GGUFPart:
    """One GGUF tensor (or expert `expert` of a 3-D one), rows reordered by `rows`."""
    tensor: object  # gguf_file.GGUFTensor
    expert: int | None = None
    rows: torch.Tensor | None = None  # output row r comes from the tensor's row rows[r]
    offset: float = 0.0  # subtracted after dequantizing (Gemma's norms)
    cols: tuple[int, int] | None = None  # input columns [a, b) only (tensor parallelism's row cut)

    @property
    def name(self) -> str:
        return self.tensor.name if self.expert is None else f"{self.tensor.name}[{self.expert}]"

    @property
    def type(self) -> str:
        return self.tensor.tensor_type.name

    @property
    def shape(self) -> tuple[int, ...]:
        dims = [int(d) for d in self.tensor.shape]  # GGUF order: the innermost first
        if self.expert is not None:
            dims = dims[:-1]
        out = tuple(reversed(dims))
        if self.rows is not None:
            out = (int(self.rows.numel()),) + out[1:]
        if self.cols is not None:
            out = out[:1] + (self.cols[1] - self.cols[0],)
        return out

    def raw(self) -> np.ndarray:
        """The file's bytes (or values, for F32/F16) of every source row, in file order: a view of
        the mapping, [rows, bytes a row] for a matrix (only columns `cols` of each row)."""
        data = self.tensor.data
        if self.expert is not None:
            data = data[self.expert]
        if self.cols is None:
            return data
        a, b = self.cols
        if data.dtype != np.uint8:  # F32/F16: values, not bytes
            return data[:, a:b]
        elems, nbytes = self.block()
        return data[:, a // elems * nbytes:b // elems * nbytes]

    def block(self) -> tuple[int, int]:
        """(weights, bytes) of one block of the part's type."""
        from inferd.gguf_file import ggml_block

        return ggml_block(int(self.tensor.tensor_type))

    def take_rows(self, rows: torch.Tensor) -> "GGUFPart":
        """Only output rows `rows` (of this part's own numbering)."""
        return dataclasses.replace(self, rows=rows if self.rows is None else self.rows[rows])

    def take_cols(self, a: int, b: int) -> "GGUFPart":
        """Only input columns [a, b): whole blocks of the type, else a clear error."""
        elems, _ = self.block()
        if a % elems or b % elems:
            raise InferdError(f"{self.name} ({self.type}) cannot be cut at columns {a}:{b}: its blocks hold "
                              f"{elems} weights")
        base = self.cols[0] if self.cols else 0
        return dataclasses.replace(self, cols=(base + a, base + b))

    @property
    def nbytes(self) -> int:
        n = int(self.tensor.n_bytes)
        return n // int(self.tensor.shape[-1]) if self.expert is not None else n

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from inferd.loading.gguf import dequantize_raw

        w = dequantize_raw(self.raw(), self.type, self.rows, self.shape)
        if self.offset:
            w -= self.offset
        return w if dtype == torch.float32 else w.to(dtype)


@dataclass(eq=False)
class TorchPart:
    """A tensor from a safetensors file (read when asked, from its mapping) or already in memory."""
    name: str
    get: object  # () -> torch.Tensor
    shape: tuple[int, ...]
    type: str  # the dtype's name, e.g. "bfloat16"
    rows: torch.Tensor | None = None
    cols: tuple[int, int] | None = None

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self.get()
        if self.rows is not None:
            t = t.index_select(0, self.rows)
        if self.cols is not None:
            t = t[:, self.cols[0]:self.cols[1]]
        return t.to(dtype).contiguous()

    def take_rows(self, rows: torch.Tensor) -> "TorchPart":
        return dataclasses.replace(self, rows=rows if self.rows is None else self.rows[rows],
                                   shape=(int(rows.numel()),) + tuple(self.shape[1:]))

    def take_cols(self, a: int, b: int) -> "TorchPart":
        base = self.cols[0] if self.cols else 0
        return dataclasses.replace(self, cols=(base + a, base + b), shape=(self.shape[0], b - a))


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class TensorPlan:
    linears: dict[str, tuple[list, list | None]]  # module path -> (weight parts, bias parts)
    tensors: dict[str, object]  # parameter name (norms, q/k norms, ...) -> part
    embedding: object  # the token table's part
    tied: bool  # the output layer reads the token table
    kind: str  # gguf | safetensors | memory
    file_bytes: int = 0
    unused: list[str] = field(default_factory=list)  # file tensors no module takes


def _qkv_rows(cfg, permute: bool) -> dict[str, torch.Tensor | None]:
    """The row orders that undo llama.cpp's q/k interleave (None: the file's order)."""
    if not permute:
        return {}
    hd = cfg.head_dim
    return {"q": unpermute_qk(torch.arange(cfg.num_attention_heads * hd), cfg.num_attention_heads),
            "k": unpermute_qk(torch.arange(cfg.num_key_value_heads * hd), cfg.num_key_value_heads)}


def fuse(names: dict[str, object], cfg, experts_stacked: dict[str, object] | None = None) -> TensorPlan:
    """Our unfused parameter names -> the model's modules. `names`: "layers.3.q_proj.weight" -> part
    (already row-ordered); `experts_stacked`: "layers.3.experts.gate_proj" -> a part factory
    `(expert) -> part` for files that stack experts (GGUF)."""
    names = dict(names)
    stacked = dict(experts_stacked or {})
    linears: dict[str, tuple[list, list | None]] = {}

    def take(key):
        return names.pop(key, None)

    def parts_of(*keys):
        got = [names.get(k) for k in keys]
        if all(g is not None for g in got):
            for k in keys:
                names.pop(k)
            return got
        return None

    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            fused = take(f"{p}qkv_proj.{kind}")
            parts = [fused] if fused is not None else parts_of(*(f"{p}{n}_proj.{kind}" for n in "qkv"))
            if parts is None:
                continue
            w, b = linears.get(f"{p}qkv_proj", (None, None))
            linears[f"{p}qkv_proj"] = (parts, b) if kind == "weight" else (w, parts)
        for name in ("o_proj", "down_proj", "gate"):
            t = take(f"{p}{name}.weight")
            if t is not None:
                linears[f"{p}{name}"] = ([t], None)
        gu = take(f"{p}gate_up_proj.weight")
        gu = [gu] if gu is not None else parts_of(f"{p}gate_proj.weight", f"{p}up_proj.weight")
        if gu is not None:
            linears[f"{p}gate_up_proj"] = (gu, None)
        if getattr(cfg, "num_experts", 0):
            _experts(names, stacked, linears, p, cfg.num_experts)
    head = take("lm_head.weight")
    emb = names.pop("embed_tokens.weight", None)
    if emb is None:
        raise InferdError("weights missing from the file: the token embedding")
    tied = head is None
    linears["lm_head"] = ([head if head is not None else emb], None)
    return TensorPlan(linears, names, emb, tied, "memory")


_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _experts(names: dict, stacked: dict, linears: dict, p: str, n: int) -> None:
    e = p + "experts."
    if f"{e}gate_proj" in stacked:  # GGUF: [E, ...] tensors, one part an expert
        gate, up, down = (stacked.pop(f"{e}{k}") for k in ("gate_proj", "up_proj", "down_proj"))
        for j in range(n):
            linears[f"{e}{j}.gate_up_proj"] = ([gate(j), up(j)], None)
            linears[f"{e}{j}.down_proj"] = ([down(j)], None)
        return
    for g, u, d in _EXPERT_NAMES:
        if f"{e}0.{g}.weight" not in names:
            continue
        for j in range(n):
            try:
                parts = [names.pop(f"{e}{j}.{g}.weight"), names.pop(f"{e}{j}.{u}.weight")]
                down = names.pop(f"{e}{j}.{d}.weight")
            except KeyError as k:
                raise InferdError(f"weights missing from the file: {k.args[0]}") from None
            linears[f"{e}{j}.gate_up_proj"] = (parts, None)
            linears[f"{e}{j}.down_proj"] = ([down], None)
        return


# -- GGUF ----------------------------------------------------------------------------------------


def gguf_plan(reader, cfg) -> TensorPlan:
    """The plan of a GGUF file: its tensors under our names (the family's own names first), q/k
    rows un-interleaved where llama.cpp interleaved them, Gemma's norm offsets undone."""
    from inferd.loading.gguf import gguf_name_to_ours
    from inferd.model import registry

    fam = registry.by_name(cfg.architecture)
    overrides = dict(fam.gguf_names)
    order = _qkv_rows(cfg, fam.gguf_interleaved_qk)
    names, stacked, unused = {}, {}, []
    for t in reader.tensors:
        ours = gguf_name_to_ours(t.name, overrides)
        if ours is None:
            if t.name not in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
                unused.append(t.name)
            continue
        if ".experts." in ours and not ours.endswith((".weight", ".bias")):
            stacked[ours] = (lambda t: lambda j: GGUFPart(t, expert=j))(t)
            continue
        rows = None
        if ours.endswith(("q_proj.weight", "q_proj.bias")):
            rows = order.get("q")
        elif ours.endswith(("k_proj.weight", "k_proj.bias")):
            rows = order.get("k")
        offset = fam.gguf_norm_offset if ours.endswith("norm.weight") else 0.0
        names[ours] = GGUFPart(t, rows=rows, offset=offset)
    plan = fuse(names, cfg, stacked)
    plan.kind = "gguf"
    plan.file_bytes = os.path.getsize(reader.path)
    plan.unused = unused
    return plan


# -- safetensors ---------------------------------------------------------------------------------


def hf_key_to_ours(name: str) -> str:
    """A Hugging Face checkpoint's parameter name -> ours (unfused)."""
    if name.startswith("model."):
        name = name[len("model."):]
    return name.replace("self_attn.", "").replace("mlp.", "").replace("block_sparse_moe.", "")


_ST_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
             "I32": "int32", "I8": "int8", "U8": "uint8", "I16": "int16", "BOOL": "bool"}


def safetensors_plan(folder: str, cfg) -> TensorPlan:
    """The plan of a Hugging Face folder: each tensor read from its file's mapping when its module is
    built (safetensors maps the file; a tensor is one read of its bytes)."""
    names = safetensors_plan_names(folder)
    plan = fuse(names, cfg)
    plan.kind = "safetensors"
    plan.file_bytes = sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*.safetensors")))
    return plan


def safetensors_plan_names(folder: str) -> dict[str, TorchPart]:
    """Every tensor of a folder's safetensors files under our unfused names, unread."""
    from safetensors import safe_open

    from inferd.loading.checks import check_safetensors

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise InferdError(f"no *.safetensors weights in model folder {folder}")
    names = {}
    for f in files:
        check_safetensors(f)
        try:
            handle = safe_open(f, framework="pt")
        except Exception as e:  # noqa: BLE001 - the library's own errors, one line
            raise InferdError(f"cannot read {f}: {e}") from None
        for k in handle.keys():
            sl = handle.get_slice(k)
            shape = tuple(int(d) for d in sl.get_shape())
            dtype = _ST_TYPES.get(sl.get_dtype(), sl.get_dtype().lower())
            names[hf_key_to_ours(k)] = TorchPart(k, (lambda h, k: lambda: h.get_tensor(k))(handle, k), shape, dtype)
    return names


def memory_plan(sd: dict[str, torch.Tensor], cfg) -> TensorPlan:
    """A plan over tensors already in memory (our unfused names): AWQ folders, tests."""
    names = {k: TorchPart(k, (lambda v: lambda: v)(v), tuple(v.shape), str(v.dtype).replace("torch.", ""))
             for k, v in sd.items()}
    return fuse(names, cfg)

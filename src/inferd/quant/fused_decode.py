"""The decode step of a W4A8 model as one C++ call: the layer loop without Python between kernels.

Why: with int4 weights and int8 activations a batch-1 token reads ~110 MB of weights, ~6 ms on the
2-core AVX2 machine, and the eager forward spent another ~2.5 ms on the ~13 Python-level calls per
layer around those matmuls (norms, rope, KV write, attention, views, module calls). llama.cpp runs
its whole graph from C++; this does the same for inferd's own kernels.

What runs is exactly what the eager forward runs: the kernels are registered as torch ops by their
own extensions (`inferd::w4a8_linear`, `rms_norm`, `rope_`, `write_kv`, `paged_decode`, ...), and
`DecodeStack` calls them through the dispatcher in the eager order, so its hidden states equal the
eager model's bit for bit (tests/test_fused_decode.py checks it). It applies to a CPU float32 model
whose every layer linear is W4A8/W8A8 (`--quantize-activations`), on steps where every sequence
decodes one token through the paged kernel (speculative verify chunks qualify: SpecPagedAttention
hands their k+1 rows to the kernel as single-query rows); prefill chunks and any other model run
eagerly. `--enforce-eager` (vLLM's flag for the same trade on GPUs, where the fused step
is a CUDA graph) turns it off.
"""
from __future__ import annotations

import torch

_SRC = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <vector>

using torch::Tensor;

template <typename Sig>
static c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Lin { Tensor q, s, m, bias; };  // m undefined: int8 weights (W8A8)

class DecodeStack {
 public:
  // flat: per layer input_norm, post_norm, then (q, s, m, bias) for qkv, o, gate_up, down, with empty
  // tensors for an absent m or bias; last the final norm's weight.
  DecodeStack(std::vector<Tensor> flat, int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double eps, int64_t max_rows)
      : L_(layers), nq_(heads), nk_(kv_heads), D_(head_dim), eps_(eps), max_rows_(max_rows) {
    TORCH_CHECK(static_cast<int64_t>(flat.size()) == layers * 18 + 1, "DecodeStack: wrong number of tensors");
    auto opt = [](const Tensor& t) { return t.numel() ? t : Tensor(); };
    for (int64_t l = 0; l < layers; ++l) {
      const Tensor* f = flat.data() + l * 18;
      norms_.push_back(f[0]);
      norms_.push_back(f[1]);
      for (int i = 0; i < 4; ++i) lins_.push_back({f[2 + 4 * i], f[3 + 4 * i], opt(f[4 + 4 * i]), opt(f[5 + 4 * i])});
    }
    norms_.push_back(flat.back());
  }

  // x [M, hidden] float32 embeddings (updated in place: the residual stream); cos/sin [M, head_dim];
  // kcache/vcache [layers, slots, kv_heads, head_dim]; the rest as for inferd::paged_decode.
  // Returns the final norm of the last residual, as LlamaModel.forward does.
  Tensor forward(Tensor x, Tensor cos, Tensor sin, Tensor kcache, Tensor vcache, Tensor slots, Tensor block_tables,
                 Tensor ctx_lens, int64_t block_size, double scale, int64_t window) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
    TORCH_CHECK(kcache.size(0) == L_ && kcache.scalar_type() == torch::kFloat32);
    const int64_t M = x.size(0);
    Tensor h = rms_norm_.call(x, norms_[0], eps_);
    for (int64_t l = 0; l < L_; ++l) {
      const Lin* w = lins_.data() + 4 * l;
      Tensor qkv = lin(w[0], h).view({M, nq_ + 2 * nk_, D_});
      rope_.call(qkv, nq_ + nk_, cos, sin);
      Tensor kc = kcache.select(0, l), vc = vcache.select(0, l);
      write_kv_.call(qkv.narrow(1, nq_, nk_), qkv.narrow(1, nq_ + nk_, nk_), slots, kc, vc);
      Tensor o = paged_decode_.call(qkv.narrow(1, 0, nq_).contiguous(), kc, vc, block_tables, ctx_lens, block_size,
                                    scale, window);
      h = add_rms_norm_.call(x, lin(w[1], o.view({M, nq_ * D_})), norms_[2 * l + 1], eps_);
      Tensor act = silu_mul_.call(lin(w[2], h));
      h = add_rms_norm_.call(x, lin(w[3], act), l + 1 < L_ ? norms_[2 * l + 2] : norms_.back(), eps_);
    }
    return h;
  }

 private:
  Tensor lin(const Lin& l, const Tensor& x) {
    Tensor y = l.m.defined() ? w4a8_.call(x, l.q, l.s, l.m, max_rows_) : w8a8_.call(x, l.q, l.s, max_rows_);
    if (l.bias.defined()) y.add_(l.bias);
    return y;
  }

  int64_t L_, nq_, nk_, D_;
  double eps_;
  int64_t max_rows_;
  std::vector<Tensor> norms_;
  std::vector<Lin> lins_;
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, double)> rms_norm_ = op<Tensor(Tensor, Tensor, double)>("inferd::rms_norm");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, double)> add_rms_norm_ =
      op<Tensor(Tensor, Tensor, Tensor, double)>("inferd::add_rms_norm");
  c10::TypedOperatorHandle<void(Tensor, int64_t, Tensor, Tensor)> rope_ =
      op<void(Tensor, int64_t, Tensor, Tensor)>("inferd::rope_");
  c10::TypedOperatorHandle<Tensor(Tensor)> silu_mul_ = op<Tensor(Tensor)>("inferd::silu_mul");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor, Tensor)> write_kv_ =
      op<void(Tensor, Tensor, Tensor, Tensor, Tensor)>("inferd::write_kv");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, int64_t, double, int64_t)> paged_decode_ =
      op<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, int64_t, double, int64_t)>("inferd::paged_decode");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, Tensor, int64_t)> w4a8_ =
      op<Tensor(Tensor, Tensor, Tensor, Tensor, int64_t)>("inferd::w4a8_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, int64_t)> w8a8_ =
      op<Tensor(Tensor, Tensor, Tensor, int64_t)>("inferd::w8a8_linear");
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the step runs without the GIL: a server's event loop keeps answering while the model computes
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<Tensor>, int64_t, int64_t, int64_t, int64_t, double, int64_t>())
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""


def load():
    """The compiled extension, or None (no compiler, or INFERD_NO_CPP_OPS=1)."""
    from inferd.kernels.cpu_ops import compiled

    return compiled("inferd_fused_decode_v1", _SRC, None, ["-O3"], "INFERD_NO_CPP_OPS",
                    "decode steps run eagerly")


class FusedDecode:
    """model.fused_decode: called by LlamaModel.forward, returns None where the step must run eagerly."""

    def __init__(self, stack, n_layers: int):
        self.stack = stack
        self.n_layers = n_layers
        self.steps = 0  # steps served (tests check the fused path ran)
        self.max_rows = 0  # most rows in one fused step (speculative verify rows count one each)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor | None:
        decode_args = getattr(attn, "decode_args", None)
        args = decode_args() if decode_args is not None else None
        if args is None or args[0].dtype != x.dtype:
            return None
        h = self.stack.forward(x, cos, sin, *args)
        attn.kernel_calls += self.n_layers
        self.steps += 1
        self.max_rows = max(self.max_rows, x.shape[0])
        return h


def fuse_decode(model) -> bool:
    """Give the model a fused decode step if it qualifies (CPU, float32, every layer linear W4A8 or
    W8A8, the kernels built); returns whether it did. The model itself is unchanged otherwise."""
    from inferd.kernels import cpu_attention, cpu_ops, w4a8
    from inferd.model.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        return False
    model.fused_decode = None
    if model.device.type != "cpu" or model.dtype != torch.float32 or not len(model.layers):
        return False
    none = torch.empty(0)
    flat = []
    for layer in model.layers:
        flat += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            # W4A8Linear / W8A8Linear (inferd.quant.w4a8) hand over what the kernel reads; anything else
            # has no C++ path
            weights = getattr(lin, "kernel_weights", None)
            if weights is None:
                return False
            q, s, m = weights()
            flat += [q, s, none if m is None else m]
            flat.append(none if lin.bias is None else lin.bias)
    flat.append(model.norm.weight.detach())
    # each extension registers its ops when it loads: all of them must be there before the stack
    if any(ext is None for ext in (cpu_ops.load(), cpu_attention.load(), w4a8.load())) or load() is None:
        return False
    cfg = model.cfg
    stack = load().DecodeStack(flat, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.head_dim, float(cfg.rms_norm_eps), w4a8.MAX_KERNEL_ROWS)
    model.fused_decode = FusedDecode(stack, cfg.num_hidden_layers)
    return True

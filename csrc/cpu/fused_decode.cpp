// The decode step of a W4A8/W8A8 model as one C++ call: the layer loop without Python between kernels.
//
// Why: with int4 weights and int8 activations a batch-1 token reads ~110 MB of weights, ~6 ms on the
// 2-core AVX2 machine, and the eager forward spent another ~2.5 ms on the ~13 Python-level calls per
// layer around those matmuls (norms, rope, KV write, attention, views, module calls). llama.cpp runs
// its whole graph from C++; this does the same for inferd's own kernels.
//
// It calls the very ops the eager forward calls (torch.ops.inferd.*, ops.cpp) through the dispatcher,
// in the eager order, so its hidden states equal the eager model's bit for bit, whichever kernel
// variant is active. This file also holds the extension's Python module (one per extension).
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <vector>

using torch::Tensor;

template <typename Sig>
static c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Lin { Tensor w, bias; int64_t n; bool w8; };  // packed records (W4A8 or W8A8), n output features

class DecodeStack {
 public:
  // flat: per layer input_norm, post_norm, then (packed weights, bias) for qkv, o, gate_up, down, with
  // an empty tensor for an absent bias; last the final norm's weight. outs: the four linears' output
  // features per layer; w8: which of them are W8A8 (the rest W4A8).
  DecodeStack(std::vector<Tensor> flat, std::vector<int64_t> outs, std::vector<bool> w8, int64_t layers,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : L_(layers), nq_(heads), nk_(kv_heads), D_(head_dim), eps_(eps) {
    TORCH_CHECK(static_cast<int64_t>(flat.size()) == layers * 10 + 1, "DecodeStack: wrong number of tensors");
    TORCH_CHECK(static_cast<int64_t>(outs.size()) == layers * 4 && w8.size() == outs.size(),
                "DecodeStack: wrong number of output sizes");
    auto opt = [](const Tensor& t) { return t.numel() ? t : Tensor(); };
    for (int64_t l = 0; l < layers; ++l) {
      const Tensor* f = flat.data() + l * 10;
      norms_.push_back(f[0]);
      norms_.push_back(f[1]);
      for (int i = 0; i < 4; ++i) lins_.push_back({f[2 + 2 * i], opt(f[3 + 2 * i]), outs[l * 4 + i], w8[l * 4 + i]});
    }
    norms_.push_back(flat.back());
  }

  // x [M, hidden] float32 embeddings (updated in place: the residual stream); cos/sin [M, head_dim];
  // kcache/vcache [layers, slots, kv_heads, head_dim], float32 or bfloat16; the rest as for
  // inferd::paged_decode. Returns the final norm of the last residual, as LlamaModel.forward does.
  Tensor forward(Tensor x, Tensor cos, Tensor sin, Tensor kcache, Tensor vcache, Tensor slots, Tensor block_tables,
                 Tensor ctx_lens, int64_t block_size, double scale, int64_t window) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
    const auto kv = kcache.scalar_type();
    TORCH_CHECK(kcache.size(0) == L_ && vcache.scalar_type() == kv && (kv == torch::kFloat32 || kv == torch::kBFloat16),
                "DecodeStack: the KV cache must be float32 or bfloat16");
    const int64_t M = x.size(0);
    Tensor h = rms_norm_.call(x, norms_[0], eps_);
    for (int64_t l = 0; l < L_; ++l) {
      const Lin* w = lins_.data() + 4 * l;
      Tensor qkv = lin(w[0], h).view({M, nq_ + 2 * nk_, D_});
      rope_.call(qkv, nq_ + nk_, cos, sin);
      Tensor kc = kcache.select(0, l), vc = vcache.select(0, l);
      Tensor k = qkv.narrow(1, nq_, nk_), v = qkv.narrow(1, nq_ + nk_, nk_);
      // a bf16 cache stores this step's K/V rounded as the eager forward's k.to(cache dtype) rounds
      // them; attention still computes in fp32 (paged_decode reads either cache dtype)
      if (kv != torch::kFloat32) k = k.to(kv), v = v.to(kv);
      write_kv_.call(k, v, slots, kc, vc);
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
    Tensor y = l.w8 ? w8a8_.call(x, l.w, l.n) : w4a8_.call(x, l.w, l.n);
    if (l.bias.defined()) y.add_(l.bias);
    return y;
  }

  int64_t L_, nq_, nk_, D_;
  double eps_;
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
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t)> w4a8_ =
      op<Tensor(Tensor, Tensor, int64_t)>("inferd::w4a8_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t)> w8a8_ =
      op<Tensor(Tensor, Tensor, int64_t)>("inferd::w8a8_linear");
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the step runs without the GIL: a server's event loop keeps answering while the model computes
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<Tensor>, std::vector<int64_t>, std::vector<bool>, int64_t, int64_t, int64_t, int64_t,
                          double>())
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

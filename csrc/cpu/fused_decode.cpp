// The decode step of a W4A8/W8A8 (or GGUF block) model as one C++ call: the layer loop without Python between kernels.
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

// One part of a linear: packed records, their kind (W4A8, W8A8, 16-bit float weights, or a GGUF
// BlockType >= 0), n outputs.
// A linear is one part, or several whose outputs sit side by side (a GGUF layer whose parts differ
// in type: inferd.quant.gguf_native.FusedParts).
static constexpr int64_t KIND_HALF = -3, KIND_W4A8 = -2, KIND_W8A8 = -1;
struct Part { Tensor w; int64_t kind, n; };
struct Lin { std::vector<Part> parts; Tensor bias; };

class DecodeStack {
 public:
  // norms: per layer input_norm, post_norm, then the final norm's weight. weights / kinds / outs: every
  // linear's parts in order (qkv, o, gate_up, down per layer), parts[i] of them for linear i; biases:
  // one per linear, an empty tensor for none.
  DecodeStack(std::vector<Tensor> norms, std::vector<Tensor> weights, std::vector<int64_t> kinds,
              std::vector<int64_t> outs, std::vector<int64_t> parts, std::vector<Tensor> biases, int64_t layers,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : L_(layers), nq_(heads), nk_(kv_heads), D_(head_dim), eps_(eps), norms_(std::move(norms)) {
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == layers * 2 + 1, "DecodeStack: wrong number of norms");
    TORCH_CHECK(static_cast<int64_t>(parts.size()) == layers * 4 && biases.size() == parts.size(),
                "DecodeStack: wrong number of linears");
    TORCH_CHECK(weights.size() == kinds.size() && kinds.size() == outs.size(), "DecodeStack: parts disagree");
    size_t at = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      Lin l{{}, biases[i].numel() ? biases[i] : Tensor()};
      for (int64_t j = 0; j < parts[i]; ++j, ++at) {
        TORCH_CHECK(at < weights.size(), "DecodeStack: fewer parts than the linears name");
        l.parts.push_back({weights[at], kinds[at], outs[at]});
      }
      lins_.push_back(std::move(l));
    }
    TORCH_CHECK(at == weights.size(), "DecodeStack: more parts than the linears name");
  }

  // LoRA slots per linear (inferd.model.lora.WithLoRA's buffers, shared: slot writes show here):
  // a [S, parts, R, K], b [S, R, N], ranks [S, parts], each part's outputs
  void set_lora(std::vector<Tensor> a, std::vector<Tensor> b, std::vector<Tensor> ranks,
                std::vector<std::vector<int64_t>> part_n) {
    TORCH_CHECK(a.size() == lins_.size() && b.size() == a.size() && ranks.size() == a.size() &&
                part_n.size() == a.size(), "DecodeStack: one LoRA operand set per linear");
    lora_a_ = std::move(a), lora_b_ = std::move(b), lora_ranks_ = std::move(ranks), lora_parts_ = std::move(part_n);
  }

  // x [M, hidden] float32 embeddings (updated in place: the residual stream); cos/sin [M, head_dim];
  // kcache/vcache [layers, slots, kv_heads, head_dim], float32 or bfloat16 (or int8 rows: head_dim + 4); the rest as for
  // inferd::paged_decode. Returns the final norm of the last residual, as LlamaModel.forward does.
  // lora_rows [M] int64: each row's LoRA slot (-1: none); empty: no adapter in the step.
  Tensor forward(Tensor x, Tensor cos, Tensor sin, Tensor kcache, Tensor vcache, Tensor slots, Tensor block_tables,
                 Tensor ctx_lens, int64_t block_size, double scale, int64_t window, Tensor lora_rows) {
    TORCH_CHECK(lora_rows.numel() == 0 || (!lora_a_.empty() && lora_rows.numel() == x.size(0)),
                "DecodeStack: LoRA rows without LoRA slots, or not one per row");
    rows_ = lora_rows.numel() ? lora_rows : Tensor();
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous());
    const auto kv = kcache.scalar_type();
    TORCH_CHECK(kcache.size(0) == L_ && vcache.scalar_type() == kv &&
                    (kv == torch::kFloat32 || kv == torch::kBFloat16 || kv == torch::kChar),
                "DecodeStack: the KV cache must be float32, bfloat16 or int8");
    const int64_t M = x.size(0);
    Tensor h = rms_norm_.call(x, norms_[0], eps_);
    for (int64_t l = 0; l < L_; ++l) {
      const Lin* w = lins_.data() + 4 * l;
      const int64_t li = 4 * l;
      Tensor qkv = lin(w[0], h, li).view({M, nq_ + 2 * nk_, D_});
      rope_.call(qkv, nq_ + nk_, cos, sin);
      Tensor kc = kcache.select(0, l), vc = vcache.select(0, l);
      Tensor k = qkv.narrow(1, nq_, nk_), v = qkv.narrow(1, nq_ + nk_, nk_);
      Tensor o;
      if (kv == torch::kChar) {
        // an int8 cache: quantized as written, read by the split decode kernel, as the eager forward does
        write_kv_q8_.call(k, v, slots, kc, vc);
        o = paged_decode_split_.call(qkv.narrow(1, 0, nq_).contiguous(), kc, vc, block_tables, ctx_lens, block_size,
                                     scale, window, 0.0);
      } else {
        // a bf16 cache stores this step's K/V rounded as the eager forward's k.to(cache dtype) rounds
        // them; attention still computes in fp32 (paged_decode reads either cache dtype)
        if (kv != torch::kFloat32) k = k.to(kv), v = v.to(kv);
        write_kv_.call(k, v, slots, kc, vc);
        o = paged_decode_.call(qkv.narrow(1, 0, nq_).contiguous(), kc, vc, block_tables, ctx_lens, block_size, scale,
                               window);
      }
      h = add_rms_norm_.call(x, lin(w[1], o.view({M, nq_ * D_}), li + 1), norms_[2 * l + 1], eps_);
      Tensor act = silu_mul_.call(lin(w[2], h, li + 2));
      h = add_rms_norm_.call(x, lin(w[3], act, li + 3), l + 1 < L_ ? norms_[2 * l + 2] : norms_.back(), eps_);
    }
    return h;
  }

 private:
  Tensor part(const Part& p, const Tensor& x) {
    if (p.kind == KIND_W4A8) return w4a8_.call(x, p.w, p.n);
    if (p.kind == KIND_W8A8) return w8a8_.call(x, p.w, p.n);
    if (p.kind == KIND_HALF) return half_.call(x, p.w);
    return blocks_.call(x, p.w, p.n, p.kind);
  }

  // linear i of the stack; with LoRA rows in the step, each row's delta added as WithLoRA adds it
  Tensor lin(const Lin& l, const Tensor& x, int64_t i) {
    Tensor y;
    if (l.parts.size() == 1) {
      y = part(l.parts[0], x);
    } else {
      std::vector<Tensor> ys;
      for (const Part& p : l.parts) ys.push_back(part(p, x));
      y = at::cat(ys, 1);
    }
    if (l.bias.defined()) y.add_(l.bias);
    if (rows_.defined()) {
      const Tensor xc = x.is_contiguous() ? x : x.contiguous();
      lora_add_.call(y, xc, lora_a_[i], lora_b_[i], rows_, lora_ranks_[i], lora_parts_[i]);
    }
    return y;
  }

  int64_t L_, nq_, nk_, D_;
  double eps_;
  std::vector<Tensor> norms_;
  std::vector<Lin> lins_;
  std::vector<Tensor> lora_a_, lora_b_, lora_ranks_;
  std::vector<std::vector<int64_t>> lora_parts_;
  Tensor rows_;
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
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor, Tensor)> write_kv_q8_ =
      op<void(Tensor, Tensor, Tensor, Tensor, Tensor)>("inferd::write_kv_q8");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, int64_t, double, int64_t, double)>
      paged_decode_split_ = op<Tensor(Tensor, Tensor, Tensor, Tensor, Tensor, int64_t, double, int64_t, double)>(
          "inferd::paged_decode_split");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t)> w4a8_ =
      op<Tensor(Tensor, Tensor, int64_t)>("inferd::w4a8_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t)> w8a8_ =
      op<Tensor(Tensor, Tensor, int64_t)>("inferd::w8a8_linear");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor)> half_ = op<Tensor(Tensor, Tensor)>("inferd::half_linear");
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, c10::ArrayRef<int64_t>)> lora_add_ =
      op<void(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, c10::ArrayRef<int64_t>)>("inferd::lora_add_");
  c10::TypedOperatorHandle<Tensor(Tensor, Tensor, int64_t, int64_t)> blocks_ =
      op<Tensor(Tensor, Tensor, int64_t, int64_t)>("inferd::blocks_linear");
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the step runs without the GIL: a server's event loop keeps answering while the model computes
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<Tensor>, int64_t, int64_t, int64_t, int64_t, double>())
      .def("set_lora", &DecodeStack::set_lora)
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

"""A paged decode-attention kernel for CPU, compiled on first use (torch cpp_extension + ninja).

Why: with torch ops, decode attention over a paged cache must first gather every sequence's K/V
into a padded copy (read + write + read again by SDPA). At 64 sequences that gather and the
CPU SDPA kernel took ~70 % of a decode step. This kernel reads each K/V row once, in place,
straight from the block table, with one (sequence, kv-head) pair per task so the G query heads
that share a kv head reuse each K row while it is in cache.

If no compiler is available, `load()` returns None and attention falls back to the torch path.
"""
from __future__ import annotations


_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cstring>

template <typename T> static inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
static void decode_impl(const float* q, const T* k, const T* v, const int64_t* bt, const int64_t* ctx,
                        float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                        int64_t bs, float scale, int64_t window) {
  const int64_t G = H / Hkv;
  // one task per (sequence, kv head), spread over the threads even at batch 1: the K/V rows come
  // from DRAM (a decode step streams ~100 MB of weights between two visits of a layer's cache), and
  // two threads waiting on memory beat one (measured: 46 -> 37 us per layer at batch 1)
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += ctx[b];
  const int64_t grain = work * H * D < (1 << 12) ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv;
      const int64_t n = ctx[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t len = n - start;
      scores.assign(G * len, 0.f);
      const float* qb = q + (b * H + hk * G) * D;
      const int64_t* table = bt + b * max_blocks;
      for (int64_t t = start; t < n; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const T* kr = k + (slot * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f(kr[d]);
          scores[g * len + (t - start)] = s * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float m = sg[0];  // len >= 1; no infinities under -ffast-math
        for (int64_t i = 1; i < len; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < len; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < n; ++t) {
        const int64_t slot = table[t / bs] * bs + t % bs;
        const T* vr = v + (slot * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + (t - start)];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(vr[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, out + (b * H + hk * G + g) * D);
    }
  });
}

// Store this step's keys and values at their cache slots: k_new/v_new [T, Hkv, D] (rows may be
// strided views of the fused qkv output), slots [T] int64, caches [slots, Hkv, D] of the same dtype.
// One call instead of two index_copy_ dispatches per layer.
void write_kv(torch::Tensor k_new, torch::Tensor v_new, torch::Tensor slots, torch::Tensor kc, torch::Tensor vc) {
  TORCH_CHECK(k_new.dim() == 3 && v_new.sizes() == k_new.sizes() && kc.is_contiguous() && vc.is_contiguous());
  TORCH_CHECK(k_new.dtype() == kc.dtype() && v_new.dtype() == kc.dtype() && vc.dtype() == kc.dtype());
  const int64_t T = k_new.size(0), Hkv = k_new.size(1), D = k_new.size(2);
  TORCH_CHECK(kc.size(1) == Hkv && kc.size(2) == D && slots.numel() == T && slots.is_contiguous());
  TORCH_CHECK(k_new.stride(2) == 1 && k_new.stride(1) == D && v_new.stride(2) == 1 && v_new.stride(1) == D,
              "k/v rows must be dense [Hkv, D]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n = kc.size(0), row = Hkv * D * kc.element_size();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < n, "slot out of range");
  const char* ks = static_cast<const char*>(k_new.data_ptr());
  const char* vs = static_cast<const char*>(v_new.data_ptr());
  char* kd = static_cast<char*>(kc.data_ptr());
  char* vd = static_cast<char*>(vc.data_ptr());
  const int64_t ksb = k_new.stride(0) * k_new.element_size(), vsb = v_new.stride(0) * v_new.element_size();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kd + sl[t] * row, ks + t * ksb, row);
    std::memcpy(vd + sl[t] * row, vs + t * vsb, row);
  }
}

// q [B, H, D] float32; k/v caches [slots, Hkv, D] float32 or bfloat16; block_tables [B, max_blocks]
// int64; ctx_lens [B] int64 (keys 0..ctx-1 are attended; the query is the last of them).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor block_tables,
                           torch::Tensor ctx_lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && block_tables.is_contiguous() && ctx_lens.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D);
  auto out = torch::empty({B, H, D}, q.options());
  if (k.dtype() == torch::kFloat32) {
    decode_impl<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                       block_tables.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                       B, H, Hkv, D, block_tables.size(1), block_size, (float)scale, window);
  } else {
    TORCH_CHECK(k.dtype() == torch::kBFloat16, "KV cache must be float32 or bfloat16");
    decode_impl<c10::BFloat16>(q.data_ptr<float>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(),
                               block_tables.data_ptr<int64_t>(), ctx_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                               B, H, Hkv, D, block_tables.size(1), block_size, (float)scale, window);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(inferd, m) {  // for the fused decode step (inferd.quant.fused_decode)
  m.def("write_kv(Tensor k_new, Tensor v_new, Tensor slots, Tensor(a!) kc, Tensor(b!) vc) -> ()", &write_kv);
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor ctx_lens, int block_size, "
        "float scale, int window) -> Tensor", &paged_decode);
}
"""

def load():
    """The compiled module, or None (no compiler, or INFERD_NO_CPP_ATTENTION=1)."""
    from inferd.kernels.cpu_ops import compiled

    return compiled("inferd_paged_attention_v4", _SRC, ["paged_decode", "write_kv"],
                    ["-O3", "-march=native", "-ffast-math", "-fopenmp"], "INFERD_NO_CPP_ATTENTION",
                    "using the torch gather path")

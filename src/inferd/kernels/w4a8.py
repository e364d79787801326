"""The W4A8/W8A8 CPU kernel (C++, compiled on first use): int4 nibbles or int8 weights times
activations rounded to int8 per 32-block. The modules that use it, and why, are in inferd.quant.w4a8."""
from __future__ import annotations

BLOCK = 32
MAX_KERNEL_ROWS = 16  # above this (prefill chunks) one fp32 GEMM on the dequantized layer is faster

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W4A8_AVX2 1
#endif

// x [M, K] fp32 -> xq [M, K] int8, dx [M, K/32] (block scale), xs [M, K/32] = dx * sum(xq)
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t nb = K / 32;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      // division, not a reciprocal: the same rounding as torch's round(x / d)
      const int8_t v = d > 0.f ? static_cast<int8_t>(std::nearbyint(xb[j] / d)) : 0;
      xq[i * 32 + j] = v;
      sum += v;
    }
    dx[i] = d;
    xs[i] = d * static_cast<float>(sum);
  }
}

// x rounded once per call into scratch owned by the calling thread (a decode step makes ~120
// calls); the pointers are taken here because parallel workers have thread_locals of their own.
struct Rounded { const int8_t* xq; const float* dx; const float* xs; };
static Rounded round_input(const torch::Tensor& x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  auto xf = x.scalar_type() == torch::kFloat32 && x.is_contiguous() ? x : x.to(torch::kFloat32).contiguous();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dxs;
  xq.resize(M * K);
  dxs.resize(2 * M * nb);
  quantize_rows(xf.data_ptr<float>(), M, K, xq.data(), dxs.data(), dxs.data() + M * nb);
  return {xq.data(), dxs.data(), dxs.data() + M * nb};
}

#ifdef W4A8_AVX2
static constexpr int64_t PF_TILES = 4;  // prefetching past the end is harmless: prefetches never fault

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// R weight rows n..n+R-1 times MB activation rows i0..: the R*MB dot products of a tile.
// Nibble layout per 32-block: 16 bytes, byte j = q[j] | q[j + 16] << 4.
template <int R, int MB>
static void tile(const uint8_t* q, const float* s, const float* m, int64_t nb, const int8_t* xq, const float* dx,
                 const float* xs, int64_t K, int64_t N, float* y, int64_t n, int64_t i0) {
#ifdef W4A8_AVX2
  const __m256i lowmask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  // DRAM latency, not arithmetic, bounds a decode GEMV: fetch the tile PF_TILES ahead while this one
  // computes (measured on the 2-core AVX2 machine: ~10 % faster over a whole token's weights)
  for (int64_t o = 0; o < R * nb * 16; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(q + (n + PF_TILES * R) * nb * 16 + o), _MM_HINT_T0);
  for (int64_t o = 0; o < R * nb * 4; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(s + (n + PF_TILES * R) * nb) + o, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + (n + PF_TILES * R) * nb) + o, _MM_HINT_T0);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a[MB];
    float d[MB];
    for (int i = 0; i < MB; ++i) {
      a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i0 + i) * K + b * 32));
      d[i] = dx[(i0 + i) * nb + b];
    }
    for (int r = 0; r < R; ++r) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + ((n + r) * nb + b) * 16));
      const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), lowmask);
      const float sr = s[(n + r) * nb + b];
      for (int i = 0; i < MB; ++i) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a[i]), ones);
        acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(sr * d[i]), _mm256_cvtepi32_ps(p), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      const float* mr = m + (n + r) * nb;
      const float* xsi = xs + (i0 + i) * nb;
      float off = 0.f;
      for (int64_t b = 0; b < nb; ++b) off += mr[b] * xsi[b];
      y[(i0 + i) * N + n + r] = hsum(acc[r][i]) + off;
    }
#else
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      float tot = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qb = q + ((n + r) * nb + b) * 16;
        const int8_t* ab = xq + (i0 + i) * K + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (qb[j] & 15) * ab[j] + (qb[j] >> 4) * ab[j + 16];
        tot += s[(n + r) * nb + b] * dx[(i0 + i) * nb + b] * static_cast<float>(dot) +
               m[(n + r) * nb + b] * xs[(i0 + i) * nb + b];
      }
      y[(i0 + i) * N + n + r] = tot;
    }
#endif
}

template <int MB>
static void rows(const uint8_t* q, const float* s, const float* m, int64_t nb, const int8_t* xq, const float* dx,
                 const float* xs, int64_t K, int64_t N, float* y, int64_t n0, int64_t n1, int64_t i0) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile<4, MB>(q, s, m, nb, xq, dx, xs, K, N, y, n, i0);
  for (; n < n1; ++n) tile<1, MB>(q, s, m, nb, xq, dx, xs, K, N, y, n, i0);
}

torch::Tensor dequantize(torch::Tensor qw, torch::Tensor s, torch::Tensor m) {
  const int64_t N = qw.size(0), K = qw.size(1) * 2, nb = K / 32;
  auto w = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* q = qw.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const float sv = sp[n * nb + b], mv = mp[n * nb + b];
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = q[(n * nb + b) * 16 + j];
          out[n * K + b * 32 + j] = static_cast<float>(byte & 15) * sv + mv;
          out[n * K + b * 32 + 16 + j] = static_cast<float>(byte >> 4) * sv + mv;
        }
      }
  });
  return w;
}

// What the kernel does to x, as floats: each 32-block rounded to 255 levels of its largest magnitude.
torch::Tensor fake_quant(torch::Tensor x) {
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.numel() / xf.size(-1), K = xf.size(-1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0, "the input size must be a multiple of 32");
  auto xq = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M, nb}, torch::kFloat32);
  auto xs = torch::empty({M, nb}, torch::kFloat32);
  quantize_rows(xf.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xs.data_ptr<float>());
  return (xq.to(torch::kFloat32).view({M, nb, 32}) * dx.unsqueeze(-1)).view(xf.sizes());
}

// x [M, K] float32 or bfloat16; qw [N, K/2] uint8; s, m [N, K/32] float32 -> [M, N] in x's dtype
torch::Tensor linear(torch::Tensor x, torch::Tensor qw, torch::Tensor s, torch::Tensor m, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2 && qw.scalar_type() == torch::kUInt8 && qw.is_contiguous());
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32 && s.is_contiguous() &&
              m.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && qw.size(1) * 2 == K && s.size(0) == N && s.size(1) == nb && m.sizes() == s.sizes());
  if (M > max_rows)
    return at::mm(fake_quant(x), dequantize(qw, s, m).t()).to(x.scalar_type());
  const Rounded r = round_input(x, M, K);
  auto y = torch::empty({M, N}, torch::kFloat32);
  const uint8_t* qp = qw.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const int8_t* xqp = r.xq;
  const float* dxp = r.dx;
  const float* xsp = r.xs;
  float* yp = y.data_ptr<float>();
  // split the output rows, in multiples of 4, over the threads; every thread walks all of x
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
    int64_t i = 0;
    for (; i + 2 <= M; i += 2) rows<2>(qp, sp, mp, nb, xqp, dxp, xsp, K, N, yp, n0, n1, i);
    if (i < M) rows<1>(qp, sp, mp, nb, xqp, dxp, xsp, K, N, yp, n0, n1, i);
  });
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}
// int8 weights (one scale per output row) times the same int8 activations: the lm_head of the gguf
// path and the int8 methods. vpmaddubsw wants unsigned x signed, so |w| times x with w's sign.
template <int R>
static void tile8(const int8_t* w, const float* ws, int64_t K, const int8_t* xq, const float* dx, float* y,
                  int64_t n) {
  const int64_t nb = K / 32;
#ifdef W4A8_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t o = 0; o < R * K; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + (n + PF_TILES * R) * K + o), _MM_HINT_T0);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256 d = _mm256_set1_ps(dx[b]);
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + r) * K + b * 32));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(a, v)), ones);
      acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = hsum(acc[r]) * ws[n + r];
#else
  for (int r = 0; r < R; ++r) {
    float tot = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t dot = 0;
      for (int j = 0; j < 32; ++j) dot += w[(n + r) * K + b * 32 + j] * xq[b * 32 + j];
      tot += dx[b] * static_cast<float>(dot);
    }
    y[n + r] = tot * ws[n + r];
  }
#endif
}

// x [M, K] float32 or bfloat16; qw [N, K] int8; ws [N] float32 -> [M, N] in x's dtype
torch::Tensor linear8(torch::Tensor x, torch::Tensor qw, torch::Tensor ws, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && qw.dim() == 2 && qw.scalar_type() == torch::kInt8 && qw.is_contiguous());
  TORCH_CHECK(ws.scalar_type() == torch::kFloat32 && ws.is_contiguous() && ws.numel() == qw.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && qw.size(1) == K);
  if (M > max_rows)
    return at::mm(fake_quant(x), (qw.to(torch::kFloat32) * ws.unsqueeze(1)).t()).to(x.scalar_type());
  const Rounded r = round_input(x, M, K);
  auto y = torch::empty({M, N}, torch::kFloat32);
  const int8_t* wp = qw.data_ptr<int8_t>();
  const float* sp = ws.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* xqp = r.xq;
  const float* dxp = r.dx;
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
    for (int64_t i = 0; i < M; ++i) {
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4) tile8<4>(wp, sp, K, xqp + i * K, dxp + i * nb, yp + i * N, n);
      for (; n < n1; ++n) tile8<1>(wp, sp, K, xqp + i * K, dxp + i * nb, yp + i * N, n);
    }
  });
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(inferd, m) {  // for the fused decode step (inferd.quant.fused_decode)
  m.def("w4a8_linear(Tensor x, Tensor qw, Tensor s, Tensor m, int max_rows) -> Tensor", &linear);
  m.def("w8a8_linear(Tensor x, Tensor qw, Tensor ws, int max_rows) -> Tensor", &linear8);
}
"""

def load():
    """The compiled kernel, or None (no compiler, or INFERD_NO_CPP_OPS=1)."""
    from inferd.kernels.cpu_ops import compiled

    # no -ffast-math: the activation rounding must match fake_quant_activations bit for bit
    return compiled("inferd_w4a8_v7", _SRC, ["linear", "linear8", "dequantize", "fake_quant"],
                    ["-O3", "-march=native", "-fopenmp"], "INFERD_NO_CPP_OPS",
                    "--quantize-activations is unavailable")

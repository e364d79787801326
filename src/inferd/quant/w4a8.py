"""W4A8: int4 weights times activations rounded to int8 per 32-block, for CPUs without fast bf16.

Why: at batch 1 a decode step reads every weight once, so the int4 matmul should run at memory
speed. PyTorch's packed kernel spends its time turning nibbles into bf16/fp32 instead: on an AVX2
CPU it moves ~6 GB/s of int4 (12 G weights/s on 2 cores) against 28 GB/s of DRAM. With the
activations small integers too, one AVX2 instruction (`vpmaddubsw`) multiplies 32 nibbles by 32
int8 activations, and the kernel below runs 2-3x faster (a 3072 x 576 layer in ~45-70 us with the
weights in cache, ~100 us from DRAM, against ~150 us). llama.cpp does the same on CPU (Q4_x
weights times Q8_1 activations).

It is lossy in the activations as well as the weights: each 32-block of x is rounded to 255 levels
of its largest magnitude. `quantize_activations(model)` rewrites a model's int4 layers (any
method: int4, int4-gptq, gguf's Q4 blocks, AWQ), and `inferd eval` judges the result like any other
quantization (`--quantization int4+a8`). The maths, per weight block b of output row n,
with w = q s + m (q in 0..15) and x ~= dx * xq:

    y[n] = sum_b  s[n,b] dx[b] * sum_k q_k xq_k  +  m[n,b] * dx[b] * sum_k xq_k

Every forward rounds x the same way, so prefill (more than MAX_KERNEL_ROWS rows: the layer is
dequantized to fp32 for one GEMM) and decode compute the same function up to summation order.

The kernel reads the codes in inferd's own nibble layout (`inferd.quant.pack_nibbles`), taken from
the method's codes (`Int4Linear.codes()`), never from PyTorch's packed int4 bytes, whose layout
depends on the CPU (its AVX2 and AVX-512 builds differ).
"""
from __future__ import annotations

import torch
from torch import nn

from inferd.errors import InferdError

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

TORCH_LIBRARY_FRAGMENT(inferd, m) {  // for the fused decode step (inferd.model.fused_decode)
  m.def("w4a8_linear(Tensor x, Tensor qw, Tensor s, Tensor m, int max_rows) -> Tensor", &linear);
  m.def("w8a8_linear(Tensor x, Tensor qw, Tensor ws, int max_rows) -> Tensor", &linear8);
}
"""

def load():
    """The compiled kernel, or None (no compiler, or INFERD_NO_CPP_OPS=1)."""
    from inferd.model.cpu_ops import compiled

    # no -ffast-math: the activation rounding must match fake_quant_activations bit for bit
    return compiled("inferd_w4a8_v7", _SRC, ["linear", "linear8", "dequantize", "fake_quant"],
                    ["-O3", "-march=native", "-fopenmp"], "INFERD_NO_CPP_OPS",
                    "--quantize-activations is unavailable")


# -- pure functions ---------------------------------------------------------------------------

def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel does to x, in torch (the tests' oracle): per 32-block, round to 255 levels
    of the block's largest magnitude."""
    shape = x.shape
    b = x.float().reshape(-1, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(b))
    return (q * d).reshape(shape)


def pack(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int):
    """int4 codes (q in 0..15 [N, K], w = q scale + min per group) -> the kernel's nibbles [N, K/2]
    uint8 (inferd's layout, `pack_nibbles`) and fp32 s, m [N, K/32] with w = q s + m per 32-block."""
    from inferd.quant import pack_nibbles

    N, K = q.shape
    if group_size % BLOCK or K % group_size:
        raise InferdError(f"W4A8 needs int4 groups that are multiples of {BLOCK} (got {group_size})")
    rep = group_size // BLOCK
    s = scale.float().repeat_interleave(rep, dim=1)
    m = mn.float().repeat_interleave(rep, dim=1)
    return pack_nibbles(q), s.contiguous(), m.contiguous()


# -- the module and the rewrite ---------------------------------------------------------------

class W4A8Linear(nn.Module):
    """int4 weights (32-blocks, fp32 s and m); x rounded to int8 per 32-block inside the kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W4A8 needs its C++ kernel, which did not build (no compiler?)")
        for name, t in zip(("qweight", "qscale", "qmin"), pack(q, scale, mn, group_size)):
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None:  # the model's own calls: skip the reshapes (~120 calls a token)
            return self.kernel.linear(x, self.qweight, self.qscale, self.qmin, MAX_KERNEL_ROWS)
        shape = x.shape
        y = self.kernel.linear(x.reshape(-1, shape[-1]), self.qweight, self.qscale, self.qmin, MAX_KERNEL_ROWS)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K], scale, min fp32 [N, K / 32]): what the kernel multiplies by."""
        from inferd.quant import unpack_nibbles

        return unpack_nibbles(self.qweight), self.qscale, self.qmin

    def dequantized(self) -> torch.Tensor:
        return self.kernel.dequantize(self.qweight, self.qscale, self.qmin)


class W8A8Linear(nn.Module):
    """int8 weights with one scale per output row (an Int8Linear's); x rounded like W4A8Linear's."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = load()
        if self.kernel is None:
            raise InferdError("W8A8 needs the W4A8 C++ kernel, which did not build (no compiler?)")
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("qscale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel.linear8(x.reshape(-1, shape[-1]), self.qweight, self.qscale, MAX_KERNEL_ROWS)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_activations(model: nn.Module, fuse: bool = True) -> int:
    """Rewrite every packed linear of the model to take int8 activations: int4 ones into W4A8, and
    int8 ones (the gguf path's lm_head, the int8 methods) into W8A8, same weights; with `fuse`, the
    model's decode-only steps then run as one C++ call (inferd.model.fused_decode) where they can.
    Returns how many linears were rewritten; a model without packed layers is a clear error."""
    from inferd.quant import Int4Linear, Int8Linear

    if load() is None:
        raise InferdError("--quantize-activations needs the W4A8 C++ kernel, which did not build (no compiler?)")
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                if child.dense:
                    raise InferdError("--quantize-activations needs packed int4 layers, not dense ones")
                setattr(parent, name, W4A8Linear(*child.codes(), child.group_size, child.bias, model.dtype))
                n += 1
            elif isinstance(child, Int8Linear):
                if child.dense:
                    raise InferdError("--quantize-activations needs packed int8 layers, not dense ones")
                setattr(parent, name, W8A8Linear(*child.codes(), child.bias, model.dtype))
                n += 1
    if n == 0:
        raise InferdError("--quantize-activations applies to packed int4/int8 weights: this model has none")
    if fuse:
        from inferd.model.fused_decode import fuse_decode

        fuse_decode(model)
    return n

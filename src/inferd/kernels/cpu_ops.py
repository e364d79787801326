"""Fused CPU kernels for the small per-layer ops of a decode step (compiled on first use).

Why: at batch 1 with 4-bit weights the matmuls take ~5 ms per token and the eager glue around
them about as much again. `F.rms_norm` on bf16 alone dispatched ~8 ATen ops (~43 us a call,
61 calls a token); rotary embedding another five. One C++ call each does the same arithmetic
with the same roundings as the torch expressions they replace:
  rms_norm:      bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w)          (fp32 maths inside)
  add_rms_norm:  x += d (rounded to x's dtype), then rms_norm(x)       (residual add fused)
  rope_:         bf16(bf16(x * cos) + bf16(swap(x) * sin)) in place    (sign folded into sin)
  silu_mul:      bf16(bf16(silu(gate)) * up) from the fused gate|up output (silu's exp may differ
                 from torch's vectorised one in the last bit)
For fp32 the roundings vanish. Without a compiler, `load()` returns None and the model keeps the
torch expressions.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("inferd")

_SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>

template <typename T> static inline T rnd(float x) { return static_cast<T>(x); }

template <typename T>
static void norm_rows(T* x, const T* d, T* out, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* xr = x + r * n;
      if (d) {
        const T* dr = d + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = rnd<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
      }
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) { float v = static_cast<float>(xr[i]); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / n + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i)
        o[i] = rnd<T>(static_cast<float>(rnd<T>(static_cast<float>(xr[i]) * inv)) * static_cast<float>(w[i]));
    }
  });
}

static void check(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && x.dtype() == w.dtype());
  TORCH_CHECK(x.size(1) == w.size(0));
  TORCH_CHECK(x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16, "float32 or bfloat16 only");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check(x, w);
  auto out = torch::empty_like(x);
  if (x.dtype() == torch::kFloat32)
    norm_rows<float>(x.data_ptr<float>(), nullptr, out.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), eps);
  else
    norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), nullptr, out.data_ptr<c10::BFloat16>(),
                             w.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), eps);
  return out;
}

// x is updated in place (x += d); returns rms_norm(x).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor d, torch::Tensor w, double eps) {
  check(x, w);
  TORCH_CHECK(d.is_contiguous() && d.sizes() == x.sizes() && d.dtype() == x.dtype());
  auto out = torch::empty_like(x);
  if (x.dtype() == torch::kFloat32)
    norm_rows<float>(x.data_ptr<float>(), d.data_ptr<float>(), out.data_ptr<float>(), w.data_ptr<float>(),
                     x.size(0), x.size(1), eps);
  else
    norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), d.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                             w.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), eps);
  return out;
}

template <typename T>
static void rope_impl(T* x, int64_t T_, int64_t heads, int64_t row_stride, int64_t D, const float* cos,
                      const float* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(v[i]), bb = static_cast<float>(v[i + half]);
          // same roundings as x*cos + swap(x)*sin evaluated in T with T-rounded tables
          const float c0 = static_cast<float>(rnd<T>(c[i])), c1 = static_cast<float>(rnd<T>(c[i + half]));
          const float s0 = static_cast<float>(rnd<T>(s[i])), s1 = static_cast<float>(rnd<T>(s[i + half]));
          v[i] = rnd<T>(static_cast<float>(rnd<T>(a * c0)) + static_cast<float>(rnd<T>(bb * s0)));
          v[i + half] = rnd<T>(static_cast<float>(rnd<T>(bb * c1)) + static_cast<float>(rnd<T>(a * s1)));
        }
      }
    }
  });
}

// gu [T, 2F] (gate | up) -> silu(gate) * up [T, F], rounded as torch rounds F.silu(gate) * up
template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t F) {
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * 2 * F;
      const T* u = g + F;
      T* o = out + r * F;
      for (int64_t i = 0; i < F; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = rnd<T>(static_cast<float>(rnd<T>(x / (1.f + std::exp(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0);
  const int64_t rows = gu.size(0), F = gu.size(1) / 2;
  auto out = torch::empty({rows, F}, gu.options());
  if (gu.dtype() == torch::kFloat32)
    silu_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), rows, F);
  else {
    TORCH_CHECK(gu.dtype() == torch::kBFloat16, "float32 or bfloat16 only");
    silu_mul_impl<c10::BFloat16>(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, F);
  }
  return out;
}

// x: [T, H_total, D] view whose first `heads` heads are rotated in place; cos/sin [T, D] float32.
void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, H, D] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32);
  const int64_t T_ = x.size(0), D = x.size(2);
  if (x.dtype() == torch::kFloat32)
    rope_impl<float>(x.data_ptr<float>(), T_, heads, x.stride(0), D, cos.data_ptr<float>(), sin.data_ptr<float>());
  else {
    TORCH_CHECK(x.dtype() == torch::kBFloat16, "float32 or bfloat16 only");
    rope_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), T_, heads, x.stride(0), D, cos.data_ptr<float>(),
                             sin.data_ptr<float>());
  }
}

// The same functions as torch ops (inferd::*), so the fused decode step (inferd.quant.fused_decode)
// can call them from C++ through the dispatcher; Python keeps calling them through pybind.
TORCH_LIBRARY_FRAGMENT(inferd, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor d, Tensor w, float eps) -> Tensor", &add_rms_norm);
  m.def("rope_(Tensor(a!) x, int heads, Tensor cos, Tensor sin) -> ()", &rope_);
  m.def("silu_mul(Tensor gu) -> Tensor", &silu_mul);
}
"""

def build_inline(name: str, src: str, functions: list[str], cflags: list[str]):
    """torch's load_inline, minus one trap: a build killed mid-way leaves torch's lock file behind
    and every later process waits on it forever. We build under an fcntl lock of our own, which
    the kernel releases when its holder dies; whoever holds it knows any torch lock is stale."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load_inline

    build_dir = _get_build_directory(name, verbose=False)
    with open(os.path.join(build_dir, "inferd.flock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            os.remove(os.path.join(build_dir, "lock"))
            log.warning("removed a stale build lock of %s (an earlier build was killed)", name)
        except FileNotFoundError:
            pass
        return load_inline(name=name, cpp_sources=src, functions=functions, extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], verbose=False)


_compiled: dict[str, object] = {}


def compiled(name: str, src: str, functions: list[str], cflags: list[str], disable_env: str, what: str):
    """Build (once per process) and return an inline extension, or None when the environment
    variable `disable_env` is set or there is no compiler; the fallback `what` is logged once."""
    if name in _compiled:
        return _compiled[name]
    mod = None
    if not os.environ.get(disable_env):
        try:
            mod = build_inline(name, src, functions, cflags)
        except Exception as e:  # no compiler / ninja: every caller has a slower path or a clear error
            log.warning("%s unavailable (%s: %s); %s", name, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "", what)
    _compiled[name] = mod
    return mod


def load():
    """The compiled module, or None (no compiler, or INFERD_NO_CPP_OPS=1)."""
    # no -ffast-math: the roundings above must happen exactly as written
    return compiled("inferd_cpu_ops_v3", _SRC, ["rms_norm", "add_rms_norm", "rope_", "silu_mul"],
                    ["-O3", "-march=native", "-fopenmp"], "INFERD_NO_CPP_OPS", "using torch ops")

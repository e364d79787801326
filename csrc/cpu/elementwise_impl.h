// RMS norm (optionally fused with the residual add), rotary embedding and SiLU-and-mul, with the
// roundings of the torch expressions they replace (fp32 maths inside, results rounded to T where
// torch rounds):
//   norm:      bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), after x += d rounded to T
//   rope:      bf16(bf16(x * cos) + bf16(swap(x) * sin)) in place (sign folded into sin)
//   silu_mul:  bf16(bf16(silu(gate)) * up)   (exp is simd.h's fexp: within 2 ulp of libm's, not
//              torch's bits)
// For fp32 the roundings vanish. Included once per ISA variant, inside its namespace (variant_*.cpp).

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

template <typename T>
static void rope_rows(T* x, int64_t T_, int64_t heads, int64_t row_stride, int64_t D, const float* cos,
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
          // the tables rounded to T first, as torch multiplies T by T
          const float c0 = static_cast<float>(rnd<T>(c[i])), c1 = static_cast<float>(rnd<T>(c[i + half]));
          const float s0 = static_cast<float>(rnd<T>(s[i])), s1 = static_cast<float>(rnd<T>(s[i + half]));
          v[i] = rnd<T>(static_cast<float>(rnd<T>(a * c0)) + static_cast<float>(rnd<T>(bb * s0)));
          v[i + half] = rnd<T>(static_cast<float>(rnd<T>(bb * c1)) + static_cast<float>(rnd<T>(a * s1)));
        }
      }
    }
  });
}

template <typename T>
static void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t F) {
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* g = gu + r * 2 * F;
      const T* u = g + F;
      T* o = out + r * F;
      int64_t i = 0;
#if INFERD_ISA_LEVEL == 1  // as exp_shifted (softmax_impl.h): AVX-512 vectorises the scalar loop itself
      if constexpr (std::is_same_v<T, float>)
        for (; i + LANES <= F; i += LANES) {
          const VF x = fload(g + i);
          const VF sl = fdiv(x, fadd(fset1(1.f), fexp(fneg(x))));
          fstore(o + i, fmul(sl, fload(u + i)));
        }
#endif
      for (; i < F; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = rnd<T>(static_cast<float>(rnd<T>(x / (1.f + fexp(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

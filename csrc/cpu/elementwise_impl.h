// RMS norm (optionally fused with the residual add), rotary embedding and SiLU-and-mul, with the
// roundings of the torch expressions they replace (fp32 maths inside, results rounded to T where
// torch rounds):
//   norm:      bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), after x += d rounded to T
//   rope:      bf16(bf16(x * cos) + bf16(swap(x) * sin)) in place (sign folded into sin)
//   silu_mul:  bf16(bf16(silu(gate)) * up)   (exp is expf_lanes below: within 2 ulp of libm's, not
//              torch's bits)
// For fp32 the roundings vanish. Included once per ISA variant, inside its namespace (variant_*.cpp).

template <typename T> static inline T rnd(float x) { return static_cast<T>(x); }

// exp(x) in float without a libm call, so loops over it vectorise (a call to expf per element ran
// silu_mul at ~2 ns an element: 48 ms of a 512-token prefill). 2^k * p(r) with k = round(x / ln 2),
// r = x - k ln 2 in two parts (Cody-Waite), p a degree-6 polynomial: within 2 ulp of expf over
// [-87, 88]; 0 below, inf above. The same bits on every ISA where FMA contraction agrees.
static inline float expf_lanes(float x) {
  x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
  const float t = x * 1.44269504f + 12582912.f;  // round to nearest by the 1.5 * 2^23 trick
  const float k = t - 12582912.f;
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(k) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

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
      for (int64_t i = 0; i < F; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = rnd<T>(static_cast<float>(rnd<T>(x / (1.f + expf_lanes(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

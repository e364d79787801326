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

#if INFERD_ISA_LEVEL == 1
// expf_lanes on 8 lanes, the same operations in the same order. On AVX2 GCC leaves loops over the
// scalar function unvectorised (the clamps stay branches; AVX-512 has masks for them): a batch-32
// silu_mul ran at ~2.7 ns an element and the decode softmax one exp at a time.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);  // max(a, b) = a > b ? a : b: a NaN x stays NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.72283f), x);
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(12582912.f));
  const __m256 k = _mm256_sub_ps(t, _mm256_set1_ps(12582912.f));
  const __m256 r =
      _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// x[i] = expf_lanes(x[i] - m) for i < n
static inline void exp_shifted(float* x, int64_t n, float m) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(m))));
  for (; i < n; ++i) x[i] = expf_lanes(x[i] - m);
}
#else
static inline void exp_shifted(float* x, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) x[i] = expf_lanes(x[i] - m);
}
#endif

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
#if INFERD_ISA_LEVEL == 1
      if constexpr (std::is_same_v<T, float>)
        for (; i + 8 <= F; i += 8) {
          const __m256 x = _mm256_loadu_ps(g + i);
          const __m256 e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));
          const __m256 sl = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(sl, _mm256_loadu_ps(u + i)));
        }
#endif
      for (; i < F; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = rnd<T>(static_cast<float>(rnd<T>(x / (1.f + expf_lanes(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
}

// W4A8 / W8A8: int4 nibbles or int8 weights times activations rounded to int8 per 32-block. Three
// inner loops by INFERD_ISA_LEVEL (set by the variant_*.cpp that includes this file):
//   0 generic  plain C++ the compiler vectorises for the baseline ISA
//   1 avx2     vpmaddubsw + vpmaddwd on 256-bit registers, one 32-block per step
//   2 avx512   the same on 512-bit registers, two 32-blocks per step
//   3 vnni     512-bit vpdpbusd (u8 x s8 -> s32 in one instruction)
// Nibble layout per 32-block: 16 bytes, byte j = q[j] | q[j + 16] << 4.

// x [M, K] fp32 -> xq int8, dx [M, K/32] (block scale), xs [M, K/32] = dx * sum(xq)
static void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* xq, float* dx, float* xs) {
  for (int64_t i = b0; i < b1; ++i) {
    const float* xb = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
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

static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  // a prefill chunk's rows in parallel; a decode step's few rows on the calling thread
  at::parallel_for(0, M * (K / 32), 2048, [&](int64_t b0, int64_t b1) { quantize_blocks(x, b0, b1, xq, dx, xs); });
}

static void dequantize4(const uint8_t* q, const float* sp, const float* mp, int64_t N, int64_t K, float* out) {
  const int64_t nb = K / 32;
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
}

#if INFERD_ISA_LEVEL >= 1
// DRAM latency, not arithmetic, bounds a decode GEMV: fetch the tile PF_TILES ahead while this one
// computes (measured on the 2-core AVX2 machine: ~10 % faster over a whole token's weights).
// Prefetching past the end is harmless: prefetches never fault.
static constexpr int64_t PF_TILES = 4;

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// one 32-block: the 32 nibbles of 16 bytes as 32 unsigned bytes (lows, then highs)
static inline __m256i nibbles256(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// u8 x s8 dot products of 4-byte groups, as 8 int32 (no saturation: |u| <= 128 and |s| <= 127)
static inline __m256i dot256(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

static inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}
#endif

#if INFERD_ISA_LEVEL >= 2
// two 32-blocks: [lows b, highs b, lows b+1, highs b+1] as 64 unsigned bytes, matching 64 activations
static inline __m512i nibbles512(const uint8_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
  return _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(0x0F));
}

static inline __m512i dot512(__m512i u, __m512i s) {
#if INFERD_ISA_LEVEL >= 3
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

// lanes 0-7 a, lanes 8-15 b: the scales of the two blocks a 512-bit step covers
static inline __m512 pair(float a, float b) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}
#endif

// a tile's R x MB accumulators (registers, or the scalar totals) set to v
template <typename T, int R, int MB>
static inline void fill(T (&a)[R][MB], T v) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) a[r][i] = v;
}

// R weight rows n..n+R-1 times MB activation rows i0..: the R*MB dot products of a tile.
template <int R, int MB>
static void tile4(const uint8_t* q, const float* s, const float* m, int64_t nb, const int8_t* xq, const float* dx,
                  const float* xs, int64_t K, int64_t N, float* y, int64_t n, int64_t i0) {
#if INFERD_ISA_LEVEL >= 1
  prefetch(q + (n + PF_TILES * R) * nb * 16, R * nb * 16);
  prefetch(s + (n + PF_TILES * R) * nb, R * nb * 4);
  prefetch(m + (n + PF_TILES * R) * nb, R * nb * 4);
  float tot[R][MB];
  int64_t b = 0;
#if INFERD_ISA_LEVEL >= 2
  __m512 acc[R][MB];
  fill(acc, _mm512_setzero_ps());
  for (; b + 2 <= nb; b += 2) {
    __m512i a[MB];
    __m512 d[MB];  // the activation blocks' scales, formed once per step for all R weight rows
    for (int i = 0; i < MB; ++i) {
      a[i] = _mm512_loadu_si512(xq + (i0 + i) * K + b * 32);
      d[i] = pair(dx[(i0 + i) * nb + b], dx[(i0 + i) * nb + b + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i w = nibbles512(q + ((n + r) * nb + b) * 16);
      const __m512 sr = pair(s[(n + r) * nb + b], s[(n + r) * nb + b + 1]);
      for (int i = 0; i < MB; ++i)
        acc[r][i] = _mm512_fmadd_ps(sr, _mm512_mul_ps(d[i], _mm512_cvtepi32_ps(dot512(w, a[i]))), acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_reduce_add_ps(acc[r][i]);
#else
  fill(tot, 0.f);
#endif
  // AVX2: every block; AVX-512: the odd one left over
  __m256 acc8[R][MB];
  fill(acc8, _mm256_setzero_ps());
  for (; b < nb; ++b) {
    __m256i a[MB];
    __m256 d[MB];
    for (int i = 0; i < MB; ++i) {
      a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i0 + i) * K + b * 32));
      d[i] = _mm256_set1_ps(dx[(i0 + i) * nb + b]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i w = nibbles256(q + ((n + r) * nb + b) * 16);
      const __m256 sr = _mm256_set1_ps(s[(n + r) * nb + b]);
      for (int i = 0; i < MB; ++i)
        acc8[r][i] = _mm256_fmadd_ps(sr, _mm256_mul_ps(d[i], _mm256_cvtepi32_ps(dot256(w, a[i]))), acc8[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      const float* mr = m + (n + r) * nb;
      const float* xsi = xs + (i0 + i) * nb;
      float off = 0.f;
      for (int64_t c = 0; c < nb; ++c) off += mr[c] * xsi[c];
      y[(i0 + i) * N + n + r] = tot[r][i] + hsum256(acc8[r][i]) + off;
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
static void rows4(const uint8_t* q, const float* s, const float* m, int64_t nb, const int8_t* xq, const float* dx,
                  const float* xs, int64_t K, int64_t N, float* y, int64_t n0, int64_t n1, int64_t i0) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile4<4, MB>(q, s, m, nb, xq, dx, xs, K, N, y, n, i0);
  for (; n < n1; ++n) tile4<1, MB>(q, s, m, nb, xq, dx, xs, K, N, y, n, i0);
}

// Activation rows per tile: 4 where there are 32 vector registers (AVX-512), else 2 (16 on AVX2).
static constexpr int MB_MAX = INFERD_ISA_LEVEL >= 2 ? 4 : 2;

// Output rows per panel: a panel's weights (64 x K/2 bytes of nibbles plus scales) stay in L1/L2
// while every activation row passes over them, so a batch reads each weight from DRAM once, not
// once per pair of rows. Every output element is summed in the same order whatever M is and
// wherever its row sits in the batch: a row's result does not depend on its batch (batch invariance).
static constexpr int64_t PANEL = 64;

template <typename Rows>
static void over_panels(int64_t M, int64_t N, const Rows& rows) {
  // split the output rows, in multiples of 4, over the threads; each thread walks its share in panels
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t end = std::min(N, t1 * 4);
    for (int64_t n0 = t0 * 4; n0 < end; n0 += PANEL) {
      const int64_t n1 = std::min(end, n0 + PANEL);
      int64_t i = 0;
      if (MB_MAX >= 4)
        for (; i + 4 <= M; i += 4) rows(std::integral_constant<int, MB_MAX>(), n0, n1, i);
      for (; i + 2 <= M; i += 2) rows(std::integral_constant<int, 2>(), n0, n1, i);
      if (i < M) rows(std::integral_constant<int, 1>(), n0, n1, i);
    }
  });
}

static void w4a8_gemm(const uint8_t* q, const float* s, const float* m, const int8_t* xq, const float* dx,
                      const float* xs, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t nb = K / 32;
  over_panels(M, N, [&](auto mb, int64_t n0, int64_t n1, int64_t i) {
    rows4<decltype(mb)::value>(q, s, m, nb, xq, dx, xs, K, N, y, n0, n1, i);
  });
}

// int8 weights (one scale per output row) times the int8 activations: the lm_head of the gguf path
// and the int8 methods. u8 x s8 instructions want one side unsigned: |w| times x with w's sign.
template <int R, int MB>
static void tile8(const int8_t* w, const float* ws, int64_t K, const int8_t* xq, const float* dx, float* y,
                  int64_t N, int64_t n, int64_t i0) {
  const int64_t nb = K / 32;
#if INFERD_ISA_LEVEL >= 1
  prefetch(w + (n + PF_TILES * R) * K, R * K);
  float tot[R][MB];
  int64_t b = 0;
#if INFERD_ISA_LEVEL >= 2
  __m512 acc[R][MB];
  fill(acc, _mm512_setzero_ps());
  for (; b + 2 <= nb; b += 2) {
    __m512i a[MB];
    __m512 d[MB];
    for (int i = 0; i < MB; ++i) {
      a[i] = _mm512_loadu_si512(xq + (i0 + i) * K + b * 32);
      d[i] = pair(dx[(i0 + i) * nb + b], dx[(i0 + i) * nb + b + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(w + (n + r) * K + b * 32);
      const __mmask64 neg = _mm512_movepi8_mask(v);
      const __m512i av = _mm512_abs_epi8(v);
      for (int i = 0; i < MB; ++i) {
        // AVX-512 has no vpsignb: negate x where w < 0 under w's sign mask (|x| <= 127, no overflow)
        const __m512i sa = _mm512_mask_sub_epi8(a[i], neg, _mm512_setzero_si512(), a[i]);
        acc[r][i] = _mm512_fmadd_ps(d[i], _mm512_cvtepi32_ps(dot512(av, sa)), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_reduce_add_ps(acc[r][i]);
#else
  fill(tot, 0.f);
#endif
  // AVX2: every block; AVX-512: the odd one left over
  __m256 acc8[R][MB];
  fill(acc8, _mm256_setzero_ps());
  for (; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + r) * K + b * 32));
      const __m256i av = _mm256_sign_epi8(v, v);
      for (int i = 0; i < MB; ++i) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (i0 + i) * K + b * 32));
        acc8[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dx[(i0 + i) * nb + b]),
                                     _mm256_cvtepi32_ps(dot256(av, _mm256_sign_epi8(a, v))), acc8[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) y[(i0 + i) * N + n + r] = (tot[r][i] + hsum256(acc8[r][i])) * ws[n + r];
#else
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < MB; ++i) {
      float tot = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += w[(n + r) * K + b * 32 + j] * xq[(i0 + i) * K + b * 32 + j];
        tot += dx[(i0 + i) * nb + b] * static_cast<float>(dot);
      }
      y[(i0 + i) * N + n + r] = tot * ws[n + r];
    }
#endif
}

static void w8a8_gemm(const int8_t* w, const float* ws, const int8_t* xq, const float* dx, int64_t M, int64_t K,
                      int64_t N, float* y) {
  over_panels(M, N, [&](auto mb, int64_t n0, int64_t n1, int64_t i) {
    constexpr int MB = decltype(mb)::value;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile8<4, MB>(w, ws, K, xq, dx, y, N, n, i);
    for (; n < n1; ++n) tile8<1, MB>(w, ws, K, xq, dx, y, N, n, i);
  });
}

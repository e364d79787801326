// The vector registers of a variant as small inline functions, one set per ISA level (included by
// variant.h, inside the variant's namespace, after the target switch): VF holds floats, VI bytes or
// int32. The kernels are written once against these. On the generic variant (level 0) VF is one
// float (LANES = 1), for the kernels written over floats alone (flash attention); it has no VI, and
// the integer kernels keep plain loops there.
//
// Every variant also has the lane operations on one float (fmul, ffma, fmax, ...), so that a loop's
// scalar tail runs the very code of its vector body (fexp). ffma on floats is a * b + c as the
// variant's compiler rounds it: fused under a vector variant's target, rounded twice on the generic
// variant (its baseline ISA has no FMA); generic code whose floats must be the vector variants' own
// calls std::fma. fmax(a, b) is a > b ? a : b, so b where either is NaN, as maxps has it (fmin
// likewise); fmax, fmin and fabs hide the C library's functions inside a variant.

// ---- one float, on every variant -----------------------------------------------------------------
static inline float fmul(float a, float b) { return a * b; }
static inline float fadd(float a, float b) { return a + b; }
static inline float fsub(float a, float b) { return a - b; }
static inline float ffma(float a, float b, float c) { return a * b + c; }
static inline float fnmadd(float a, float b, float c) { return c - a * b; }
static inline float fmax(float a, float b) { return a > b ? a : b; }
static inline float fmin(float a, float b) { return a < b ? a : b; }
// 2^k for a whole k from -126 to 128 (inf): k + 127 written into the exponent's bits
static inline float fpow2(float k) { return std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23); }
// c in every lane of a V (a float, or the variant's VF): what code written for both spells a constant
template <class V>
static inline V splat(float c);
template <>
inline float splat<float>(float c) { return c; }

#if INFERD_ISA_LEVEL >= 1
#if INFERD_ISA_LEVEL >= 2
using VF = __m512;
using VI = __m512i;
static constexpr int LANES = 16;  // floats a vector
#define INFERD_MM(op) _mm512_##op
#define INFERD_SI(op) _mm512_##op##_si512
#else
using VF = __m256;
using VI = __m256i;
static constexpr int LANES = 8;
#define INFERD_MM(op) _mm256_##op
#define INFERD_SI(op) _mm256_##op##_si256
#endif

// ---- the same instructions at either width ----------------------------------------------------
static inline VI vload(const uint8_t* p) { return INFERD_SI(loadu)(reinterpret_cast<const VI*>(p)); }
static inline VI vset1(int32_t v) { return INFERD_MM(set1_epi32)(v); }
// the 4 bytes at p in every 32-bit lane (one activation row's 4 k, against a lane's 4 codes)
static inline VI vbcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vset1(v);
}
static inline VI vzero() { return INFERD_SI(setzero)(); }
static inline VI vand(VI a, VI b) { return INFERD_SI(and)(a, b); }
static inline VI vor(VI a, VI b) { return INFERD_SI(or)(a, b); }
static inline VI vsrl4(VI a) { return INFERD_MM(srli_epi16)(a, 4); }
static inline VI vadd16(VI a, VI b) { return INFERD_MM(add_epi16)(a, b); }
static inline VI vadd32(VI a, VI b) { return INFERD_MM(add_epi32)(a, b); }
static inline VI vsub32(VI a, VI b) { return INFERD_MM(sub_epi32)(a, b); }
static inline VI vmaddubs(VI u, VI s) { return INFERD_MM(maddubs_epi16)(u, s); }
static inline VI vmadd1(VI a) { return INFERD_MM(madd_epi16)(a, INFERD_MM(set1_epi16)(1)); }
static inline VI vbyte(int8_t v) { return INFERD_MM(set1_epi8)(v); }
// the GGUF block kernels (gguf_blocks_impl.h): bit planes, a 16-entry table
template <int S>
static inline VI vshift16(VI a) {  // left by S (right by -S) within 16-bit lanes
  if constexpr (S > 0) return INFERD_MM(slli_epi16)(a, S);
  else if constexpr (S < 0) return INFERD_MM(srli_epi16)(a, -S);
  else return a;
}
static inline VI vlookup(VI table, VI idx) { return INFERD_MM(shuffle_epi8)(table, idx); }
static inline VF fzero() { return INFERD_MM(setzero_ps)(); }
static inline VF fload(const float* p) { return INFERD_MM(loadu_ps)(p); }
static inline VF fset1(float v) { return INFERD_MM(set1_ps)(v); }
static inline VF fmul(VF a, VF b) { return INFERD_MM(mul_ps)(a, b); }
static inline VF fadd(VF a, VF b) { return INFERD_MM(add_ps)(a, b); }
static inline VF fsub(VF a, VF b) { return INFERD_MM(sub_ps)(a, b); }
static inline VF fdiv(VF a, VF b) { return INFERD_MM(div_ps)(a, b); }
static inline VF ffma(VF a, VF b, VF c) { return INFERD_MM(fmadd_ps)(a, b, c); }
static inline VF fnmadd(VF a, VF b, VF c) { return INFERD_MM(fnmadd_ps)(a, b, c); }
static inline VF fmax(VF a, VF b) { return INFERD_MM(max_ps)(a, b); }
static inline VF fmin(VF a, VF b) { return INFERD_MM(min_ps)(a, b); }
static inline VF fcvt(VI a) { return INFERD_MM(cvtepi32_ps)(a); }
// the sign bit: cleared, flipped, or taken from `sign`
static inline VF fabs(VF x) { return INFERD_MM(andnot_ps)(fset1(-0.f), x); }
static inline VF fneg(VF x) { return INFERD_MM(xor_ps)(x, fset1(-0.f)); }
static inline VF fcopysign(VF mag, VF sign) {
  const VF s = fset1(-0.f);
  return INFERD_MM(or_ps)(INFERD_MM(andnot_ps)(s, mag), INFERD_MM(and_ps)(s, sign));
}
template <>
inline VF splat<VF>(float c) { return fset1(c); }
#undef INFERD_MM
#undef INFERD_SI

// v's 8 lanes folded into one by op: the halves, then pairs, then the last two. The one order every
// 8-lane sum or maximum here takes (and the 16-lane sums after their own first fold).
template <class Op>
static inline float fold8(__m256 v, Op op) {
  __m128 h = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = op(h, _mm_movehl_ps(h, h));
  h = op(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
static inline float fsum8(__m256 v) { return fold8(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }

// ---- what differs between the widths ------------------------------------------------------------
#if INFERD_ISA_LEVEL >= 2
static inline VF fload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline VF fload(const bf16* p) {  // bf16 -> fp32: the 16 bits moved to the top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline VF fload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <int S>  // bits S..S+3 of each of 16 bytes (Q2_K's scale and min nibbles), as floats
static inline VF fload_nibble(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, S), _mm512_set1_epi32(15)));
}
static inline void fstore(float* p, VF v, int64_t n) {
  if (n >= 16) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
static inline float fsum(VF v) { return _mm512_reduce_add_ps(v); }
static inline float fhmax(VF v) { return _mm512_reduce_max_ps(v); }
static inline int32_t vsum32(VI v) { return _mm512_reduce_add_epi32(v); }
static inline VF fselect_lt(VF a, float c, VF if_lt, VF otherwise) {  // lane: a < c ? if_lt : otherwise
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(c), _CMP_LT_OQ), otherwise, if_lt);
}
static inline VF fpow2(VF k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23));
}
// W8 on AVX-512 without VNNI: |w| (u8) times x negated where w < 0 (there is no vpsignb)
static inline VI vabs8(VI w) { return _mm512_abs_epi8(w); }
static inline VI vsign8(VI x, VI w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
static inline VI vtable(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
// lane j = the sum of v[j]'s 16 lanes (16 vectors): 45 shuffles and adds for 16 sums, where one
// horizontal sum each is 8
static inline VF fsum_each(const VF* v) {
  __m512 r[8], s[4];
  // within each 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3] for A, B = v[2i], v[2i+1]
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // then each 128-bit lane's sums of v[4i..4i+3]
  for (int i = 0; i < 4; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0x44), _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], 0xEE));
  // then across the four 128-bit lanes: lane block i of the result holds v[4i..4i+3]'s totals
  const __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44), _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
  const __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44), _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
}
// 16 lanes in 16 / LANES vectors, added in one fixed tree: lane l + 8, then + 4, + 2, + 1
static inline float fsum16(const VF* a) {
  return fsum8(_mm256_add_ps(_mm512_castps512_ps256(a[0]), _mm512_extractf32x8_ps(a[0], 1)));
}
#else
static inline VF fload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VF fload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline VF fload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <int S>
static inline VF fload_nibble(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, S), _mm256_set1_epi32(15)));
}
static inline void fstore(float* p, VF v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
    return;
  }
  float t[8];
  _mm256_storeu_ps(t, v);
  for (int64_t j = 0; j < n; ++j) p[j] = t[j];
}
static inline float fsum(VF v) { return fsum8(v); }
static inline float fhmax(VF v) { return fold8(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); }
static inline int32_t vsum32(VI v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
static inline VF fselect_lt(VF a, float c, VF if_lt, VF otherwise) {
  return _mm256_blendv_ps(otherwise, if_lt, _mm256_cmp_ps(a, _mm256_set1_ps(c), _CMP_LT_OQ));
}
static inline VF fpow2(VF k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23));
}
static inline VI vabs8(VI w) { return _mm256_sign_epi8(w, w); }
static inline VI vsign8(VI x, VI w) { return _mm256_sign_epi8(x, w); }
static inline VI vtable(const int8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
// lane j = the sum of v[j]'s 8 lanes (8 vectors): 21 shuffles and adds for 8 sums, where one
// horizontal sum each is 6
static inline VF fsum_each(const VF* v) {
  // within each 128-bit half: hadd twice leaves [v0, v1, v2, v3] partial sums (v4.. in the second)
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // then the two halves added: lanes 0-3 from b0, 4-7 from b1
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
static inline float fsum16(const VF* a) { return fsum8(_mm256_add_ps(a[0], a[1])); }
#endif

#else
// ---- the generic variant: a vector of one float --------------------------------------------------
using VF = float;
static constexpr int LANES = 1;
static inline VF fzero() { return 0.f; }
static inline VF fset1(float v) { return v; }
static inline VF fload(const float* p) { return *p; }
static inline VF fload(const uint16_t* p) { return static_cast<float>(c10::Half(*p, c10::Half::from_bits())); }
static inline VF fload(const bf16* p) { return static_cast<float>(*p); }
static inline VF fload(const int8_t* p) { return static_cast<float>(*p); }
static inline void fstore(float* p, VF v, int64_t n) {
  if (n > 0) *p = v;
}
static inline VF fdiv(VF a, VF b) { return a / b; }
static inline VF fabs(VF x) { return std::fabs(x); }
static inline VF fcopysign(VF mag, VF sign) { return std::copysign(mag, sign); }
static inline float fsum(VF v) { return v; }
static inline float fhmax(VF v) { return v; }
static inline VF fselect_lt(VF a, float c, VF if_lt, VF otherwise) { return a < c ? if_lt : otherwise; }
static inline VF fsum_each(const VF* v) { return v[0]; }
static inline float fsum16(const VF* l) {
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
#endif

// ---- every variant, over the above ---------------------------------------------------------------
static inline void fstore(float* p, VF v) { fstore(p, v, LANES); }

// exp(x) in float without a libm call, so loops over it vectorise (a call to expf per element ran
// silu_mul at ~2 ns an element: 48 ms of a 512-token prefill). 2^k * p(r) with k = round(x / ln 2),
// r = x - k ln 2 in two parts (Cody-Waite), p a degree-6 polynomial: within 2 ulp of expf over
// [-87, 88]; clamped there (a NaN stays NaN). On one float or on a VF with the same operations in
// the same order, so a vector loop's scalar tail gives its lanes' bits (where FMA contraction
// agrees: a vector variant's compiler fuses the float a * b + c as its fma does).
template <class V>
static inline V fexp(V x) {
  x = fmin(splat<V>(88.72283f), fmax(splat<V>(-87.33654f), x));
  const V k = fsub(ffma(x, splat<V>(1.44269504f), splat<V>(12582912.f)), splat<V>(12582912.f));  // 1.5 * 2^23 rounds
  const V r = ffma(k, splat<V>(2.12194440e-4f), fnmadd(k, splat<V>(0.693359375f), x));
  V p = splat<V>(1.9875691500e-4f);
  p = ffma(p, r, splat<V>(1.3981999507e-3f));
  p = ffma(p, r, splat<V>(8.3334519073e-3f));
  p = ffma(p, r, splat<V>(4.1665795894e-2f));
  p = ffma(p, r, splat<V>(1.6666665459e-1f));
  p = ffma(p, r, splat<V>(5.0000001201e-1f));
  p = fadd(ffma(fmul(p, r), r, r), splat<V>(1.f));
  return fmul(p, fpow2(k));
}
// fexp, exactly 0 below -87.3: a masked score (-inf) must weigh nothing
static inline VF fexp_or_zero(VF x) { return fselect_lt(x, -87.33654f, fzero(), fexp(x)); }

// q . k over D. In registers on AVX2/AVX-512 (16 or 8 lanes, one horizontal sum a dot): a plain
// `s += q[d] * k[d]` is a serial chain the compiler may not reorder, and lane sums kept in an
// array went through memory (a vector store, then scalar reloads stalling on store forwarding).
template <typename T>
static inline float dot_lanes(const float* q, const T* k, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if INFERD_ISA_LEVEL >= 1
  VF a = fzero(), b = fzero();  // two chains: a head of 64 is 2 or 4 steps
  for (; d + 2 * LANES <= D; d += 2 * LANES) {
    a = ffma(fload(q + d), fload(k + d), a);
    b = ffma(fload(q + d + LANES), fload(k + d + LANES), b);
  }
  for (; d + LANES <= D; d += LANES) a = ffma(fload(q + d), fload(k + d), a);
  s = fsum(fadd(a, b));
#endif
  for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

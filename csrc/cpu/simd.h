// The vector registers of a variant as small inline functions, one set per ISA level (included by
// variant.h, inside the variant's namespace, after the target switch): VF holds floats, VI bytes or
// int32. The kernels are written once against these; the generic variant (level 0) has none and
// uses plain loops.
#if INFERD_ISA_LEVEL >= 1
#if INFERD_ISA_LEVEL >= 2
using VF = __m512;
using VI = __m512i;
static constexpr int LANES = 16;  // floats a vector
static inline VI vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline VI vset1(int32_t v) { return _mm512_set1_epi32(v); }
static inline VI vzero() { return _mm512_setzero_si512(); }
static inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
static inline VI vsrl4(VI a) { return _mm512_srli_epi16(a, 4); }
static inline VI vadd16(VI a, VI b) { return _mm512_add_epi16(a, b); }
static inline VI vadd32(VI a, VI b) { return _mm512_add_epi32(a, b); }
static inline VI vsub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
static inline VI vmaddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
static inline VI vmadd1(VI a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
static inline VI vbyte(int8_t v) { return _mm512_set1_epi8(v); }
static inline VF fzero() { return _mm512_setzero_ps(); }
static inline VF fload(const float* p) { return _mm512_loadu_ps(p); }
static inline VF fload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline VF fload(const bf16* p) {  // bf16 -> fp32: the 16 bits moved to the top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline float fsum(VF v) { return _mm512_reduce_add_ps(v); }
static inline VF fset1(float v) { return _mm512_set1_ps(v); }
static inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF fadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF ffma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF fcvt(VI a) { return _mm512_cvtepi32_ps(a); }
static inline void fstore(float* p, VF v, int64_t n) {
  if (n >= 16) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
// W8 on AVX-512 without VNNI: |w| (u8) times x negated where w < 0 (there is no vpsignb)
static inline VI vabs8(VI w) { return _mm512_abs_epi8(w); }
static inline VI vsign8(VI x, VI w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
// the GGUF block kernels (gguf_blocks_impl.h): bit planes, a 16-entry table, int8 sub-scales
static inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
template <int S>
static inline VI vshift16(VI a) {  // left by S (right by -S) within 16-bit lanes
  if constexpr (S > 0) return _mm512_slli_epi16(a, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(a, -S);
  else return a;
}
static inline VI vtable(const int8_t* t) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
static inline VI vlookup(VI table, VI idx) { return _mm512_shuffle_epi8(table, idx); }
static inline VF fload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline VF fnmadd(VF a, VF b, VF c) { return _mm512_fnmadd_ps(a, b, c); }
template <int S>  // bits S..S+3 of each of 16 bytes (Q2_K's scale and min nibbles), as floats
static inline VF fload_nibble(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, S), _mm512_set1_epi32(15)));
}
#elif INFERD_ISA_LEVEL == 1
using VF = __m256;
using VI = __m256i;
static constexpr int LANES = 8;
static inline VI vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline VI vset1(int32_t v) { return _mm256_set1_epi32(v); }
static inline VI vzero() { return _mm256_setzero_si256(); }
static inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
static inline VI vsrl4(VI a) { return _mm256_srli_epi16(a, 4); }
static inline VI vadd16(VI a, VI b) { return _mm256_add_epi16(a, b); }
static inline VI vadd32(VI a, VI b) { return _mm256_add_epi32(a, b); }
static inline VI vsub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
static inline VI vmaddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
static inline VI vmadd1(VI a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
static inline VI vbyte(int8_t v) { return _mm256_set1_epi8(v); }
static inline VF fzero() { return _mm256_setzero_ps(); }
static inline VF fload(const float* p) { return _mm256_loadu_ps(p); }
static inline VF fload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline VF fload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float fsum(VF v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
static inline VF fset1(float v) { return _mm256_set1_ps(v); }
static inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF fadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF ffma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF fcvt(VI a) { return _mm256_cvtepi32_ps(a); }
static inline void fstore(float* p, VF v, int64_t n) {
  if (n >= 8) {
    _mm256_storeu_ps(p, v);
    return;
  }
  float t[8];
  _mm256_storeu_ps(t, v);
  for (int64_t j = 0; j < n; ++j) p[j] = t[j];
}
static inline VI vabs8(VI w) { return _mm256_sign_epi8(w, w); }
static inline VI vsign8(VI x, VI w) { return _mm256_sign_epi8(x, w); }
static inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
template <int S>
static inline VI vshift16(VI a) {
  if constexpr (S > 0) return _mm256_slli_epi16(a, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(a, -S);
  else return a;
}
static inline VI vtable(const int8_t* t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))); }
static inline VI vlookup(VI table, VI idx) { return _mm256_shuffle_epi8(table, idx); }
static inline VF fload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline VF fnmadd(VF a, VF b, VF c) { return _mm256_fnmadd_ps(a, b, c); }
template <int S>
static inline VF fload_nibble(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, S), _mm256_set1_epi32(15)));
}
#endif
#endif

// LoRA deltas of a step's rows, each row with its own adapter (Punica's BGMV on the CPU): for row t
// in slot s = slots[t] (none when s < 0) and each part p of the layer (q, k, v of a fused qkv; gate,
// up), y[t, off_p .. off_p + n_p) += B_p[s] (A_p[s] x_t), in fp32. One call per projection and step,
// whatever the number of adapters: the rows pick their slot's weights, not a pass per adapter.
//
// a [S, parts, R, K]: A's rows, zero past the adapter's rank; b [S, R, N]: per slot, part p's B
// stored as [R, n_p] at offset R * off_p. ranks [S, parts]: the rank each slot's adapter has on each
// part (0: that projection is not adapted). Each shrink is one 16-lane dot product over K summed in
// a fixed tree (simd.h's fsum16, as half_gemm_impl.h sums); each expand is fma(v_r, b, y) per output in
// rank order: the same floats on every variant, for every row, whatever the batch.

#if INFERD_ISA_LEVEL >= 1
static inline float lora_dot(const float* a, const float* x, int64_t K) {
  VF acc[HV];
  for (int h = 0; h < HV; ++h) acc[h] = fzero();
  for (int64_t k = 0; k < K; k += 16)
    for (int h = 0; h < HV; ++h) acc[h] = ffma(fload(a + k + h * LANES), fload(x + k + h * LANES), acc[h]);
  return fsum16(acc);
}

static inline void lora_axpy(float v, const float* b, float* y, int64_t n) {
  const VF vv = fset1(v);
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) fstore(y + j, ffma(vv, fload(b + j), fload(y + j)), LANES);
  for (; j < n; ++j) y[j] = std::fma(v, b[j], y[j]);
}
#else
static inline float lora_dot(const float* a, const float* x, int64_t K) {
  float l[16] = {};
  for (int64_t k = 0; k < K; k += 16)
    for (int j = 0; j < 16; ++j) l[j] = std::fma(a[k + j], x[k + j], l[j]);
  return fsum16(l);
}

static inline void lora_axpy(float v, const float* b, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = std::fma(v, b[j], y[j]);
}
#endif

static void lora_bgmv(const float* x, int64_t T, int64_t K, const float* a, const float* b, const int64_t* slots,
                      const int64_t* ranks, int64_t S, int64_t parts, const int64_t* part_n, int64_t R, float* y,
                      int64_t N) {
  (void)S;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    float v[256];  // R <= 256 (checked by the caller)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const float* xt = x + t * K;
      float* yt = y + t * N;
      int64_t off = 0;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t n = part_n[p], r = ranks[s * parts + p];
        const float* ap = a + (s * parts + p) * R * K;
        const float* bp = b + s * R * N + R * off;
        for (int64_t i = 0; i < r; ++i) v[i] = lora_dot(ap + i * K, xt, K);
        for (int64_t i = 0; i < r; ++i) lora_axpy(v[i], bp + i * n, yt + off, n);
        off += n;
      }
    }
  });
}

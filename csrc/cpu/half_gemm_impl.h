// F16 / BF16 weights kept in their 16 bits: y [M, N] = x [M, K] (float32) times w [N, K]^T, each
// weight widened exactly to fp32 in registers and multiplied in fp32 (llama.cpp rounds the
// activations to the weights' 16-bit type; this keeps them float32, so the result is the dequantized
// model's up to the order of the sums). A layer holds the file's bytes, half the float32 copy's, and
// a batch-1 step reads 2 bytes a weight, not 4.
//
// Every output is one dot product over K in 16 lanes: lane l sums x[k] w[k] for k = l mod 16 with one
// fma per k, in order; then the lanes are added in one fixed tree (l + 8, then + 4, + 2, + 1). AVX-512
// holds the 16 lanes in one register, AVX2 in two, the generic variant in an array: the same floats
// on every variant, whatever the tile, the number of rows or a row's place among them.
// Tiles: MR rows x HC columns, the columns' weights loaded once per 16 k for all MR rows.

static constexpr int64_t HC = 4;  // columns a tile

#if INFERD_ISA_LEVEL >= 1
// 16 lanes: one vector (AVX-512) or two (AVX2)
static constexpr int HV = 16 / LANES;

static constexpr int64_t HPF = 4;  // tiles ahead

template <typename W, int MR, int NC>
static void htile(const W* w, const float* x, int64_t K, int64_t N, float* y, int64_t i0, int64_t n0) {
  VF acc[MR][NC][HV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c)
      for (int h = 0; h < HV; ++h) acc[r][c][h] = fzero();
  // one row: the tiles after this one streamed into cache while it computes, a share each 16 k
  // (without it a batch-1 step read ~15 GB/s of the machine's ~35)
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + HPF * NC) * K);
  for (int64_t k = 0; k < K; k += 16) {
    if constexpr (MR == 1)
      for (int64_t b = 0; b < NC * 32; b += 64) _mm_prefetch(ahead + k * NC * 2 + b, _MM_HINT_T0);
    for (int h = 0; h < HV; ++h) {
      VF wv[NC];
      for (int c = 0; c < NC; ++c) wv[c] = fload(w + (n0 + c) * K + k + h * LANES);
      for (int r = 0; r < MR; ++r) {
        const VF xv = fload(x + (i0 + r) * K + k + h * LANES);
        for (int c = 0; c < NC; ++c) acc[r][c][h] = ffma(xv, wv[c], acc[r][c][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) y[(i0 + r) * N + n0 + c] = fsum16(acc[r][c]);
}
// AVX-512: 4 rows x 4 columns (16 accumulators); AVX2: one row (two registers a lane set)
static constexpr int HMR = INFERD_ISA_LEVEL >= 2 ? 4 : 1;
#else
template <typename W, int MR, int NC>
static void htile(const W* w, const float* x, int64_t K, int64_t N, float* y, int64_t i0, int64_t n0) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) {
      float lane[16] = {};
      const W* wr = w + (n0 + c) * K;
      const float* xr = x + (i0 + r) * K;
      for (int64_t k = 0; k < K; ++k) lane[k % 16] = std::fma(xr[k], fload(wr + k), lane[k % 16]);
      y[(i0 + r) * N + n0 + c] = fsum16(lane);
    }
}
static constexpr int HMR = 1;
#endif

// rows i0..M of columns n0..n0 + NC: tiles of HMR rows, then single rows
template <typename W, int NC>
static void hcolumns(const W* w, const float* x, int64_t M, int64_t K, int64_t N, float* y, int64_t n0) {
  int64_t i = 0;
  for (; i + HMR <= M; i += HMR) htile<W, HMR, NC>(w, x, K, N, y, i, n0);
  for (; i < M; ++i) htile<W, 1, NC>(w, x, K, N, y, i, n0);
}

template <typename W>
static void hgemm(const W* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  // a task is a run of 4-column panels over every row: a panel's weights (4 x K x 2 bytes) stay in L1
  // while the row tiles pass over them, so a step reads each weight from memory once
  const int64_t panels = (N + HC - 1) / HC;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * HC;
      // one row on AVX-512: two panels a tile, 8 accumulator chains and 8 streams in flight (batch-1
      // decode of a 271 MB F16 file ~74 -> ~80 tok/s in interleaved runs); each output's floats are
      // the same whichever tile computes it
      if (INFERD_ISA_LEVEL >= 2 && M == 1 && p + 1 < p1 && n0 + 2 * HC <= N) {
        htile<W, 1, 2 * HC>(w, x, K, N, y, 0, n0);
        ++p;
      } else if (n0 + HC <= N) {
        hcolumns<W, HC>(w, x, M, K, N, y, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) hcolumns<W, 1>(w, x, M, K, N, y, n);
      }
    }
  });
}

// w: fp16 bits, or bf16 when `bf16`; K a multiple of 16
static void half_gemm(const uint16_t* w, bool bf16, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  if (bf16) hgemm(reinterpret_cast<const inferd::bf16*>(w), x, M, K, N, y);
  else hgemm(w, x, M, K, N, y);
}

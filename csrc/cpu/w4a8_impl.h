// W4A8 / W8A8: int4 or int8 weights times activations rounded to int8 per 32-block, one GEMM for
// every number of rows (a decode step's one row to a 512-token prefill chunk).
//
// The weights are repacked once at load (inferd.quant.w4a8.pack4 / pack8) into groups of GW = 16
// output columns, one group a vector's lanes: a multiply-add takes 4 consecutive k of 16 columns
// against 4 bytes of one activation row broadcast to every lane, and sums into that row's 16
// outputs. Nothing is reduced across lanes, each 32-block's integer sum is converted and scaled once
// per (row, 16 columns), and one weight vector serves every row of a tile.
// Two groups (32 columns) make a pair; per pair and 32-block one record holds both groups' codes,
// then their scales, then (W4) their mins, so a decode step (one row, 8 groups a tile) reads 4
// sequential streams, not 24. Scales and mins are fp16 where every one of a layer's is exactly an
// fp16 value (GGUF's Q4_0/Q4_1/Q8_0 blocks store them so: 17 % fewer bytes a W4 weight), fp32
// otherwise; the kernel converts them exactly, so the two forms compute the same floats. Per group
// (GW columns l, bytes p = 0..3 of a lane's 4):
//   W4  256 bytes of codes, 4 chunks of 64: chunk c byte 4l+p = q[l][4c+p] | q[l][16+4c+p] << 4
//       (q in 0..15), w = q s + m; record = codes g0, codes g1, s g0, s g1, m g0, m g1 = 640 or
//       768 bytes
//   W8  512 bytes, 8 chunks of 64: chunk c byte 4l+p = q[l][4c+p] (int8); record = 1088 or 1152 bytes
// Padding columns (N up to a multiple of 32) hold zeros and are never stored.
//
// Per ISA (INFERD_ISA_LEVEL, set by the variant_*.cpp that includes this file):
//   0 generic  plain C++, one row and group at a time
//   1 avx2     256-bit: a group is two halves; vpmaddubsw, int16 sums over a block, one vpmaddwd
//   2 avx512   the same on 512-bit registers
//   3 vnni     512-bit vpdpbusd (u8 x s8 -> s32 in one instruction)
// Every variant computes, per output (row i, column n), the same integer block sums and then, block
// by block in order, y = fma(float(isum), s * dx, y) and (W4) y = fma(m, xs, y): the same floats on
// every ISA, whatever the tile, the number of rows or a row's place among them (batch invariance).

static constexpr int64_t GW = 16;

// x [M, K] fp32 -> xq int8, dx [M, K/32] (block scale), xs = dx * sum(xq), xi = sum(xq) as int
static void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* xq, float* dx, float* xs, int32_t* xi) {
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
    xi[i] = sum;
  }
}

static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int32_t* xi) {
  // a prefill chunk's rows in parallel; a decode step's few rows on the calling thread
  at::parallel_for(0, M * (K / 32), 2048, [&](int64_t b0, int64_t b1) { quantize_blocks(x, b0, b1, xq, dx, xs, xi); });
}

// What a tile reads: the packed weights and the rounded rows.
struct Operands {
  const uint8_t* w;   // packed records [G / 2, nb, record bytes]
  const int8_t* xq;   // [M, K]
  const float* dx;    // [M, nb]
  const float* xs;    // [M, nb]
  const int32_t* xi;  // [M, nb]
  int64_t K, nb, N;
  float* y;           // [M, N]
};

// Where group g's block b starts in the records, and where its scales and mins are (S: float, or
// uint16_t holding fp16 bits).
template <bool W8, typename S>
struct Layout {
  static constexpr int64_t CODES = W8 ? 512 : 256;
  static constexpr int64_t RECORD = 2 * CODES + (W8 ? 2 : 4) * GW * static_cast<int64_t>(sizeof(S));
  static const uint8_t* codes(const Operands& o, int64_t g, int64_t b) {
    return o.w + ((g >> 1) * o.nb + b) * RECORD + (g & 1) * CODES;
  }
  static const S* scale(const Operands& o, int64_t g, int64_t b) {
    return reinterpret_cast<const S*>(o.w + ((g >> 1) * o.nb + b) * RECORD + 2 * CODES) + (g & 1) * GW;
  }
  static const S* min(const Operands& o, int64_t g, int64_t b) { return scale(o, g, b) + 2 * GW; }
};

static inline float scalar(float v) { return v; }
static inline float scalar(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows per tile x groups per tile: the tile's accumulators fill the vector registers (32 on
// AVX-512: 8 rows x 16 columns of int sums and of float totals; 16 on AVX2).
static constexpr int TILE = INFERD_ISA_LEVEL >= 2 ? 8 : INFERD_ISA_LEVEL == 1 ? 2 : 1;


#if INFERD_ISA_LEVEL >= 1
static constexpr int HALVES = GW / LANES;  // vectors per group

// MR rows i0.. times NG groups g0.. of W4: every output of the tile, over all of K.
template <typename S, int MR, int NG>
static void tile4(const Operands& o, int64_t i0, int64_t g0) {
  constexpr int NV = NG * HALVES;  // vectors across the tile's columns
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fzero();
  const VI low = vbyte(0x0F);
  for (int64_t b = 0; b < o.nb; ++b) {
    VI sum[MR][NV];  // int16 pairs below VNNI (at most 8 x 2 x 15 x 127 = 30480: no overflow), int32 with it
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v] = vzero();
    for (int c = 0; c < 4; ++c) {
      VI xl[MR], xh[MR];
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = o.xq + (i0 + r) * o.K + b * 32 + 4 * c;
        xl[r] = vset1(load4(xr));
        xh[r] = vset1(load4(xr + 16));
      }
      for (int v = 0; v < NV; ++v) {
        const VI raw = vload(Layout<false, S>::codes(o, g0 + v / HALVES, b) + 64 * c + (v % HALVES) * 32);
        const VI lo = vand(raw, low), hi = vand(vsrl4(raw), low);
        for (int r = 0; r < MR; ++r) {
#if INFERD_ISA_LEVEL >= 3
          sum[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[r][v], lo, xl[r]), hi, xh[r]);
#else
          sum[r][v] = vadd16(sum[r][v], vadd16(vmaddubs(lo, xl[r]), vmaddubs(hi, xh[r])));
#endif
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const int64_t h = (v % HALVES) * LANES;
      const VF sv = fload(Layout<false, S>::scale(o, g0 + v / HALVES, b) + h);
      const VF mv = fload(Layout<false, S>::min(o, g0 + v / HALVES, b) + h);
      for (int r = 0; r < MR; ++r) {
#if INFERD_ISA_LEVEL >= 3
        const VI isum = sum[r][v];
#else
        const VI isum = vmadd1(sum[r][v]);
#endif
        const int64_t xb = (i0 + r) * o.nb + b;
        acc[r][v] = ffma(fcvt(isum), fmul(sv, fset1(o.dx[xb])), acc[r][v]);
        acc[r][v] = ffma(mv, fset1(o.xs[xb]), acc[r][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = (g0 + v / HALVES) * GW + (v % HALVES) * LANES;
    for (int r = 0; r < MR; ++r) fstore(o.y + (i0 + r) * o.N + n, acc[r][v], o.N - n);
  }
}

// The same for W8: 8 chunks a block, signed weights, no min.
template <typename S, int MR, int NG>
static void tile8(const Operands& o, int64_t i0, int64_t g0) {
  constexpr int NV = NG * HALVES;
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fzero();
  for (int64_t b = 0; b < o.nb; ++b) {
    VI sum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v] = vzero();
    for (int c = 0; c < 8; ++c) {
      VI xb[MR];
      for (int r = 0; r < MR; ++r) xb[r] = vset1(load4(o.xq + (i0 + r) * o.K + b * 32 + 4 * c));
      for (int v = 0; v < NV; ++v) {
        const VI w = vload(Layout<true, S>::codes(o, g0 + v / HALVES, b) + 64 * c + (v % HALVES) * 32);
#if INFERD_ISA_LEVEL >= 3
        // vpdpbusd wants the unsigned side: w + 128 (w ^ 0x80); the 128 * sum(x) is taken off below
        const VI u = _mm512_xor_si512(w, vbyte(static_cast<int8_t>(0x80)));
        for (int r = 0; r < MR; ++r) sum[r][v] = _mm512_dpbusd_epi32(sum[r][v], u, xb[r]);
#else
        // |w| times x with w's sign: |w| <= 128 and |x| <= 127, so a pair fits int16; int32 every chunk
        const VI aw = vabs8(w);
        for (int r = 0; r < MR; ++r) sum[r][v] = vadd32(sum[r][v], vmadd1(vmaddubs(aw, vsign8(xb[r], w))));
#endif
      }
    }
    for (int v = 0; v < NV; ++v) {
      const VF sv = fload(Layout<true, S>::scale(o, g0 + v / HALVES, b) + (v % HALVES) * LANES);
      for (int r = 0; r < MR; ++r) {
        const int64_t xb = (i0 + r) * o.nb + b;
#if INFERD_ISA_LEVEL >= 3
        const VI isum = vsub32(sum[r][v], vset1(128 * o.xi[xb]));
#else
        const VI isum = sum[r][v];
#endif
        acc[r][v] = ffma(fcvt(isum), fmul(sv, fset1(o.dx[xb])), acc[r][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = (g0 + v / HALVES) * GW + (v % HALVES) * LANES;
    for (int r = 0; r < MR; ++r) fstore(o.y + (i0 + r) * o.N + n, acc[r][v], o.N - n);
  }
}
#else
// generic: one row, one group; std::fma so the floats are the vector variants' own
template <typename S, int MR, int NG>
static void tile4(const Operands& o, int64_t i0, int64_t g0) {
  static_assert(MR == 1 && NG == 1, "generic tiles are 1 x 1");
  float acc[GW] = {};
  for (int64_t b = 0; b < o.nb; ++b) {
    const uint8_t* wb = Layout<false, S>::codes(o, g0, b);
    const S *sb = Layout<false, S>::scale(o, g0, b), *mb = Layout<false, S>::min(o, g0, b);
    const int8_t* xr = o.xq + i0 * o.K + b * 32;
    const int64_t xb = i0 * o.nb + b;
    for (int l = 0; l < GW; ++l) {
      int32_t sum = 0;
      for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 4; ++p) {
          const uint8_t byte = wb[64 * c + 4 * l + p];
          sum += (byte & 15) * xr[4 * c + p] + (byte >> 4) * xr[16 + 4 * c + p];
        }
      acc[l] = std::fma(static_cast<float>(sum), scalar(sb[l]) * o.dx[xb], acc[l]);
      acc[l] = std::fma(scalar(mb[l]), o.xs[xb], acc[l]);
    }
  }
  for (int64_t l = 0; l < GW && g0 * GW + l < o.N; ++l) o.y[i0 * o.N + g0 * GW + l] = acc[l];
}

template <typename S, int MR, int NG>
static void tile8(const Operands& o, int64_t i0, int64_t g0) {
  static_assert(MR == 1 && NG == 1, "generic tiles are 1 x 1");
  float acc[GW] = {};
  for (int64_t b = 0; b < o.nb; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(Layout<true, S>::codes(o, g0, b));
    const S* sb = Layout<true, S>::scale(o, g0, b);
    const int8_t* xr = o.xq + i0 * o.K + b * 32;
    for (int l = 0; l < GW; ++l) {
      int32_t sum = 0;
      for (int c = 0; c < 8; ++c)
        for (int p = 0; p < 4; ++p) sum += wb[64 * c + 4 * l + p] * xr[4 * c + p];
      acc[l] = std::fma(static_cast<float>(sum), scalar(sb[l]) * o.dx[i0 * o.nb + b], acc[l]);
    }
  }
  for (int64_t l = 0; l < GW && g0 * GW + l < o.N; ++l) o.y[i0 * o.N + g0 * GW + l] = acc[l];
}
#endif

// Groups g..g1 for rows i0..i0+MR: tiles of NG groups while they fit, then narrower ones.
template <bool W8, typename S, int MR, int NG>
static void across(const Operands& o, int64_t i0, int64_t g, int64_t g1) {
  for (; g + NG <= g1; g += NG) {
    if constexpr (W8) tile8<S, MR, NG>(o, i0, g);
    else tile4<S, MR, NG>(o, i0, g);
  }
  if constexpr (NG > 1) across<W8, S, MR, NG / 2>(o, i0, g, g1);
}

// Rows i..M over groups g0..g1: tiles of MR rows (and TILE / MR groups) while they fit, then fewer rows.
template <bool W8, typename S, int MR>
static void down(const Operands& o, int64_t M, int64_t i, int64_t g0, int64_t g1) {
  for (; i + MR <= M; i += MR) across<W8, S, MR, TILE / MR>(o, i, g0, g1);
  if constexpr (MR > 1) down<W8, S, MR / 2>(o, M, i, g0, g1);
}

// Groups per panel: a panel's weights (8 x 16 columns x K bytes or half that) stay in L2 while every
// row tile passes over them, so a step reads each weight from DRAM once whatever M is.
static constexpr int64_t PANEL = 8;

template <bool W8, typename S>
static void gemm(const Operands& o, int64_t M) {
  const int64_t G = (o.N + GW - 1) / GW;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t p = g0; p < g1; p += PANEL) down<W8, S, TILE>(o, M, 0, p, std::min(g1, p + PANEL));
  });
}

static void w4a8_gemm(const uint8_t* w, bool half, const int8_t* xq, const float* dx, const float* xs,
                      const int32_t* xi, int64_t M, int64_t K, int64_t N, float* y) {
  const Operands o{w, xq, dx, xs, xi, K, K / 32, N, y};
  half ? gemm<false, uint16_t>(o, M) : gemm<false, float>(o, M);
}

static void w8a8_gemm(const uint8_t* w, bool half, const int8_t* xq, const float* dx, const float* xs,
                      const int32_t* xi, int64_t M, int64_t K, int64_t N, float* y) {
  const Operands o{w, xq, dx, xs, xi, K, K / 32, N, y};
  half ? gemm<true, uint16_t>(o, M) : gemm<true, float>(o, M);
}

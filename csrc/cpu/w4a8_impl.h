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
//   4 amx      vnni, plus AMX tiles (tdpbssd) for every whole 16 rows of a W8 step
// Every variant computes, per output (row i, column n), the same integer block sums and then, block
// by block in order, y = fma(float(isum), s * dx, y) and (W4) y = fma(m, xs, y): the same floats on
// every ISA, whatever the tile, the number of rows or a row's place among them (batch invariance).

static constexpr int64_t GW = 16;

// x [M, K] fp32 -> xq int8, dx [M, K/32] (block scale), xs = dx * sum(xq), xi = sum(xq) as int
static void quantize_blocks(const float* x, int64_t b0, int64_t b1, int8_t* xq, float* dx, float* xs, int32_t* xi) {
#if INFERD_ISA_LEVEL >= 2
  // the same roundings in vectors: an exact IEEE division, round half to even (nearbyint's default
  // mode), so every variant rounds a block to the same codes. Scalar, the divisions were ~0.8 ns an
  // activation: half of a 32-row down_proj call.
  for (int64_t i = b0; i < b1; ++i) {
    const float* xb = x + i * 32;
    const __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
    const float amax = fhmax(fmax(fabs(a0), fabs(a1)));
    const float d = amax / 127.f;
    __m512i q0 = _mm512_setzero_si512(), q1 = q0;
    if (d > 0.f) {
      const __m512 dv = _mm512_set1_ps(d);
      constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(a0, dv), RN));
      q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(a1, dv), RN));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 32 + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = vsum32(vadd32(q0, q1));
    dx[i] = d;
    xs[i] = d * static_cast<float>(sum);
    xi[i] = sum;
  }
#elif INFERD_ISA_LEVEL == 1
  for (int64_t i = b0; i < b1; ++i) {
    const float* xb = x + i * 32;
    __m256 a[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(xb + 8 * j), m = fmax(m, fabs(a[j]));
    const float d = fhmax(m) / 127.f;
    __m256i q[4] = {};
    if (d > 0.f) {
      const __m256 dv = _mm256_set1_ps(d);
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(a[j], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int8 (|q| <= 127, no saturation): the packs interleave 128-bit lanes, the permute undoes it
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * 32),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const int32_t sum = vsum32(vadd32(vadd32(q[0], q[1]), vadd32(q[2], q[3])));
    dx[i] = d;
    xs[i] = d * static_cast<float>(sum);
    xi[i] = sum;
  }
#else
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
#endif
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
  // the same for unit u, a vector of `width` columns (a group, or half a group on AVX2)
  template <int64_t width>
  static const uint8_t* unit_codes(const Operands& o, int64_t u, int64_t b) {
    return codes(o, u / (GW / width), b) + u % (GW / width) * width * 4;
  }
  template <int64_t width>
  static const S* unit_scale(const Operands& o, int64_t u, int64_t b) {
    return scale(o, u / (GW / width), b) + u % (GW / width) * width;
  }
};

// Rows per tile x columns per tile: the tile's int sums and float totals fill the vector registers
// (32 on AVX-512, 16 on AVX2). A tile's columns come in units of one vector (a group on AVX-512, half a group on AVX2; a group
// in the generic variant). On AVX-512 a tile is 8 rows x 1 unit .. 1 row x 8 units. On AVX2, with
// 16 registers, a tile of 2 or 4 rows is one unit wide (each row: an int16 sum and a float total,
// 8 + 8 registers, plus the nibbles and a broadcast x) and a single row 4 units: wider tiles spilled
// their sums to the stack inside the block loop.
static constexpr int TILE = INFERD_ISA_LEVEL >= 2 ? 8 : INFERD_ISA_LEVEL == 1 ? 4 : 1;
template <int MR>
static constexpr int units_per_tile() { return INFERD_ISA_LEVEL == 1 ? (MR > 1 ? 1 : 4) : TILE / MR; }
#if INFERD_ISA_LEVEL >= 1
static constexpr int HALVES = GW / LANES;  // units (vectors) per group
#else
static constexpr int HALVES = 1;
#endif

#if INFERD_ISA_LEVEL >= 1

// Records a few blocks ahead into L2, a line at a time. A tile walks its pair's records in order, so
// the hardware prefetcher should see the stream; measured on a 2-core AMD EPYC (Zen 4) VM it leaves
// a decode step (one row: little work per byte) at half of DRAM speed without this: a Q4_K layer
// read at 12.6 GB/s on one thread and 18 on two, 18-20 and 27-36 with it (Q6_K: 11 -> 20, 16 -> 34),
// the compute alone at ~60. Into L2, not L1: prefetcht0 with the same distances gained nothing and
// halved a plain read loop's rate (L1's few miss buffers held by lines not yet needed). An asm
// statement, not _mm_prefetch: here GCC 12 compiled the builtin to no instruction at all, in every
// variant, for as long as it was written so (half_gemm's in the same files is emitted; why not here
// was not found), and an asm statement cannot be dropped. tests/test_native.py checks it is there.
static constexpr int64_t PREFETCH_BLOCKS = 16;
static inline void prefetch_l2(const char* p) { asm volatile("prefetcht2 %0" : : "m"(*p)); }
// Issued on the first rows only: later row tiles find the panel in L2. Past the last record it asks
// for nothing that exists, which a prefetch may.
//
// Block b + PREFETCH_BLOCKS of pair p's stream of nb blocks, as an index into every pair's blocks in
// order; past the stream's end, the same place in the pair npairs on, which the next tile starts
// (pairs' records are contiguous, so running on would land in the pair beside, already streaming).
// Short rows need it: K = 576 is 18 blocks, and each tile would start on blocks nobody asked for.
template <int NV>
static inline int64_t prefetch_block(int64_t p, int64_t b, int64_t nb) {
  constexpr int64_t NPAIRS = NV >= 2 * HALVES ? NV / (2 * HALVES) : 1;  // pairs a tile starts
  const int64_t a = b + PREFETCH_BLOCKS;
  return a < nb ? p * nb + a : (p + NPAIRS) * nb + (a - nb);
}

// For the tile of units u0.. at block b: every pair the tile starts is a stream of its own, `bytes` a
// block (W4A8/W8A8: a record; the GGUF block types: a super-block record's share per block).
template <int NV>
static inline void prefetch_tile(const uint8_t* w, int64_t i0, int64_t u0, int64_t b, int64_t nb, int64_t bytes) {
  if (i0 != 0) return;
  for (int v = 0; v < NV; ++v) {
    if ((u0 + v) % (2 * HALVES) != 0) continue;
    const char* p = reinterpret_cast<const char*>(w) + prefetch_block<NV>((u0 + v) / (2 * HALVES), b, nb) * bytes;
    for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(p + off);
  }
}

// Chunk c of block b of rows i0..i0 + MR - 1 of the rounded x [M, K]: each row's 4 bytes of the low
// 16 k (xl) and of the high 16 k (xh), in every lane
template <int MR>
static inline void chunk_x(const int8_t* xq, int64_t K, int64_t i0, int64_t b, int c, VI (&xl)[MR], VI (&xh)[MR]) {
  for (int r = 0; r < MR; ++r) {
    const int8_t* xr = xq + (i0 + r) * K + b * 32 + 4 * c;
    xl[r] = vbcast4(xr);
    xh[r] = vbcast4(xr + 16);
  }
}

// A tile's totals into y [M, N]: rows i0.., LANES columns a unit from unit u0 (the last cut at N)
template <int MR, int NV>
static inline void store_tile(float* y, int64_t N, int64_t i0, int64_t u0, const VF (&acc)[MR][NV]) {
  for (int v = 0; v < NV; ++v) {
    const int64_t n = (u0 + v) * LANES;
    for (int r = 0; r < MR; ++r) fstore(y + (i0 + r) * N + n, acc[r][v], N - n);
  }
}

// MR rows i0.. times NV units u0.. of W4: every output of the tile, over all of K.
template <typename S, int MR, int NV>
static void tile4(const Operands& o, int64_t i0, int64_t u0) {
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fzero();
  const VI low = vbyte(0x0F);
  for (int64_t b = 0; b < o.nb; ++b) {
    prefetch_tile<NV>(o.w, i0, u0, b, o.nb, Layout<false, S>::RECORD);
    VI sum[MR][NV];  // int16 pairs below VNNI (at most 8 x 2 x 15 x 127 = 30480: no overflow), int32 with it
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v] = vzero();
    for (int c = 0; c < 4; ++c) {
      VI xl[MR], xh[MR];
      chunk_x(o.xq, o.K, i0, b, c, xl, xh);
      for (int v = 0; v < NV; ++v) {
        const VI raw = vload(Layout<false, S>::template unit_codes<LANES>(o, u0 + v, b) + 64 * c);
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
      const S* s = Layout<false, S>::template unit_scale<LANES>(o, u0 + v, b);
      const VF sv = fload(s), mv = fload(s + 2 * GW);  // the mins follow the pair's scales
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
  store_tile(o.y, o.N, i0, u0, acc);
}

// The same for W8: 8 chunks a block, signed weights, no min.
template <typename S, int MR, int NV>
static void tile8(const Operands& o, int64_t i0, int64_t u0) {
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fzero();
  for (int64_t b = 0; b < o.nb; ++b) {
    prefetch_tile<NV>(o.w, i0, u0, b, o.nb, Layout<true, S>::RECORD);
    VI sum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) sum[r][v] = vzero();
    for (int c = 0; c < 8; ++c) {
      VI xb[MR];
      for (int r = 0; r < MR; ++r) xb[r] = vbcast4(o.xq + (i0 + r) * o.K + b * 32 + 4 * c);
      for (int v = 0; v < NV; ++v) {
        const VI w = vload(Layout<true, S>::template unit_codes<LANES>(o, u0 + v, b) + 64 * c);
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
      const VF sv = fload(Layout<true, S>::template unit_scale<LANES>(o, u0 + v, b));
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
  store_tile(o.y, o.N, i0, u0, acc);
}
#else
// A generic tile's GW totals into y [M, N]: row i0, group g0 (the last cut at N)
static inline void store_group(float* y, int64_t N, int64_t i0, int64_t g0, const float* acc) {
  for (int64_t l = 0; l < GW && g0 * GW + l < N; ++l) y[i0 * N + g0 * GW + l] = acc[l];
}

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
      acc[l] = std::fma(static_cast<float>(sum), fload(sb + l) * o.dx[xb], acc[l]);
      acc[l] = std::fma(fload(mb + l), o.xs[xb], acc[l]);
    }
  }
  store_group(o.y, o.N, i0, g0, acc);
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
      acc[l] = std::fma(static_cast<float>(sum), fload(sb + l) * o.dx[i0 * o.nb + b], acc[l]);
    }
  }
  store_group(o.y, o.N, i0, g0, acc);
}
#endif

// The walk every integer GEMM here shares (W4A8, W8A8, the GGUF block types: gguf_blocks_impl.h).
// `Tile::run<MR, NV>(o, i0, u)` computes rows i0..i0+MR times units u..u+NV over all of K.
// Units u..u1 for rows i0..i0+MR: tiles of NV units while they fit, then narrower ones.
template <class Tile, int MR, int NV, class O>
static void across(const O& o, int64_t i0, int64_t u, int64_t u1) {
  for (; u + NV <= u1; u += NV) Tile::template run<MR, NV>(o, i0, u);
  if constexpr (NV > 1) across<Tile, MR, NV / 2>(o, i0, u, u1);
}

// Rows i..M over groups g0..g1: tiles of MR rows while they fit, then fewer rows.
template <class Tile, int MR, class O>
static void down(const O& o, int64_t M, int64_t i, int64_t g0, int64_t g1) {
  for (; i + MR <= M; i += MR) across<Tile, MR, Tile::template units<MR>()>(o, i, g0 * HALVES, g1 * HALVES);
  if constexpr (MR > 1) down<Tile, MR / 2>(o, M, i, g0, g1);
}

template <bool W8, typename S>
struct WTile {
  template <int MR>
  static constexpr int units() { return units_per_tile<MR>(); }
  template <int MR, int NV>
  static void run(const Operands& o, int64_t i0, int64_t u) {
    if constexpr (W8) tile8<S, MR, NV>(o, i0, u);
    else tile4<S, MR, NV>(o, i0, u);
  }
};

// Groups per panel: a panel's weights (8 x 16 columns x K bytes or half that) stay in L2 while every
// row tile passes over them, so a step reads each weight from DRAM once whatever M is.
static constexpr int64_t PANEL = 8;

// Rows i..M over groups g0..g1, a panel of groups at a time
template <class Tile, class O>
static void panels(const O& o, int64_t M, int64_t i, int64_t g0, int64_t g1) {
  for (int64_t p = g0; p < g1; p += PANEL) down<Tile, TILE>(o, M, i, p, std::min(g1, p + PANEL));
}

// Every row over every group, the groups shared among the threads
template <class Tile, class O>
static void all_panels(const O& o, int64_t M) {
  at::parallel_for(0, (o.N + GW - 1) / GW, 1, [&](int64_t g0, int64_t g1) { panels<Tile>(o, M, 0, g0, g1); });
}

#if INFERD_ISA_LEVEL >= 4
// AMX, for W8: 16 rows x one group (16 columns) a tile pass. Per 32-block one tdpbssd computes the
// 256 exact int32 block sums (A: 16 rows x 32 int8 of x; B: 8 rows of 4 k x 16 columns, read
// straight from the records, whose order is the tiles' own), stored and then scaled by the same
// fma's as every other variant, so the floats are theirs bit for bit.
// Not for W4: splitting the nibbles into a tile buffer (tdpbsud) worked, but measured no faster
// than vpdpbusd (0.84-1.29x over the layer shapes at 16-512 rows, mostly within 10 %; W8 1.1-1.8x):
// per block the scale-and-min epilogue, the same in both, is what a W4 tile waits on.
static constexpr int64_t AMX_ROWS = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void amx_configure() {
  TileConfig c;
  c.rows[0] = AMX_ROWS, c.colsb[0] = GW * 4;  // C: 16 rows x 16 int32
  c.rows[1] = AMX_ROWS, c.colsb[1] = 32;      // A: 16 rows x one 32-block of int8
  c.rows[2] = 8, c.colsb[2] = GW * 4;         // B: 32 k as 8 rows of 4, x 16 columns
  for (int t = 0; t < 3; ++t) c.rows[3 + t] = c.rows[t], c.colsb[3 + t] = c.colsb[t];  // the second set
  _tile_loadconfig(&c);
}

// One block's tile op into tile C from tiles A and B. Two sets of tiles, so that the next block's
// op runs while this one's sums are stored and scaled (tiles are not renamed). A macro: GCC's tile
// intrinsics paste the tile number into the instruction text, so it cannot be a template argument.
#define INFERD_AMX_BLOCK(C, A, B, b)                                \
  do {                                                              \
    const uint8_t* w_ = Layout<true, S>::codes(o, g, b);            \
    _tile_zero(C);                                                  \
    _tile_loadd(A, o.xq + i0 * o.K + (b) * 32, o.K);                \
    _tile_loadd(B, w_, GW * 4);                                     \
    _tile_dpbssd(C, A, B);                                          \
  } while (0)

// Block b's stored sums c into the row totals: the same fma's as the other variants'
template <typename S>
static inline void amx_scale(const Operands& o, int64_t i0, int64_t g, int64_t b, const int32_t* c, VF* acc) {
  const VF sv = fload(Layout<true, S>::scale(o, g, b));
  for (int r = 0; r < AMX_ROWS; ++r) {
    const int64_t xb = (i0 + r) * o.nb + b;
    acc[r] = ffma(fcvt(_mm512_load_si512(c + r * GW)), fmul(sv, fset1(o.dx[xb])), acc[r]);
  }
}

template <typename S>
static void amx_tile(const Operands& o, int64_t i0, int64_t g, int32_t* c) {
  VF acc[AMX_ROWS];
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = fzero();
  int64_t b = 0;
  for (; b + 2 <= o.nb; b += 2) {
    INFERD_AMX_BLOCK(0, 1, 2, b);
    INFERD_AMX_BLOCK(3, 4, 5, b + 1);
    _tile_stored(0, c, GW * 4);
    amx_scale<S>(o, i0, g, b, c, acc);
    _tile_stored(3, c + AMX_ROWS * GW, GW * 4);
    amx_scale<S>(o, i0, g, b + 1, c + AMX_ROWS * GW, acc);
  }
  if (b < o.nb) {
    INFERD_AMX_BLOCK(0, 1, 2, b);
    _tile_stored(0, c, GW * 4);
    amx_scale<S>(o, i0, g, b, c, acc);
  }
  for (int r = 0; r < AMX_ROWS; ++r) fstore(o.y + (i0 + r) * o.N + g * GW, acc[r], o.N - g * GW);
}
#undef INFERD_AMX_BLOCK
#endif

template <bool W8, typename S>
static void gemm(const Operands& o, int64_t M) {
#if INFERD_ISA_LEVEL >= 4
  const int64_t G = (o.N + GW - 1) / GW;
  // W8: whole 16-row tiles through AMX, the rest (and a step of fewer rows) as on avx512_vnni: both
  // give the same floats, so a row's result still does not depend on where the cut falls
  if constexpr (W8) {
    const int64_t M16 = M / AMX_ROWS * AMX_ROWS;
    if (M16 > 0) {
      at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
        amx_configure();
        alignas(64) int32_t c[2 * AMX_ROWS * GW];
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t i = 0; i < M16; i += AMX_ROWS) amx_tile<S>(o, i, g, c);
        _tile_release();
        if (M16 < M) panels<WTile<W8, S>>(o, M, M16, g0, g1);
      });
      return;
    }
  }
#endif
  all_panels<WTile<W8, S>>(o, M);
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

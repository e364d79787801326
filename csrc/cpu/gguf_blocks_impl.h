// GGUF's K-quants, Q5_0/Q5_1 and IQ4 kept in their own bits, times activations rounded to int8 per
// 32-block (the same rounding as W4A8/W8A8): one integer GEMM for every number of rows.
//
// The layout extends W4A8's (w4a8_impl.h): groups of GW = 16 output columns in a vector's lanes,
// two groups a pair, per 32-block each group's 4 chunks of 64 nibble bytes (chunk c byte 4l + p:
// the low 4 bits of q[l][4c + p] | those of q[l][16 + 4c + p] << 4). Q2_K and Q3_K keep 2 low bits
// instead (base 2): 2 vectors of 64 bytes a group, vector c / 2 byte 4l + p holding q[l][4c + p]
// at bit 4 (c % 2) and q[l][16 + 4c + p] at bit 4 (c % 2) + 2. A 3-, 5- or 6-bit type adds one or
// two bit planes of 64 bytes a group: plane j byte 4l + p holds bit base + j of q[l][4c + p] at bit
// c and of q[l][16 + 4c + p] at bit 4 + c, so chunk c's codes are the low bits with each plane's bit
// shifted into place (two shifts, two ands, two ors a plane). Q6_K keeps its two high bits as 2-bit
// fields instead (q6_codes; quant.gguf_blocks.pack says where). Scales stay what the file stores: an
// fp16 d (and dmin) per column and super-block, int8 sub-scales (and mins; Q2_K's 4-bit pair in one
// byte) per 16 or 32 weights, multiplied out in the epilogue (d * sc is exact in fp32: the value
// gguf's dequantization uses). So a layer holds about the file's bytes: Q6_K exactly 6.5625 bits a
// weight, Q2_K 2.625, Q3_K 3.5625 (the file 3.4375: its 6-bit sub-scales kept as bytes).
//
// Per block and (row, 16 columns): the integer sum of q * xq per sub-block (the lower and upper 16
// k are the low and high nibbles: the two halves of a 16-weight type fall out of the layout), less
// off * sum(xq); then, sub-block by sub-block, y = fma(float(isum), (d * sc) * dx, y) and
// y = fnmadd(dmin * mn, dx * sum(xq), y) (K-quant mins), and y = fma(m, xs, y) (Q5_1). The same
// integers and floats in that order on every variant and in every tile: a row's result does not
// depend on the ISA, on M, or on its place in the batch.
//
// IQ4's codes index a table of 16 int8 values (vpshufb). With VNNI the table is stored + 128 (an
// unsigned byte for vpdpbusd) and 128 * sum(xq) taken off; below VNNI the signed values go through
// vpmaddubsw as |w| times x with w's sign, as W8A8 does.

static constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct BlockOperands {
  const uint8_t* w;  // records [ceil(N / 32), K / (32 * super), record bytes]
  const int8_t* xq;
  const float* dx;
  const float* xs;
  const int32_t* xi;
  const int32_t* xi16;  // [M, K / 16]
  int64_t K, nb, N;
  float* y;
};

template <int T>
struct Blocks {
  static constexpr BlockFormat F = kBlockFormats[T];
  static constexpr int H = F.high, NSUB = 32 / F.sub, SB = static_cast<int>(block_super(F));
  static constexpr int64_t HEADER = block_header(F), BLOCK = block_bytes(F), RECORD = block_record(F);
  static constexpr int64_t GB = block_group_bytes(F);  // a group's low-bit bytes a block
  // super-block s of pair p
  static const uint8_t* super(const BlockOperands& o, int64_t p, int64_t s) {
    return o.w + (p * (o.nb / SB) + s) * RECORD;
  }
  // block bi of a super-block: group j's low bits at + GB j, plane h's bytes at + 2 GB + 128 h + 64 j
  static const uint8_t* block(const uint8_t* sup, int64_t bi) { return sup + HEADER + bi * BLOCK; }
  // col: the column within the pair (0..31)
  static const uint16_t* d(const uint8_t* sup, int64_t col) { return reinterpret_cast<const uint16_t*>(sup) + col; }
  static const uint16_t* dm(const uint8_t* sup, int64_t col) { return reinterpret_cast<const uint16_t*>(sup + 64) + col; }
  static const int8_t* sc(const uint8_t* sup, int64_t bi, int h, int64_t col) {
    return reinterpret_cast<const int8_t*>(sup + 64 + (F.mink ? 64 : 0)) + (bi * NSUB + h) * 32 + col;
  }
  static const int8_t* mn(const uint8_t* sup, int64_t bi, int h, int64_t col) {
    return sc(sup, bi, h, col) + SB * NSUB * 32;
  }
  // the rounded x's sum over sub-block h of block b, row i
  static int32_t xsum(const BlockOperands& o, int64_t i, int64_t b, int h) {
    return NSUB == 1 ? o.xi[i * o.nb + b] : o.xi16[i * 2 * o.nb + 2 * b + h];
  }
};

#if INFERD_ISA_LEVEL >= 1

// Chunk c's codes with plane j's bit moved to bit base + j: for the low 16 k it sits at bit c, for
// the high ones at bit 4 + c (a 16-bit shift keeps a byte's bits in the byte once masked).
template <int BASE, int H, int C>
static inline void add_planes(const uint8_t* planes, VI& lo, VI& hi) {
  if constexpr (H >= 1) {
    const VI p = vload(planes);
    lo = vor(lo, vand(vshift16<BASE - C>(p), vbyte(1 << BASE)));
    hi = vor(hi, vand(vshift16<BASE - 4 - C>(p), vbyte(1 << BASE)));
  }
  if constexpr (H >= 2) {
    const VI p = vload(planes + 128);
    lo = vor(lo, vand(vshift16<BASE + 1 - C>(p), vbyte(2 << BASE)));
    hi = vor(hi, vand(vshift16<BASE - 3 - C>(p), vbyte(2 << BASE)));
  }
}

// Chunk c's low bits: nibbles (base 4), or 2-bit fields (base 2)
template <int BASE, int C>
static inline void low_bits(const uint8_t* blk, VI& lo, VI& hi) {
  if constexpr (BASE == 4) {
    const VI raw = vload(blk + 64 * C), low = vbyte(0x0F);
    lo = vand(raw, low), hi = vand(vsrl4(raw), low);
  } else {
    const VI raw = vload(blk + 64 * (C / 2)), low = vbyte(0x03);
    lo = vand(vshift16<-4 * (C % 2)>(raw), low), hi = vand(vshift16<-4 * (C % 2) - 2>(raw), low);
  }
}

// Q6_K's chunk c: its nibbles, and the 2-bit fields of vector c / 2 (bits 4-7 for an even c, 0-3 for an
// odd one). Planes cost 4 shifts a chunk and left the kernel ALU-bound, well under DRAM speed at
// batch 1; fields cost 1.5. With VNNI the upper 16 k's codes come out times 4 (the nibble at bits 2-5,
// the field at 6-7: one shift fewer; 4 x 63 still a byte, and vpdpbusd sums into int32 without
// saturating), which the epilogue takes back exactly with an arithmetic shift of the integer sum.
template <int C, bool X4>
static inline void q6_codes(const uint8_t* blk, const uint8_t* fields, VI& lo, VI& hi) {
  const VI raw = vload(blk + 64 * C);
  VI f = vload(fields + 64 * (C / 2));
  if constexpr (C % 2 != 0) f = vshift16<4>(f);
  lo = vor(vand(raw, vbyte(0x0F)), vand(f, vbyte(0x30)));
  if constexpr (X4) hi = vor(vand(vshift16<-2>(raw), vbyte(0x3C)), vand(f, vbyte(0xC0)));
  else hi = vor(vand(vsrl4(raw), vbyte(0x0F)), vand(vshift16<-2>(f), vbyte(0x30)));
}

template <int T, int MR, int NV>
static void btile(const BlockOperands& o, int64_t i0, int64_t u0) {
  using B = Blocks<T>;
  constexpr auto F = B::F;
  constexpr int NSUB = B::NSUB, SB = B::SB;
#if INFERD_ISA_LEVEL >= 3
  constexpr bool VNNI = true;
#else
  constexpr bool VNNI = false;
#endif
  constexpr int32_t OFF = F.off + (F.lut && VNNI ? 128 : 0);
  // without VNNI, int16 sums of vpmaddubsw pairs (2 x q x 127 each) last this many chunks
  constexpr int FLUSH = F.high == 2 ? 2 : 4;
  constexpr int64_t PAIR_UNITS = 2 * HALVES;
  alignas(16) int8_t table[16];
  for (int t = 0; t < 16; ++t) table[t] = static_cast<int8_t>(IQ4_VALUES[t] + (VNNI ? 128 : 0));
  const VI tbl = vtable(table);
  VF acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = fzero();
  int64_t col[NV], pair[NV], unit_off[NV];
  for (int v = 0; v < NV; ++v) {
    pair[v] = (u0 + v) / PAIR_UNITS;
    col[v] = (u0 + v) % PAIR_UNITS * LANES;
    unit_off[v] = col[v] / GW * B::GB + col[v] % GW * 4;  // the unit's bytes within a chunk
  }
  const int64_t nsup = o.nb / SB;
  for (int64_t s = 0; s < nsup; ++s) {
    const uint8_t* sup[NV];
    VF dv[NV], mv[NV];
    for (int v = 0; v < NV; ++v) {
      sup[v] = B::super(o, pair[v], s);
      dv[v] = fload(B::d(sup[v], col[v]));
      if constexpr (F.mink != 0) mv[v] = fload(B::dm(sup[v], col[v]));
    }
    for (int bi = 0; bi < SB; ++bi) {
      const int64_t b = s * SB + bi;
      // a block's share of each pair's records, as W4A8 prefetches (a whole super-block at once, one
      // ahead, left the stream at 60-80 % of DRAM speed)
      prefetch_tile<NV>(o.w, i0, u0, b, o.nb, B::RECORD / SB);
      VI sum[MR][NV][NSUB];
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
          for (int h = 0; h < NSUB; ++h) sum[r][v][h] = vzero();
      VI part[MR][NV][2];  // int16 (below VNNI, not IQ4)
      auto chunk = [&](auto cc) {
        constexpr int c = decltype(cc)::value;
        VI xl[MR], xh[MR];
        chunk_x(o.xq, o.K, i0, b, c, xl, xh);
        for (int v = 0; v < NV; ++v) {
          const uint8_t* blk = B::block(sup[v], bi) + unit_off[v];
          VI lo, hi;
          if constexpr (F.high == 2) {
            q6_codes<c, VNNI>(blk, blk + 2 * B::GB - unit_off[v] + col[v] / GW * 128 + col[v] % GW * 4, lo, hi);
          } else {
            low_bits<F.base, c>(blk, lo, hi);
            add_planes<F.base, F.high, c>(blk + 2 * B::GB - unit_off[v] + col[v] / GW * 64 + col[v] % GW * 4, lo, hi);
          }
          if constexpr (F.lut) lo = vlookup(tbl, lo), hi = vlookup(tbl, hi);
          for (int r = 0; r < MR; ++r) {
            if constexpr (VNNI) {
#if INFERD_ISA_LEVEL >= 3
              sum[r][v][0] = _mm512_dpbusd_epi32(sum[r][v][0], lo, xl[r]);
              sum[r][v][NSUB - 1] = _mm512_dpbusd_epi32(sum[r][v][NSUB - 1], hi, xh[r]);
#endif
            } else if constexpr (F.lut) {
              sum[r][v][0] = vadd32(sum[r][v][0], vmadd1(vmaddubs(vabs8(lo), vsign8(xl[r], lo))));
              sum[r][v][NSUB - 1] = vadd32(sum[r][v][NSUB - 1], vmadd1(vmaddubs(vabs8(hi), vsign8(xh[r], hi))));
            } else {
              const VI pl = vmaddubs(lo, xl[r]), ph = vmaddubs(hi, xh[r]);
              part[r][v][0] = c % FLUSH == 0 ? pl : vadd16(part[r][v][0], pl);
              part[r][v][1] = c % FLUSH == 0 ? ph : vadd16(part[r][v][1], ph);
              if constexpr (c % FLUSH == FLUSH - 1) {
                sum[r][v][0] = vadd32(sum[r][v][0], vmadd1(part[r][v][0]));
                sum[r][v][NSUB - 1] = vadd32(sum[r][v][NSUB - 1], vmadd1(part[r][v][1]));
              }
            }
          }
        }
      };
      chunk(std::integral_constant<int, 0>{});
      chunk(std::integral_constant<int, 1>{});
      chunk(std::integral_constant<int, 2>{});
      chunk(std::integral_constant<int, 3>{});
      for (int v = 0; v < NV; ++v) {
        for (int h = 0; h < NSUB; ++h) {
          VF sv = dv[v], mh = fzero();
          if constexpr (F.smpack) {
            const uint8_t* sm = reinterpret_cast<const uint8_t*>(B::sc(sup[v], bi, h, col[v]));
            sv = fmul(dv[v], fload_nibble<0>(sm));
            mh = fmul(mv[v], fload_nibble<4>(sm));
          } else {
            if constexpr (F.ks) sv = fmul(dv[v], fload(B::sc(sup[v], bi, h, col[v])));
            if constexpr (F.mink == 1) mh = fmul(mv[v], fload(B::mn(sup[v], bi, h, col[v])));
          }
          for (int r = 0; r < MR; ++r) {
            const int64_t i = i0 + r, xb = i * o.nb + b;
            VI isum = sum[r][v][h];
#if INFERD_ISA_LEVEL >= 3
            if constexpr (F.high == 2)
              if (h == NSUB - 1) isum = _mm512_srai_epi32(isum, 2);  // q6_codes' upper codes were 4 q
#endif
            if constexpr (OFF != 0) isum = vsub32(isum, vset1(OFF * B::xsum(o, i, b, h)));
            acc[r][v] = ffma(fcvt(isum), fmul(sv, fset1(o.dx[xb])), acc[r][v]);
            if constexpr (F.mink == 1)
              acc[r][v] = fnmadd(mh, fset1(NSUB == 1 ? o.xs[xb] : o.dx[xb] * static_cast<float>(B::xsum(o, i, b, h))),
                                 acc[r][v]);
          }
        }
        if constexpr (F.mink == 2)
          for (int r = 0; r < MR; ++r) acc[r][v] = ffma(mv[v], fset1(o.xs[(i0 + r) * o.nb + b]), acc[r][v]);
      }
    }
  }
  store_tile(o.y, o.N, i0, u0, acc);
}

#else

// generic: one row and one group of 16 columns; std::fma, so the floats are the vector variants' own
template <int T, int MR, int NV>
static void btile(const BlockOperands& o, int64_t i0, int64_t g0) {
  static_assert(MR == 1 && NV == 1, "generic tiles are 1 x 1");
  using B = Blocks<T>;
  constexpr auto F = B::F;
  constexpr int NSUB = B::NSUB, SB = B::SB;
  const int64_t p = g0 / 2, j = g0 % 2;
  float acc[GW] = {};
  for (int64_t s = 0; s < o.nb / SB; ++s) {
    const uint8_t* sup = B::super(o, p, s);
    for (int bi = 0; bi < SB; ++bi) {
      const int64_t b = s * SB + bi, xb = i0 * o.nb + b;
      const uint8_t* blk = B::block(sup, bi);
      const int8_t* xr = o.xq + i0 * o.K + b * 32;
      for (int l = 0; l < GW; ++l) {
        const int64_t c = j * GW + l;
        int32_t isum[2] = {0, 0};
        for (int k = 0; k < 32; ++k) {
          const int cc = k % 16 / 4, pp = k % 4, upper = k / 16;
          int q = F.base == 4 ? (blk[j * B::GB + 64 * cc + 4 * l + pp] >> (4 * upper)) & 15
                              : (blk[j * B::GB + 64 * (cc / 2) + 4 * l + pp] >> (4 * (cc % 2) + 2 * upper)) & 3;
          if constexpr (F.high == 2)
            q |= ((blk[2 * B::GB + 128 * j + 64 * (cc / 2) + 4 * l + pp] >> (4 * (1 - cc % 2) + 2 * upper)) & 3) << 4;
          for (int h = 0; h < (F.high == 2 ? 0 : F.high); ++h)
            q |= ((blk[2 * B::GB + 128 * h + 64 * j + 4 * l + pp] >> (cc + 4 * upper)) & 1) << (F.base + h);
          const int w = F.lut ? IQ4_VALUES[q] : q;
          isum[NSUB == 1 ? 0 : upper] += w * xr[k];
        }
        for (int h = 0; h < NSUB; ++h) {
          float sv = fload(B::d(sup, c));
          const uint8_t sm = F.smpack ? static_cast<uint8_t>(*B::sc(sup, bi, h, c)) : 0;  // Q2_K: scale | min << 4
          if constexpr (F.smpack) sv = sv * static_cast<float>(sm & 15);
          else if constexpr (F.ks) sv = sv * static_cast<float>(*B::sc(sup, bi, h, c));
          const int32_t is = isum[h] - F.off * B::xsum(o, i0, b, h);
          acc[l] = std::fma(static_cast<float>(is), sv * o.dx[xb], acc[l]);
          if constexpr (F.mink == 1) {
            const float mh = fload(B::dm(sup, c)) *
                             static_cast<float>(F.smpack ? sm >> 4 : static_cast<int>(*B::mn(sup, bi, h, c)));
            const float xsh = NSUB == 1 ? o.xs[xb] : o.dx[xb] * static_cast<float>(B::xsum(o, i0, b, h));
            acc[l] = std::fma(-mh, xsh, acc[l]);
          }
        }
        if constexpr (F.mink == 2) acc[l] = std::fma(fload(B::dm(sup, c)), o.xs[xb], acc[l]);
      }
    }
  }
  store_group(o.y, o.N, i0, g0, acc);
}

#endif

template <int T>
struct BTile {
  // one row: 4 units, not 8 (8 accumulators, 8 sums, scales and mins overflow the 32 registers)
  template <int MR>
  static constexpr int units() { return MR == 1 && INFERD_ISA_LEVEL >= 2 ? 4 : units_per_tile<MR>(); }
  template <int MR, int NV>
  static void run(const BlockOperands& o, int64_t i0, int64_t u) { btile<T, MR, NV>(o, i0, u); }
};

template <int T>
static void bgemm(const BlockOperands& o, int64_t M) { all_panels<BTile<T>>(o, M); }

static void blocks_gemm(int type, const uint8_t* w, const int8_t* xq, const float* dx, const float* xs,
                        const int32_t* xi, const int32_t* xi16, int64_t M, int64_t K, int64_t N, float* y) {
  const BlockOperands o{w, xq, dx, xs, xi, xi16, K, K / 32, N, y};
  switch (type) {
    case BT_Q4_K: return bgemm<BT_Q4_K>(o, M);
    case BT_Q5_K: return bgemm<BT_Q5_K>(o, M);
    case BT_Q6_K: return bgemm<BT_Q6_K>(o, M);
    case BT_Q3_K: return bgemm<BT_Q3_K>(o, M);
    case BT_Q2_K: return bgemm<BT_Q2_K>(o, M);
    case BT_Q5_0: return bgemm<BT_Q5_0>(o, M);
    case BT_Q5_1: return bgemm<BT_Q5_1>(o, M);
    case BT_IQ4_NL: return bgemm<BT_IQ4_NL>(o, M);
    case BT_IQ4_XS: return bgemm<BT_IQ4_XS>(o, M);
    default: return;
  }
}

// GGUF tensors straight from the file's bytes into the kernels' records, and GGUF rows dequantized.
//
// Why in C++: the Python route (quant.gguf_blocks.decode then pack; gguf_native.int4_blocks then
// w4a8.pack4) holds the layer as an [N, K] array of codes plus several permuted copies of it:
// gigabytes and tens of seconds for an 8B model's 128256 x 4096 output layer. Here a thread takes a
// pair of 32 output rows, reads their blocks from the file (a read-only mapping: never written) and
// writes the pair's records once; nothing the size of the layer exists but the output. The bytes
// equal the Python route's, which stays as the fallback (tests/test_repack.py holds them together).
//
// The parts of a fused layer (q, k, v) are stacked along the output rows in one call, and each part
// may be read in another row order (llama.cpp's q/k interleave undone, or tensor parallelism's
// share): the output's rows are a list of source rows, padded with zero rows to whole pairs.
//
// dequant_rows computes the `gguf` package's float32 products in its order ((d * sc) * q - dmin * mn,
// d * q + m, ...), so it equals gguf.quants.dequantize bit for bit; floating-point contraction is off
// for those loops because an fma would round once where gguf rounds twice.
//
// No ISA variants: this is memory-bound, and plain -O3 loops keep up with the memory.
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace inferd {
namespace {

// gguf.GGMLQuantizationType
enum GgmlType : int64_t {
  GT_F32 = 0, GT_F16 = 1, GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8, GT_Q2_K = 10,
  GT_Q3_K = 11, GT_Q4_K = 12, GT_Q5_K = 13, GT_Q6_K = 14, GT_IQ4_NL = 20, GT_IQ4_XS = 23, GT_BF16 = 30,
};

// The file's bytes and weights a block, per BlockType (one file block is one of the kernel's
// super-blocks: 256 weights with int8 sub-scales, else one 32-block).
constexpr int64_t kFileBlock[BT_COUNT] = {144, 176, 210, 110, 84, 22, 24, 18, 136};
constexpr int64_t kFileWeights[BT_COUNT] = {256, 256, 256, 256, 256, 32, 32, 32, 256};
constexpr int64_t kAhead = 512;  // bytes a row's prefetch runs ahead (past a row's end is harmless: a hint)
constexpr int8_t kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp16 -> fp32, exact. Subnormals through an integer times 2^-24 (exact, and safe under
// flush-to-zero, where a subnormal fp32 intermediate would not be); inf and NaN keep their payload
// unquieted, as numpy's conversion (gguf's) does. Branch-free so that the F16 loop vectorizes.
inline float f16(uint16_t h) {
  const int32_t em = h & 0x7fff;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t normal = (static_cast<uint32_t>(em) << 13) + 0x38000000u;  // exponent 15 -> 127 bias
  const uint32_t special = (static_cast<uint32_t>(em) << 13) | 0x7f800000u;
  const uint32_t sub = as_bits(static_cast<float>(em) * 0x1p-24f);
  const uint32_t bits = em >= 0x7c00 ? special : em < 0x400 ? sub : normal;
  return as_float(bits | sign);
}

// fp32 -> fp16 where the value is exactly one (w4a8's records hold fp16 only then, as
// w4a8.exactly_half decides); false for any other value, NaN included.
inline bool exact_f16(float f, uint16_t* out) {
  const uint32_t b = as_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000);
  const uint32_t e = (b >> 23) & 0xff, m = b & 0x7fffff;
  if (e == 0xff) {  // inf yes, NaN no (NaN != NaN: exactly_half says no)
    if (m) return false;
    *out = sign | 0x7c00;
    return true;
  }
  if (e == 0 && m == 0) {
    *out = sign;
    return true;
  }
  if (e == 0) return false;  // an fp32 subnormal is far below fp16's range
  const int32_t x = static_cast<int32_t>(e) - 127;
  if (x > 15) return false;
  if (x >= -14) {
    if (m & 0x1fff) return false;
    *out = sign | static_cast<uint16_t>(((x + 15) << 10) | (m >> 13));
    return true;
  }
  // an fp16 subnormal: (2^23 + m) * 2^(x - 23) in units of 2^-24 is (2^23 + m) >> -(x + 1)
  const int32_t shift = -(x + 1);
  if (shift > 23) return false;
  const uint32_t full = (1u << 23) | m;
  if (full & ((1u << shift) - 1)) return false;
  *out = sign | static_cast<uint16_t>(full >> shift);
  return true;
}

// 4 bits -> 4 bytes of 0 or 1 (bit p to byte p)
constexpr uint32_t spread(uint32_t n) { return (n & 1) | ((n >> 1) & 1) << 8 | ((n >> 2) & 1) << 16 | ((n >> 3) & 1) << 24; }
constexpr uint32_t kSpread[16] = {spread(0), spread(1), spread(2),  spread(3),  spread(4),  spread(5),  spread(6),  spread(7),
                                  spread(8), spread(9), spread(10), spread(11), spread(12), spread(13), spread(14), spread(15)};

// One row's super-block as the block kernel keeps it (quant.gguf_blocks.Codes, one row, one super-block).
struct Super {
  uint8_t q[256];  // the codes as the file stores them (the type's offset not taken off)
  uint16_t d, dm;  // fp16 bits: d; dmin (K-quants) or m (Q5_1)
  int8_t sc[16], mn[16];
};

template <int T>
inline void decode(const uint8_t* b, Super& s) {
  if constexpr (T == BT_Q4_K || T == BT_Q5_K) {
    s.d = u16(b), s.dm = u16(b + 2);
    const uint8_t* k = b + 4;  // eight 6-bit scales and mins in 12 bytes: the high 2 bits of 4..7 in 0..7's tops
    for (int j = 0; j < 4; ++j) {
      s.sc[j] = static_cast<int8_t>(k[j] & 63);
      s.mn[j] = static_cast<int8_t>(k[j + 4] & 63);
      s.sc[j + 4] = static_cast<int8_t>((k[j + 8] & 0xF) | ((k[j] >> 6) << 4));
      s.mn[j + 4] = static_cast<int8_t>((k[j + 8] >> 4) | ((k[j + 4] >> 6) << 4));
    }
    const uint8_t* qs = b + (T == BT_Q4_K ? 16 : 48);
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 32; ++i) {
        s.q[64 * g + i] = qs[32 * g + i] & 0xF;
        s.q[64 * g + 32 + i] = qs[32 * g + i] >> 4;
      }
    if constexpr (T == BT_Q5_K) {
      const uint8_t* qh = b + 16;  // bit j of byte i: the fifth bit of sub-block j's weight i
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i) s.q[32 * j + i] |= ((qh[i] >> j) & 1) << 4;
    }
  } else if constexpr (T == BT_Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(s.sc, b + 192, 16);
    s.d = u16(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 32; ++i)
          s.q[128 * h + 32 * t + i] = static_cast<uint8_t>(((ql[64 * h + 32 * (t & 1) + i] >> (4 * (t >> 1))) & 0xF) |
                                                           (((qh[32 * h + i] >> (2 * t)) & 3) << 4));
  } else if constexpr (T == BT_Q3_K || T == BT_Q2_K) {
    const uint8_t* qs = b + (T == BT_Q3_K ? 32 : 16);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 32; ++i) s.q[128 * h + 32 * t + i] = (qs[32 * h + i] >> (2 * t)) & 3;
    if constexpr (T == BT_Q2_K) {
      for (int j = 0; j < 16; ++j) {
        s.sc[j] = static_cast<int8_t>(b[j] & 0xF);
        s.mn[j] = static_cast<int8_t>(b[j] >> 4);
      }
      s.d = u16(b + 80), s.dm = u16(b + 82);
    } else {
      const uint8_t *hm = b, *k = b + 96;  // hmask bit j of byte i: the third bit of weight 32 j + i
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i) s.q[32 * j + i] |= ((hm[i] >> j) & 1) << 2;
      for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? k[j] & 0xF : k[j - 8] >> 4, hi = (k[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        s.sc[j] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      }
      s.d = u16(b + 108);
    }
  } else if constexpr (T == BT_Q5_0 || T == BT_Q5_1) {
    constexpr int head = T == BT_Q5_0 ? 2 : 4;
    s.d = u16(b);
    if constexpr (T == BT_Q5_1) s.dm = u16(b + 2);
    const uint32_t qh = u32(b + head);  // bit i: the fifth bit of weight i
    for (int c = 0; c < 4; ++c) {  // whole words: the packer reads them back as words
      const uint32_t w = u32(b + head + 4 + 4 * c);
      const uint32_t lo = (w & 0x0F0F0F0Fu) | (kSpread[(qh >> (4 * c)) & 15] << 4);
      const uint32_t hi = ((w >> 4) & 0x0F0F0F0Fu) | (kSpread[(qh >> (16 + 4 * c)) & 15] << 4);
      std::memcpy(s.q + 4 * c, &lo, 4);
      std::memcpy(s.q + 16 + 4 * c, &hi, 4);
    }
  } else if constexpr (T == BT_IQ4_NL) {
    s.d = u16(b);
    for (int i = 0; i < 16; ++i) s.q[i] = b[2 + i] & 0xF, s.q[16 + i] = b[2 + i] >> 4;
  } else if constexpr (T == BT_IQ4_XS) {
    s.d = u16(b);
    const uint16_t sh = u16(b + 2);
    for (int j = 0; j < 8; ++j) {
      const int lo = (b[4 + j / 2] >> (4 * (j & 1))) & 0xF, hi = (sh >> (2 * j)) & 3;
      s.sc[j] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      const uint8_t* qs = b + 8 + 16 * j;
      for (int i = 0; i < 16; ++i) s.q[32 * j + i] = qs[i] & 0xF, s.q[32 * j + 16 + i] = qs[i] >> 4;
    }
  }
}

// -- the block kernel's records (quant.gguf_blocks.pack) ----------------------------------------

// One pair of output rows (src: 32 row pointers, null for padding; the caller zeroed a padded
// pair) -> its S records. Each row writes its own columns: d at 2 r, sub-scales at 32 u + r, and per
// block its 4-byte words of low bits and bit planes at 4 l of group j's runs.
template <int T>
void pack_blocks_pair(const uint8_t* const* src, int64_t S, uint8_t* out) {
  constexpr BlockFormat F = kBlockFormats[T];
  constexpr int SB = static_cast<int>(block_super(F)), SUBS = SB * (32 / F.sub);
  constexpr int64_t HEADER = block_header(F), BLOCK = block_bytes(F), RECORD = block_record(F);
  constexpr int64_t PLANES = 2 * block_group_bytes(F), SC_AT = 64 + (F.mink ? 64 : 0), MN_AT = SC_AT + SUBS * 32;
  Super sup;
  for (int64_t s = 0; s < S; ++s) {
    uint8_t* rec = out + s * RECORD;
    for (int r = 0; r < 32; ++r) {
      if (!src[r]) continue;
      // 32 rows are 32 streams, more than the hardware prefetcher follows: ask for the bytes a
      // row needs kAhead on while these are packed
      for (int64_t off = 0; off < kFileBlock[T]; off += 64) __builtin_prefetch(src[r] + s * kFileBlock[T] + kAhead + off);
      decode<T>(src[r] + s * kFileBlock[T], sup);
      const int j = r / 16, l = r % 16;
      std::memcpy(rec + 2 * r, &sup.d, 2);
      if constexpr (F.mink) std::memcpy(rec + 64 + 2 * r, &sup.dm, 2);
      if constexpr (F.smpack) {
        for (int u = 0; u < SUBS; ++u) rec[SC_AT + 32 * u + r] = static_cast<uint8_t>(sup.sc[u] | (sup.mn[u] << 4));
      } else {
        if constexpr (F.ks)
          for (int u = 0; u < SUBS; ++u) rec[SC_AT + 32 * u + r] = static_cast<uint8_t>(sup.sc[u]);
        if constexpr (F.mink == 1)
          for (int u = 0; u < SUBS; ++u) rec[MN_AT + 32 * u + r] = static_cast<uint8_t>(sup.mn[u]);
      }
      // four codes a 32-bit word (byte p of word c: code 4 c + p), so each output word is a few
      // word operations: the nibbles or 2-bit fields side by side, a plane's bit c moved to bit c
      for (int bi = 0; bi < SB; ++bi) {
        uint32_t lo[4], hi[4];  // codes 4 c + p and 16 + 4 c + p
        for (int c = 0; c < 4; ++c) lo[c] = u32(sup.q + 32 * bi + 4 * c), hi[c] = u32(sup.q + 32 * bi + 16 + 4 * c);
        uint8_t* blk = rec + HEADER + bi * BLOCK;
        if constexpr (F.base == 4) {
          for (int c = 0; c < 4; ++c) {
            const uint32_t w = (lo[c] & 0x0F0F0F0Fu) | ((hi[c] & 0x0F0F0F0Fu) << 4);
            std::memcpy(blk + 256 * j + 64 * c + 4 * l, &w, 4);
          }
        } else {
          for (int v = 0; v < 2; ++v) {
            const uint32_t w = (lo[2 * v] & 0x03030303u) | ((hi[2 * v] & 0x03030303u) << 2) |
                               ((lo[2 * v + 1] & 0x03030303u) << 4) | ((hi[2 * v + 1] & 0x03030303u) << 6);
            std::memcpy(blk + 128 * j + 64 * v + 4 * l, &w, 4);
          }
        }
        if constexpr (F.high == 2) {  // Q6_K: 2-bit fields, chunks 2e and 2e + 1 in group j's vector e
          for (int e = 0; e < 2; ++e) {
            const auto top = [](uint32_t w) { return (w >> 4) & 0x03030303u; };
            const uint32_t w = top(lo[2 * e]) << 4 | top(hi[2 * e]) << 6 | top(lo[2 * e + 1]) | top(hi[2 * e + 1]) << 2;
            std::memcpy(blk + PLANES + 128 * j + 64 * e + 4 * l, &w, 4);
          }
        }
        for (int h = 0; h < (F.high == 2 ? 0 : F.high); ++h) {  // a code and its partner 16 on as one 64-bit lane pair
          const int bit = F.base + h;
          uint64_t t = 0;
          for (int c = 0; c < 4; ++c) t |= (((lo[c] | static_cast<uint64_t>(hi[c]) << 32) >> bit) & 0x0101010101010101ull) << c;
          const uint32_t w = static_cast<uint32_t>(t) | static_cast<uint32_t>(t >> 32) << 4;
          std::memcpy(blk + PLANES + 128 * h + 64 * j + 4 * l, &w, 4);
        }
      }
    }
  }
}

// -- W4A8 / W8A8 records (quant.w4a8.pack4 / pack8) --------------------------------------------------

// Store a pair's scale (or min) for column r in a cell: fp16 when `half` and exactly an fp16
// value, else fp32; false where fp16 was asked for and the value is not one.
inline bool put_float(uint8_t* at, int r, float v, bool half) {
  if (!half) {
    std::memcpy(at + 4 * r, &v, 4);
    return true;
  }
  uint16_t h;
  if (!exact_f16(v, &h)) return false;
  std::memcpy(at + 2 * r, &h, 2);
  return true;
}

// One pair's W4A8 cells (512 bytes of codes, then 32 scales, then 32 mins per 32-block) from Q4_0,
// Q4_1 or Q4_K rows: q, scale and min as gguf_native.int4_blocks gives them. False where `half` and
// some scale or min is not an fp16 value (the caller then packs every pair in fp32).
template <int64_t G>
bool pack_w4a8_pair(const uint8_t* const* src, int64_t nb, bool half, uint8_t* out) {
  constexpr int64_t PER32 = G == GT_Q4_1 ? 20 : 18;  // the file's bytes a 32-block (Q4_K: 144 / 8)
  const int64_t cell = half ? 640 : 768, fb = half ? 64 : 128;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* c = out + b * cell;
    for (int r = 0; r < 32; ++r) {
      if (!src[r]) continue;
      __builtin_prefetch(src[r] + b * PER32 + kAhead);  // 32 streams: see pack_blocks_pair
      const int j = r / 16, l = r % 16;
      uint8_t lb[16];  // byte x: q[x] | q[16 + x] << 4
      float sv, mv;
      if constexpr (G == GT_Q4_K) {
        const uint8_t* blk = src[r] + (b / 8) * 144;
        const int bi = static_cast<int>(b % 8), g = bi / 2, sh = 4 * (bi & 1);
        const uint8_t* k = blk + 4;
        const int sc = bi < 4 ? k[bi] & 63 : (k[bi + 4] & 0xF) | ((k[bi - 4] >> 6) << 4);
        const int mn = bi < 4 ? k[bi + 4] & 63 : (k[bi + 4] >> 4) | ((k[bi] >> 6) << 4);
        const uint8_t* qs = blk + 16 + 32 * g;
        for (int x = 0; x < 16; ++x) lb[x] = static_cast<uint8_t>(((qs[x] >> sh) & 0xF) | (((qs[16 + x] >> sh) & 0xF) << 4));
        sv = f16(u16(blk)) * static_cast<float>(sc);
        mv = -(f16(u16(blk + 2)) * static_cast<float>(mn));
      } else {
        const uint8_t* blk = src[r] + b * PER32;
        const float d = f16(u16(blk));
        std::memcpy(lb, blk + (G == GT_Q4_0 ? 2 : 4), 16);  // the file's nibbles are already q[x] | q[16 + x] << 4
        sv = d;
        mv = G == GT_Q4_0 ? -8.f * d : f16(u16(blk + 2));
      }
      for (int ch = 0; ch < 4; ++ch) std::memcpy(c + 256 * j + 64 * ch + 4 * l, lb + 4 * ch, 4);
      if (!put_float(c + 512, r, sv, half) || !put_float(c + 512 + fb, r, mv, half)) return false;
    }
  }
  return true;
}

// One pair's W8A8 cells (1024 bytes of codes, then 32 scales) from Q8_0 rows.
bool pack_w8a8_pair(const uint8_t* const* src, int64_t nb, bool half, uint8_t* out) {
  const int64_t cell = half ? 1088 : 1152;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* c = out + b * cell;
    for (int r = 0; r < 32; ++r) {
      if (!src[r]) continue;
      __builtin_prefetch(src[r] + b * 34 + kAhead);
      const int j = r / 16, l = r % 16;
      const uint8_t* blk = src[r] + b * 34;
      for (int ch = 0; ch < 8; ++ch) std::memcpy(c + 512 * j + 64 * ch + 4 * l, blk + 2 + 4 * ch, 4);
      if (!put_float(c + 1024, r, f16(u16(blk)), half)) return false;
    }
  }
  return true;
}

// -- dequantization (gguf.quants.dequantize's products, in its order) -------------------------------

template <int T>
void dequant_blocks_row(const uint8_t* row, int64_t nblk, float* out) {
  constexpr BlockFormat F = kBlockFormats[T];
  constexpr int W = static_cast<int>(kFileWeights[T]), SUB = F.sub, NS = W / SUB;
  Super sup;
  for (int64_t i = 0; i < nblk; ++i) {
    decode<T>(row + i * kFileBlock[T], sup);
    const float d = f16(sup.d), dm = F.mink ? f16(sup.dm) : 0.f;
    for (int u = 0; u < NS; ++u) {
      const float s = F.ks ? d * static_cast<float>(sup.sc[u]) : d;
      const float m = F.mink == 1 ? dm * static_cast<float>(sup.mn[u]) : dm;
      const uint8_t* q = sup.q + SUB * u;
      float* o = out + i * W + SUB * u;
      float v[SUB];
      for (int k = 0; k < SUB; ++k)
        v[k] = F.lut ? static_cast<float>(kIq4[q[k]]) : static_cast<float>(static_cast<int>(q[k]) - F.off);
      if constexpr (F.mink == 1) {
        for (int k = 0; k < SUB; ++k) o[k] = s * v[k] - m;
      } else if constexpr (F.mink == 2) {
        for (int k = 0; k < SUB; ++k) o[k] = s * v[k] + m;
      } else {
        for (int k = 0; k < SUB; ++k) o[k] = s * v[k];
      }
    }
  }
}

// Q4_0, Q4_1, Q8_0: d * (q - 8), d * q + m, q * d per 32-block
template <int64_t G>
void dequant_simple_row(const uint8_t* row, int64_t nblk, float* out) {
  constexpr int64_t B = G == GT_Q4_0 ? 18 : G == GT_Q4_1 ? 20 : 34;
  for (int64_t i = 0; i < nblk; ++i) {
    const uint8_t* b = row + i * B;
    const float d = f16(u16(b));
    float* o = out + 32 * i;
    if constexpr (G == GT_Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int k = 0; k < 32; ++k) o[k] = static_cast<float>(q[k]) * d;
    } else {
      const uint8_t* qs = b + (G == GT_Q4_0 ? 2 : 4);
      float v[32];
      for (int k = 0; k < 16; ++k) {
        v[k] = static_cast<float>((qs[k] & 0xF) - (G == GT_Q4_0 ? 8 : 0));
        v[16 + k] = static_cast<float>((qs[k] >> 4) - (G == GT_Q4_0 ? 8 : 0));
      }
      if constexpr (G == GT_Q4_0) {
        for (int k = 0; k < 32; ++k) o[k] = d * v[k];
      } else {
        const float m = f16(u16(b + 2));
        for (int k = 0; k < 32; ++k) o[k] = d * v[k] + m;
      }
    }
  }
}

void dequant_f16_row(const uint8_t* row, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = f16(u16(row + 2 * k));
}

void dequant_bf16_row(const uint8_t* row, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = as_float(static_cast<uint32_t>(u16(row + 2 * k)) << 16);
}

void dequant_f32_row(const uint8_t* row, int64_t n, float* out) { std::memcpy(out, row, 4 * n); }

struct RowType {
  const char* name;
  int64_t weights, bytes;  // a block
  void (*row)(const uint8_t*, int64_t, float*);  // a row of `blocks` blocks (for F32/F16/BF16: of weights)
};

bool row_type(int64_t g, RowType* t) {
  switch (g) {
    case GT_F32: *t = {"F32", 1, 4, dequant_f32_row}; return true;
    case GT_F16: *t = {"F16", 1, 2, dequant_f16_row}; return true;
    case GT_BF16: *t = {"BF16", 1, 2, dequant_bf16_row}; return true;
    case GT_Q4_0: *t = {"Q4_0", 32, 18, dequant_simple_row<GT_Q4_0>}; return true;
    case GT_Q4_1: *t = {"Q4_1", 32, 20, dequant_simple_row<GT_Q4_1>}; return true;
    case GT_Q8_0: *t = {"Q8_0", 32, 34, dequant_simple_row<GT_Q8_0>}; return true;
    case GT_Q5_0: *t = {"Q5_0", 32, 22, dequant_blocks_row<BT_Q5_0>}; return true;
    case GT_Q5_1: *t = {"Q5_1", 32, 24, dequant_blocks_row<BT_Q5_1>}; return true;
    case GT_Q2_K: *t = {"Q2_K", 256, 84, dequant_blocks_row<BT_Q2_K>}; return true;
    case GT_Q3_K: *t = {"Q3_K", 256, 110, dequant_blocks_row<BT_Q3_K>}; return true;
    case GT_Q4_K: *t = {"Q4_K", 256, 144, dequant_blocks_row<BT_Q4_K>}; return true;
    case GT_Q5_K: *t = {"Q5_K", 256, 176, dequant_blocks_row<BT_Q5_K>}; return true;
    case GT_Q6_K: *t = {"Q6_K", 256, 210, dequant_blocks_row<BT_Q6_K>}; return true;
    case GT_IQ4_NL: *t = {"IQ4_NL", 32, 18, dequant_blocks_row<BT_IQ4_NL>}; return true;
    case GT_IQ4_XS: *t = {"IQ4_XS", 256, 136, dequant_blocks_row<BT_IQ4_XS>}; return true;
    default: return false;
  }
}

}  // namespace
}  // namespace inferd

// The torch-facing ops below (checks, threads) need no float care; keeping them outside the
// region above keeps torch's inline functions and ours under the same options.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

namespace inferd {
namespace {

template <class Fn>
void by_block_type(int64_t t, Fn&& fn) {
  switch (t) {
    case BT_Q4_K: return fn(std::integral_constant<int, BT_Q4_K>{});
    case BT_Q5_K: return fn(std::integral_constant<int, BT_Q5_K>{});
    case BT_Q6_K: return fn(std::integral_constant<int, BT_Q6_K>{});
    case BT_Q3_K: return fn(std::integral_constant<int, BT_Q3_K>{});
    case BT_Q2_K: return fn(std::integral_constant<int, BT_Q2_K>{});
    case BT_Q5_0: return fn(std::integral_constant<int, BT_Q5_0>{});
    case BT_Q5_1: return fn(std::integral_constant<int, BT_Q5_1>{});
    case BT_IQ4_NL: return fn(std::integral_constant<int, BT_IQ4_NL>{});
    case BT_IQ4_XS: return fn(std::integral_constant<int, BT_IQ4_XS>{});
    default: TORCH_CHECK(false, "unknown GGUF block type ", t);
  }
}

// An output a layer's size, its pages faulted in up front by the threads together
// (MADV_POPULATE_WRITE, Linux 5.14: one call a range, about twice as fast as a fault a page; where
// it is refused the packing's writes fault them in as before). Not on transparent huge pages any
// more: where a VM hands free memory back to its host (free page reporting works in 2 MiB blocks),
// faulting huge pages in ran at ~0.1 GB/s on the 2-core Zen 4 VM (8 s for 0.8 GB: most of the 1B
// model's 4 s load) against ~2 GB/s for 4 KiB pages, and the kernels read records no faster from
// huge pages (the 1B Q6_K lm_head: 18.6 vs 18.7 ms a call on one thread; that was before the tiles'
// prefetch ran). INFERD_HUGEPAGES=1 asks for them again, to measure: with the prefetch, 1B decode
// 32.8 vs 31.2 tok/s (medians of 3 fresh processes) for a load of 2.1 s instead of 1.0-1.6; 3B no
// clear gain in the noise, a load of 4 s instead of 1.6.
at::Tensor big_empty(at::IntArrayRef shape, at::ScalarType dtype) {
  constexpr int64_t kPage = 4096, kSpan = int64_t{4} << 20;
  int64_t bytes = static_cast<int64_t>(at::elementSize(dtype));
  for (int64_t s : shape) bytes *= s;
  if (bytes < 2 * kSpan) return at::empty(shape, dtype);
  void* p = nullptr;
  const char* hp = std::getenv("INFERD_HUGEPAGES");
  const bool huge = hp != nullptr && hp[0] == '1';
  TORCH_CHECK(posix_memalign(&p, huge ? kSpan : kPage, static_cast<size_t>(bytes)) == 0, "out of memory allocating ",
              bytes, " bytes");
#if defined(__linux__)
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, absent from older headers
  char* base = static_cast<char*>(p);
  const int64_t whole = bytes / kPage * kPage;
  if (huge) madvise(base, static_cast<size_t>(whole), MADV_HUGEPAGE);
  at::parallel_for(0, (whole + kSpan - 1) / kSpan, 1, [&](int64_t a, int64_t b) {
    const int64_t from = a * kSpan, to = std::min(whole, b * kSpan);
    madvise(base + from, static_cast<size_t>(to - from), kPopulateWrite);  // a hint: refused is fine
  });
#endif
  return at::from_blob(p, shape, [](void* q) { std::free(q); }, at::TensorOptions().dtype(dtype));
}

// -- the parts' rows ------------------------------------------------------------------------------

// Every output row's bytes: part i's rows (in rows[i]'s order where given), parts one after another.
struct Source {
  std::vector<const uint8_t*> row;
  int64_t row_bytes = 0;
};

void check_raw(const at::Tensor& p, const char* op) {
  TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.dim() == 2, op,
              ": each part must be a CPU uint8 tensor [rows, row bytes] (the GGUF tensor's raw bytes)");
  TORCH_CHECK(p.size(1) <= 1 || p.stride(1) == 1, op, ": a part's rows must be contiguous bytes (stride(1) == 1)");
}

Source gather(at::TensorList parts, const c10::List<std::optional<at::Tensor>>& rows, const char* op) {
  TORCH_CHECK(!parts.empty(), op, ": no parts");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == static_cast<int64_t>(parts.size()), op,
              ": rows must give one entry (a tensor or None) per part");
  Source s;
  s.row_bytes = parts[0].dim() == 2 ? parts[0].size(1) : 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    check_raw(p, op);
    TORCH_CHECK(p.size(1) == s.row_bytes, op, ": the parts disagree on their row bytes (", p.size(1), " vs ",
                s.row_bytes, ")");
    const uint8_t* base = p.data_ptr<uint8_t>();
    const int64_t n = p.size(0), stride = p.stride(0);
    const std::optional<at::Tensor> r = rows.get(i);
    if (!r.has_value()) {
      for (int64_t k = 0; k < n; ++k) s.row.push_back(base + k * stride);
      continue;
    }
    TORCH_CHECK(r->scalar_type() == at::kLong && r->dim() == 1 && r->device().is_cpu(), op,
                ": rows[", i, "] must be a CPU int64 tensor [rows]");
    const at::Tensor rc = r->contiguous();
    const int64_t* ix = rc.data_ptr<int64_t>();
    for (int64_t k = 0; k < rc.numel(); ++k) {
      TORCH_CHECK(ix[k] >= 0 && ix[k] < n, op, ": rows[", i, "] names row ", ix[k], " of a part with ", n, " rows");
      s.row.push_back(base + ix[k] * stride);
    }
  }
  return s;
}

// The weights a row holds, from its bytes and the type's block (a clear error where they disagree).
int64_t row_weights(int64_t row_bytes, int64_t block_bytes, int64_t block_weights, const char* type, const char* op) {
  TORCH_CHECK(row_bytes > 0 && row_bytes % block_bytes == 0, op, ": ", row_bytes, " bytes a row is not whole ", type,
              " blocks of ", block_bytes, " bytes");
  return row_bytes / block_bytes * block_weights;
}

const char* kBlockNames[BT_COUNT] = {"Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"};

// parts (uint8 [N_i, row bytes] of one BlockType) -> quant.gguf_blocks.pack(decode(...)) of the
// stacked, reordered rows: uint8 [ceil(N / 32), K / (32 * super) * record]
at::Tensor repack_blocks(at::TensorList parts, const c10::List<std::optional<at::Tensor>>& rows, int64_t type) {
  TORCH_CHECK(type >= 0 && type < BT_COUNT, "repack_blocks: unknown GGUF block type ", type);
  const Source src = gather(parts, rows, "repack_blocks");
  const BlockFormat& f = kBlockFormats[type];
  const int64_t K = row_weights(src.row_bytes, kFileBlock[type], kFileWeights[type], kBlockNames[type], "repack_blocks");
  const int64_t N = static_cast<int64_t>(src.row.size()), P = (N + 31) / 32, S = K / (32 * block_super(f));
  const int64_t pair_bytes = S * block_record(f);
  at::Tensor out = big_empty({P, pair_bytes}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  by_block_type(type, [&](auto t) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* rs[32];
        for (int r = 0; r < 32; ++r) rs[r] = 32 * p + r < N ? src.row[32 * p + r] : nullptr;
        if (32 * p + 32 > N) std::memset(o + p * pair_bytes, 0, pair_bytes);  // zero rows pad the pair
        pack_blocks_pair<decltype(t)::value>(rs, S, o + p * pair_bytes);
      }
    });
  });
  return out;
}

// Pack every pair with fp16 scales; where some value is not one, again with fp32 (the layout
// w4a8.pack4 / pack8 choose with half=None). Most pairs of a tensor that fails stop at once.
template <class PackPair>
at::Tensor pack_cells(const Source& src, int64_t nb, int64_t half_cell, int64_t full_cell, PackPair pack) {
  const int64_t N = static_cast<int64_t>(src.row.size()), P = (N + 31) / 32;
  auto run = [&](bool half) {
    const int64_t pair_bytes = nb * (half ? half_cell : full_cell);
    at::Tensor out = big_empty({P, pair_bytes}, at::kByte);
    uint8_t* o = out.data_ptr<uint8_t>();
    std::atomic<bool> failed{false};
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1 && !failed.load(std::memory_order_relaxed); ++p) {
        const uint8_t* rs[32];
        for (int r = 0; r < 32; ++r) rs[r] = 32 * p + r < N ? src.row[32 * p + r] : nullptr;
        if (32 * p + 32 > N) std::memset(o + p * pair_bytes, 0, pair_bytes);
        if (!pack(rs, nb, half, o + p * pair_bytes)) failed.store(true, std::memory_order_relaxed);
      }
    });
    return failed.load() ? at::Tensor() : out;
  };
  at::Tensor out = run(true);
  return out.defined() ? out : run(false);
}

// parts of Q4_0, Q4_1 or Q4_K -> w4a8.pack4(*gguf_native.int4_blocks(...)) of the stacked rows: fp16
// scales and mins ([P, nb * 640]) where all are fp16 values (always for Q4_1; for Q4_0 unless some
// |d| > 8188, where -8 d leaves fp16; Q4_K's d * sc rarely are), else fp32 ([P, nb * 768]).
at::Tensor repack_w4a8(at::TensorList parts, const c10::List<std::optional<at::Tensor>>& rows, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == GT_Q4_0 || ggml_type == GT_Q4_1 || ggml_type == GT_Q4_K,
              "repack_w4a8: GGUF type ", ggml_type, " is not Q4_0, Q4_1 or Q4_K");
  const Source src = gather(parts, rows, "repack_w4a8");
  const int64_t bytes = ggml_type == GT_Q4_0 ? 18 : ggml_type == GT_Q4_1 ? 20 : 144;
  const int64_t K = row_weights(src.row_bytes, bytes, ggml_type == GT_Q4_K ? 256 : 32,
                                ggml_type == GT_Q4_0 ? "Q4_0" : ggml_type == GT_Q4_1 ? "Q4_1" : "Q4_K", "repack_w4a8");
  if (ggml_type == GT_Q4_0) return pack_cells(src, K / 32, 640, 768, pack_w4a8_pair<GT_Q4_0>);
  if (ggml_type == GT_Q4_1) return pack_cells(src, K / 32, 640, 768, pack_w4a8_pair<GT_Q4_1>);
  return pack_cells(src, K / 32, 640, 768, pack_w4a8_pair<GT_Q4_K>);
}

// parts of Q8_0 -> w4a8.pack8(*gguf_native.q8_blocks(...)) of the stacked rows (fp16 scales unless one is NaN)
at::Tensor repack_w8a8(at::TensorList parts, const c10::List<std::optional<at::Tensor>>& rows) {
  const Source src = gather(parts, rows, "repack_w8a8");
  const int64_t K = row_weights(src.row_bytes, 34, 32, "Q8_0", "repack_w8a8");
  return pack_cells(src, K / 32, 1088, 1152, pack_w8a8_pair);
}

// raw uint8 [N, row bytes] of a GGUF tensor of `ggml_type`, ids int64 (any shape) -> float32
// [*ids.shape, K]: those rows as gguf.quants.dequantize gives them. Serves a step's embedding rows
// (a handful: inline on the calling thread) and whole tensors (ids = arange(N): threaded by rows).
at::Tensor dequant_rows(at::Tensor raw, at::Tensor ids, int64_t ggml_type) {
  RowType t;
  TORCH_CHECK(row_type(ggml_type, &t), "dequant_rows: GGUF type ", ggml_type, " is not one inferd dequantizes");
  check_raw(raw, "dequant_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(), "dequant_rows: ids must be a CPU int64 tensor");
  const int64_t K = row_weights(raw.size(1), t.bytes, t.weights, t.name, "dequant_rows");
  const at::Tensor ix = ids.contiguous();
  const int64_t n = ix.numel(), N = raw.size(0), stride = raw.stride(0), blocks = raw.size(1) / t.bytes;
  const int64_t* id = ix.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "dequant_rows: id ", id[i], " of a tensor with ", N, " rows");
  std::vector<int64_t> shape(ix.sizes().begin(), ix.sizes().end());
  shape.push_back(K);
  at::Tensor out = big_empty(shape, at::kFloat);
  const uint8_t* base = raw.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  // a thread's share at least 256K weights (1 MB out, ~0.1 ms): a decode step's rows (64 at K = 4096)
  // stay on the calling thread, where waking the pool would cost more than it saves (and, on a
  // loaded machine, milliseconds waiting for a core)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / K);
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) t.row(base + id[i] * stride, blocks, o + i * K);
  });
  return out;
}

}  // namespace
}  // namespace inferd

TORCH_LIBRARY_FRAGMENT(inferd, m) {
  using namespace inferd;
  m.def("repack_blocks(Tensor[] parts, Tensor?[] rows, int type) -> Tensor", &repack_blocks);
  m.def("repack_w4a8(Tensor[] parts, Tensor?[] rows, int ggml_type) -> Tensor", &repack_w4a8);
  m.def("repack_w8a8(Tensor[] parts, Tensor?[] rows) -> Tensor", &repack_w8a8);
  m.def("dequant_rows(Tensor raw, Tensor ids, int ggml_type) -> Tensor", &dequant_rows);
}

// The kernel table: every hot CPU kernel of inferd on raw pointers, compiled once per ISA variant
// (variant_*.cpp) and chosen at run time from CPUID (dispatch.cpp). The torch-facing wrappers
// (ops.cpp) check shapes and dtypes, then call through active().
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <string>
#include <vector>

namespace inferd {

using bf16 = c10::BFloat16;

// GGUF's block types beyond Q4_0/Q4_1/Q8_0, each kept in its own bits (gguf_blocks_impl.h), in the
// order inferd.quant.gguf_blocks numbers them. A weight w = s * (q - off) [- m] with q the code
// (`base` = 4 or 2 low bits + `high` bit planes, or an index into IQ4's table), s per `sub` weights:
// d * sc with an int8 sub-scale sc and an fp16 d per 256-weight super-block (`ks`), else an fp16 d
// per 32-block; mins: none (0), dmin * mn per sub (1: K-quants), an fp16 m per 32-block (2: Q5_1).
// `smpack`: sc and mn are 4-bit (Q2_K) and share a byte, sc in the low nibble.
struct BlockFormat {
  int high, sub;
  bool ks;
  int mink, off;
  bool lut;
  int base;
  bool smpack;
};
enum BlockType { BT_Q4_K, BT_Q5_K, BT_Q6_K, BT_Q3_K, BT_Q2_K, BT_Q5_0, BT_Q5_1, BT_IQ4_NL, BT_IQ4_XS, BT_COUNT };
constexpr BlockFormat kBlockFormats[BT_COUNT] = {
    {0, 32, true, 1, 0, false, 4, false},   // Q4_K
    {1, 32, true, 1, 0, false, 4, false},   // Q5_K
    {2, 16, true, 0, 32, false, 4, false},  // Q6_K
    {1, 16, true, 0, 4, false, 2, false},   // Q3_K: 2 low bits and one plane
    {0, 16, true, 1, 0, false, 2, true},    // Q2_K
    {1, 32, false, 0, 16, false, 4, false}, // Q5_0
    {1, 32, false, 2, 0, false, 4, false},  // Q5_1
    {0, 32, false, 0, 0, true, 4, false},   // IQ4_NL
    {0, 32, true, 0, 0, true, 4, false},    // IQ4_XS
};
// Per pair of 16-column groups and super-block (8 blocks of 32 with `ks`, else one): a header (d
// [32] fp16, then dmin or m [32] fp16 when mink, then sc [blocks][32 / sub][32] int8 when ks, then
// mn likewise when mink == 1 unless smpack), then per block both groups' 64 x base bytes of low
// bits, then each bit plane's 64 bytes per group.
constexpr int64_t block_super(const BlockFormat& f) { return f.ks ? 8 : 1; }
constexpr int64_t block_group_bytes(const BlockFormat& f) { return 64 * f.base; }
constexpr int64_t block_bytes(const BlockFormat& f) { return 2 * block_group_bytes(f) + 128 * f.high; }
constexpr int64_t block_header(const BlockFormat& f) {
  const int64_t subs = block_super(f) * (32 / f.sub) * 32;
  return 64 + (f.mink ? 64 : 0) + (f.ks ? subs : 0) + (f.mink == 1 && !f.smpack ? subs : 0);
}
constexpr int64_t block_record(const BlockFormat& f) { return block_header(f) + block_super(f) * block_bytes(f); }

// An int8 KV cache row (flash_attention_impl.h): head_dim codes, then an fp16 scale per KV_GROUP values.
constexpr int64_t KV_GROUP = 32;
constexpr int64_t int8_row(int64_t D) { return D + 2 * ((D + KV_GROUP - 1) / KV_GROUP); }

struct Kernels {
  const char* name;
  // x += d (when d is not null, rounded to x's type), then out = rms_norm(x) * w with torch's roundings
  void (*norm_f32)(float* x, const float* d, float* out, const float* w, int64_t rows, int64_t n, float eps);
  void (*norm_bf16)(bf16* x, const bf16* d, bf16* out, const bf16* w, int64_t rows, int64_t n, float eps);
  // rotate the first `heads` heads of each row in place; cos/sin [T, D] float32
  void (*rope_f32)(float* x, int64_t T, int64_t heads, int64_t row_stride, int64_t D, const float* cos,
                   const float* sin);
  void (*rope_bf16)(bf16* x, int64_t T, int64_t heads, int64_t row_stride, int64_t D, const float* cos,
                    const float* sin);
  // gu [rows, 2F] (gate | up) -> silu(gate) * up [rows, F]
  void (*silu_mul_f32)(const float* gu, float* out, int64_t rows, int64_t F);
  void (*silu_mul_bf16)(const bf16* gu, bf16* out, int64_t rows, int64_t F);
  // paged decode attention: q [B, H, D] float32, caches [slots, Hkv, D], block tables [B, max_blocks]
  void (*decode_f32)(const float* q, const float* k, const float* v, const int64_t* bt, const int64_t* ctx,
                     float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs,
                     float scale, int64_t window);
  void (*decode_bf16)(const float* q, const bf16* k, const bf16* v, const int64_t* bt, const int64_t* ctx,
                      float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t bs,
                      float scale, int64_t window);
  // x [M, K] -> int8 per 32-block: xq, the block scales dx [M, K/32], xs = dx * sum(xq), xi = sum(xq)
  void (*quantize_rows)(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int32_t* xi);
  // y [M, N] = rounded x times int4 codes packed with their scales and mins (w4a8_impl.h), w = q s + m;
  // half: the records hold fp16 scales and mins
  void (*w4a8_gemm)(const uint8_t* w, bool half, const int8_t* xq, const float* dx, const float* xs, const int32_t* xi,
                    int64_t M, int64_t K, int64_t N, float* y);
  // y [M, N] = rounded x times int8 codes packed likewise, one scale per (column, 32-block)
  void (*w8a8_gemm)(const uint8_t* w, bool half, const int8_t* xq, const float* dx, const float* xs, const int32_t* xi,
                    int64_t M, int64_t K, int64_t N, float* y);
  // y [M, N] = rounded x times a GGUF block type's records (BlockType; xi16: sum(xq) per 16, for the
  // types with 16-weight scales)
  void (*blocks_gemm)(int type, const uint8_t* w, const int8_t* xq, const float* dx, const float* xs,
                      const int32_t* xi, const int32_t* xi16, int64_t M, int64_t K, int64_t N, float* y);
  // y [M, N] = x [M, K] (float32) times w [N, K]^T kept as fp16 (or bf16) bits, in fp32 (half_gemm_impl.h)
  void (*half_gemm)(const uint16_t* w, bool bf16, const float* x, int64_t M, int64_t K, int64_t N, float* y);
  // y [T, N] += each row's LoRA delta (its slot's A then B, per part of the layer; lora_impl.h)
  void (*lora_bgmv)(const float* x, int64_t T, int64_t K, const float* a, const float* b, const int64_t* slots,
                    const int64_t* ranks, int64_t S, int64_t parts, const int64_t* part_n, int64_t R, float* y,
                    int64_t N);
  // attention over the paged cache read in place, at any length (flash_attention_impl.h). `cache`: 0
  // float32, 1 bf16, 2 int8 rows (head_dim codes, then an fp16 scale per 32: int8_row). prefill_attention:
  // sequence s's queries at rows qrows[s].. of q (rows q_stride floats apart) at positions starts[s]..,
  // lens[s] of them, tiled over KV blocks with an online softmax; returns the tiles it computed.
  // split_decode: one query a sequence, its keys cut into splits merged per head; returns the splits.
  // softcap 0: none.
  int64_t (*prefill_attention)(int cache, const float* q, int64_t q_stride, const void* k, const void* v,
                               const int64_t* bt, const int64_t* starts, const int64_t* lens, const int64_t* qrows,
                               float* out, int64_t S, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks,
                               int64_t bs, float scale, int64_t window, float softcap);
  int64_t (*split_decode)(int cache, const float* q, const void* k, const void* v, const int64_t* bt,
                          const int64_t* ctx, float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t max_blocks, int64_t bs, float scale, int64_t window, float softcap);
  // new K/V rows [T, Hkv, D] (float32, or bf16 when src_bf16; rows *_stride elements apart) -> int8
  // cache rows at their slots
  void (*quantize_kv)(bool src_bf16, const void* k, int64_t k_stride, const void* v, int64_t v_stride,
                      const int64_t* slots, int64_t T, int64_t Hkv, int64_t D, int8_t* kc, int8_t* vc);
  // attention within each of S sequences laid end to end (rows starts[s]..starts[s+1]), no cache:
  // q [T, H, D], k and v [T, Hkv, D] row-strided, out [T, H * D] row-strided; causal or bidirectional
  void (*varlen_f32)(const float* q, const float* k, const float* v, int64_t qs, int64_t ks, int64_t vs,
                     const int64_t* starts, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, bool causal,
                     float* out, int64_t os);
  void (*varlen_bf16)(const bf16* q, const bf16* k, const bf16* v, int64_t qs, int64_t ks, int64_t vs,
                      const int64_t* starts, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, bool causal,
                      bf16* out, int64_t os);
};

// One per variant; null where the variant was not built (a non-x86 machine).
const Kernels* kernels_generic();
const Kernels* kernels_avx2();
const Kernels* kernels_avx512();
const Kernels* kernels_avx512_vnni();
const Kernels* kernels_avx512_amx();

const Kernels& active();
// Select a variant by name ("auto" = the best this CPU runs); throws a one-line error naming what
// the CPU lacks rather than letting an instruction fault later.
std::string select_isa(const std::string& name);
std::vector<std::string> cpu_features();   // the ones the variants need, as this CPU reports them
std::vector<std::string> runnable_isas();  // lowest first

}  // namespace inferd

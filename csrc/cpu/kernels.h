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

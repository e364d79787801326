// The body of one ISA variant: each variant_*.cpp sets INFERD_VARIANT (its namespace) and
// INFERD_ISA_LEVEL, switches the compiler's target for the code below, and includes this file.
// Every header is included before the target switch (see variant_prelude.h), so inline functions
// of torch and the standard library keep the baseline ISA: a weak copy of one compiled for AVX-512
// could otherwise be the one the linker keeps, and fault on an AVX2 machine.
#ifndef INFERD_VARIANT
#error "include from a variant_*.cpp"
#endif

namespace inferd {
namespace INFERD_VARIANT {

#include "simd.h"
#include "softmax_impl.h"
#include "elementwise_impl.h"
#include "paged_attention_impl.h"
#include "w4a8_impl.h"
#include "gguf_blocks_impl.h"
#include "half_gemm_impl.h"
#include "lora_impl.h"
#include "flash_attention_impl.h"
#include "varlen_attention_impl.h"

#define INFERD_STR2(x) #x
#define INFERD_STR(x) INFERD_STR2(x)

static const Kernels table = {
    INFERD_STR(INFERD_VARIANT),
    norm_rows<float>, norm_rows<bf16>,
    rope_rows<float>, rope_rows<bf16>,
    silu_mul_rows<float>, silu_mul_rows<bf16>,
    decode_attention<float>, decode_attention<bf16>,
    quantize_rows, w4a8_gemm, w8a8_gemm, blocks_gemm, half_gemm, lora_bgmv,
    prefill_attention_any, split_decode_any, quantize_kv_any,
    varlen_attention<float>, varlen_attention<bf16>,
};

}  // namespace INFERD_VARIANT
}  // namespace inferd

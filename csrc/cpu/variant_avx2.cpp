// AVX2 + FMA (Haswell and later, Zen): 256-bit vpmaddubsw in the int8 kernels.
#include "variant_prelude.h"

#ifdef INFERD_X86
INFERD_TARGET_BEGIN("avx2,fma,f16c")
#define INFERD_VARIANT avx2
#define INFERD_ISA_LEVEL 1
#include "variant.h"
INFERD_TARGET_END
// outside the target switch: the dispatcher calls this on every CPU
const inferd::Kernels* inferd::kernels_avx2() { return &inferd::avx2::table; }
#else
const inferd::Kernels* inferd::kernels_avx2() { return nullptr; }
#endif

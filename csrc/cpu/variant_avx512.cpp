// AVX-512 F/BW/VL/DQ (Skylake-SP and later, Zen 4): 512-bit registers, vpmaddubsw on two blocks a step.
#include "variant_prelude.h"

#ifdef INFERD_X86
INFERD_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define INFERD_VARIANT avx512
#define INFERD_ISA_LEVEL 2
#include "variant.h"
INFERD_TARGET_END
// outside the target switch: the dispatcher calls this on every CPU
const inferd::Kernels* inferd::kernels_avx512() { return &inferd::avx512::table; }
#else
const inferd::Kernels* inferd::kernels_avx512() { return nullptr; }
#endif

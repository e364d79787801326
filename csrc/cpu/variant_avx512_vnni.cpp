// AVX-512 with VNNI (Cascade Lake and later, Zen 4): vpdpbusd, u8 x s8 -> s32 in one instruction.
#include "variant_prelude.h"

#ifdef INFERD_X86
INFERD_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define INFERD_VARIANT avx512_vnni
#define INFERD_ISA_LEVEL 3
#include "variant.h"
INFERD_TARGET_END
// outside the target switch: the dispatcher calls this on every CPU
const inferd::Kernels* inferd::kernels_avx512_vnni() { return &inferd::avx512_vnni::table; }
#else
const inferd::Kernels* inferd::kernels_avx512_vnni() { return nullptr; }
#endif

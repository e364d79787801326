// AVX-512 VNNI plus AMX-INT8 (Sapphire Rapids and later): the W4A8/W8A8 GEMM takes 16 rows at a time
// through the tile unit (one tdpbsud/tdpbssd a 32-block); everything else is the avx512_vnni code.
#include "variant_prelude.h"

#ifdef INFERD_X86
INFERD_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
#define INFERD_VARIANT avx512_amx
#define INFERD_ISA_LEVEL 4
#include "variant.h"
INFERD_TARGET_END
const inferd::Kernels* inferd::kernels_avx512_amx() { return &inferd::avx512_amx::table; }
#else
const inferd::Kernels* inferd::kernels_avx512_amx() { return nullptr; }
#endif

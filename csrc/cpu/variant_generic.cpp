// The fallback every CPU runs: plain C++ at the baseline ISA of the build.
#include "variant_prelude.h"

#define INFERD_VARIANT generic
#define INFERD_ISA_LEVEL 0
#include "variant.h"

const inferd::Kernels* inferd::kernels_generic() { return &inferd::generic::table; }

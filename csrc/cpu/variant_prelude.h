// Everything a variant's code uses, included before the variant switches the compiler's target.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define INFERD_X86 1
#endif

#include "kernels.h"

// Compile the functions that follow for `isa`, whatever the command line's -m flags are.
#if defined(__clang__)
#define INFERD_TARGET_BEGIN(isa) _Pragma(INFERD_PRAGMA_STR(clang attribute push(__attribute__((target(isa))), apply_to = function)))
#define INFERD_TARGET_END _Pragma("clang attribute pop")
#define INFERD_PRAGMA_STR(x) #x
#elif defined(__GNUC__)
#define INFERD_TARGET_BEGIN(isa) _Pragma("GCC push_options") _Pragma(INFERD_PRAGMA_STR(GCC target(isa)))
#define INFERD_TARGET_END _Pragma("GCC pop_options")
#define INFERD_PRAGMA_STR(x) #x
#endif

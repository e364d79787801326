// Which kernel variant runs: the best one this CPU executes, or the one INFERD_ISA names (never one
// the CPU lacks: a one-line error instead of SIGILL on the first instruction it does not have).
#include "kernels.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sstream>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace inferd {
namespace {

struct Variant {
  const char* name;
  const Kernels* (*get)();
  std::vector<const char*> needs;
};

const std::vector<Variant>& variants() {  // lowest first
  static const std::vector<Variant> v = {
      {"generic", kernels_generic, {}},
      {"avx2", kernels_avx2, {"avx2", "fma", "f16c"}},
      {"avx512", kernels_avx512, {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}},
      {"avx512_vnni", kernels_avx512_vnni,
       {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"}},
      {"avx512_amx", kernels_avx512_amx,
       {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "amx-tile", "amx-int8",
        "amx-os"}},
  };
  return v;
}

// INFERD_CPU_HIDE=avx512f,... makes this CPU look as if it lacked those features: how a test on an
// AVX-512 machine sees the refusal an AVX2 machine gives.
bool hidden(const char* feature) {
  const char* h = std::getenv("INFERD_CPU_HIDE");
  if (!h) return false;
  std::stringstream ss(h);
  std::string item;
  while (std::getline(ss, item, ','))
    if (item == feature) return true;
  return false;
}

// CPUID listing AMX is not enough: Linux hands a process the 8 KB of tile state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, since 5.16), and a tile instruction without it
// faults. Asked once; a kernel or hypervisor that refuses it makes the variant unrunnable, not a crash.
// The OS must also have turned the tile state on in XCR0 (bits 17, 18), as oneDNN checks too.
bool amx_granted() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  static const bool ok = [] {
    // avx512f: libgcc has already checked the OS saves vector state, so xgetbv is there to run
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("avx512f")) return false;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool cpu_has(const char* f) {
  if (hidden(f)) return false;
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (!std::strcmp(f, "avx2")) return __builtin_cpu_supports("avx2");
  if (!std::strcmp(f, "fma")) return __builtin_cpu_supports("fma");
  if (!std::strcmp(f, "f16c")) return __builtin_cpu_supports("f16c");
  if (!std::strcmp(f, "avx512f")) return __builtin_cpu_supports("avx512f");
  if (!std::strcmp(f, "avx512bw")) return __builtin_cpu_supports("avx512bw");
  if (!std::strcmp(f, "avx512vl")) return __builtin_cpu_supports("avx512vl");
  if (!std::strcmp(f, "avx512dq")) return __builtin_cpu_supports("avx512dq");
  if (!std::strcmp(f, "avx512vnni")) return __builtin_cpu_supports("avx512vnni");
  if (!std::strcmp(f, "avx512bf16")) return __builtin_cpu_supports("avx512bf16");
  if (!std::strcmp(f, "amx-tile")) return __builtin_cpu_supports("amx-tile");
  if (!std::strcmp(f, "amx-int8")) return __builtin_cpu_supports("amx-int8");
  if (!std::strcmp(f, "amx-os")) return amx_granted();
#endif
  return false;
}

std::vector<std::string> lacking(const Variant& v) {
  std::vector<std::string> out;
  if (!v.get()) out.emplace_back("an x86-64 build");
  for (const char* f : v.needs)
    if (!cpu_has(f)) out.emplace_back(f);
  return out;
}

std::string join(const std::vector<std::string>& xs) {
  std::string s;
  for (const auto& x : xs) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::atomic<const Kernels*> g_active{nullptr};

}  // namespace

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
  for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni",
                        "avx512bf16", "amx-tile", "amx-int8", "amx-os"})
    if (cpu_has(f)) out.emplace_back(f);
  return out;
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> out;
  for (const auto& v : variants())
    if (lacking(v).empty()) out.emplace_back(v.name);
  return out;
}

std::string select_isa(const std::string& name) {
  const Variant* pick = nullptr;
  if (name.empty() || name == "auto") {
    for (const auto& v : variants())
      if (lacking(v).empty()) pick = &v;
  } else {
    std::vector<std::string> names;
    for (const auto& v : variants()) {
      names.emplace_back(v.name);
      if (name == v.name) pick = &v;
    }
    TORCH_CHECK(pick, "INFERD_ISA=", name, " is not a kernel variant (one of: auto, ", join(names), ")");
    const auto missing = lacking(*pick);
    TORCH_CHECK(missing.empty(), "INFERD_ISA=", name, ": this CPU lacks ", join(missing),
                " (it runs: ", join(runnable_isas()), ")");
  }
  g_active.store(pick->get());
  return pick->name;
}

const Kernels& active() {
  const Kernels* k = g_active.load();
  if (!k) {
    const char* env = std::getenv("INFERD_ISA");
    select_isa(env ? env : "auto");
    k = g_active.load();
  }
  return *k;
}

}  // namespace inferd

// Which vector instructions the kernels use on this CPU, and the function attributes that compile a
// function for them (the library itself is built for the baseline x86-64, so one build runs on every
// machine and picks its path at run time).

#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SG_X86 1
#define SG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define SG_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SG_X86 0
#endif

namespace sg {

// 0: portable C++, 1: AVX2, 2: AVX-512 VNNI. SPECGATE_KERNEL_ISA (scalar, avx2, avx512) may lower it.
static int64_t detect_isa() {
  int64_t best = 0;
#if SG_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    best = 2;
#endif
  const char* want = std::getenv("SPECGATE_KERNEL_ISA");
  if (want != nullptr) {
    int64_t asked = std::strcmp(want, "scalar") == 0 ? 0 : std::strcmp(want, "avx2") == 0 ? 1 : 2;
    best = std::min(best, asked);
  }
  return best;
}

static int64_t g_isa = -1;

static inline int64_t isa() {
  if (g_isa < 0) g_isa = detect_isa();
  return g_isa;
}

static int64_t isa_level() { return isa(); }

// Tests run every path the CPU has: a level above what it runs is lowered to that.
static int64_t set_isa_level(int64_t level) {
  int64_t best = detect_isa();
  g_isa = std::max<int64_t>(0, std::min(level, best));
  return g_isa;
}

}  // namespace sg

// Which instruction set the CPU kernels run with, chosen once per process.
//
// Every CPU kernel is compiled for AVX-512, AVX2 and SSE2 (its *_<isa>.cc files);
// RuntimeSettings::cpu_isa (the CPU_ISA setting of paddle_unpad/config.py) caps the path
// (tests run every variant on one machine); a path the CPU cannot run is never chosen.
#pragma once
#include "kernels/common/runtime_settings.h"

namespace paddle_unpad {

enum class CpuIsa { kSse2, kAvx2, kAvx512 };

inline CpuIsa pick_cpu_isa() {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const int cap = runtime_settings().cpu_isa;  // -1: no cap
  if (has512 && (cap < 0 || cap >= 2)) return CpuIsa::kAvx512;
  if (has2 && (cap < 0 || cap >= 1)) return CpuIsa::kAvx2;
  return CpuIsa::kSse2;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::kAvx512 ? "avx512" : (isa == CpuIsa::kAvx2 ? "avx2" : "sse2");
}

// Declares a kernel's entry points (its *_<isa>.cc builds) in the namespaces sse2, avx2 and
// avx512, one per instruction set.
#define PU_DECLARE_PER_ISA(...) \
  namespace sse2 {              \
  __VA_ARGS__                   \
  }                             \
  namespace avx2 {              \
  __VA_ARGS__                   \
  }                             \
  namespace avx512 {            \
  __VA_ARGS__                   \
  }

// X(isa) for each of those namespaces, in CpuIsa order.
#define PU_CPU_ISAS(X) X(sse2) X(avx2) X(avx512)

// The entry points of the instruction set this process runs, picked at the first call (each
// dispatcher keeps its own choice): by_isa holds one Entries per CpuIsa, in CpuIsa order.
template <typename Entries>
const Entries& chosen_isa(const Entries (&by_isa)[3]) {
  static const Entries& chosen = by_isa[static_cast<int>(pick_cpu_isa())];
  return chosen;
}

}  // namespace paddle_unpad

// Which instruction set the CPU kernels run with, chosen once per process.
//
// Every CPU kernel is compiled for AVX-512, AVX2 and SSE2 (its *_<isa>.cc files);
// PADDLE_UNPAD_CPU_ISA=avx512|avx2|sse2 forces a narrower path (tests run every
// variant on one machine); a path the CPU cannot run is never chosen.
#pragma once
#include <cstdlib>
#include <string>

namespace paddle_unpad {

enum class CpuIsa { kSse2, kAvx2, kAvx512 };

inline CpuIsa pick_cpu_isa() {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* want = std::getenv("PADDLE_UNPAD_CPU_ISA");
  const std::string w = want ? want : "";
  if (has512 && (w.empty() || w == "avx512")) return CpuIsa::kAvx512;
  if (has2 && (w.empty() || w == "avx512" || w == "avx2")) return CpuIsa::kAvx2;
  return CpuIsa::kSse2;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::kAvx512 ? "avx512" : (isa == CpuIsa::kAvx2 ? "avx2" : "sse2");
}

}  // namespace paddle_unpad

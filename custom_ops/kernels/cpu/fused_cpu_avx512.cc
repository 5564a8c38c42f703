// Fused-op CPU kernels compiled for avx512; fused_cpu.cc picks the widest one the CPU runs.
// Standard headers come first so that only the kernel body gets the target ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "kernels/common/philox.h"
#include "kernels/cpu/fused_cpu.h"

#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi2")
#define FUSED_ISA avx512
#define FUSED_VLEN 16
#include "kernels/cpu/fused_cpu_impl.h"

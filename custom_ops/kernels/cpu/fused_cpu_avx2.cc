// Fused-op CPU kernels compiled for avx2; fused_cpu.cc picks the widest one the CPU runs.
// Standard headers come first so that only the kernel body gets the target ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "kernels/common/philox.h"
#include "kernels/cpu/fused_cpu.h"

#pragma GCC target("avx2,fma,bmi2")
#define FUSED_ISA avx2
#define FUSED_VLEN 8
#include "kernels/cpu/fused_cpu_impl.h"

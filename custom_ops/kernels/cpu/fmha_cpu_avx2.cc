// FMHA CPU kernel compiled for avx2; fmha_cpu.cc picks the widest one the CPU runs.
// Standard headers come first so that only the kernel body gets the target ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "kernels/common/philox.h"
#include "kernels/cpu/fmha_cpu.h"

#pragma GCC target("avx2,fma,bmi2")
#define FMHA_ISA avx2
#define FMHA_VLEN 8
#define FMHA_MR 6
#define FMHA_NV 2
#include "kernels/cpu/fmha_cpu_impl.h"

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
// vpmuludq: the portable form would become the slower 64x64-bit vpmullq here (maskz:
// _mm512_mul_epu32 trips a -Wmaybe-uninitialized false positive in GCC 12).
#define FUSED_MUL_EPU32(a, b) ((vu64)_mm512_maskz_mul_epu32((__mmask8)0xff, (__m512i)(a), (__m512i)(b)))
#include "kernels/cpu/fused_cpu_impl.h"

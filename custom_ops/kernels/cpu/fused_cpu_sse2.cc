// Fused-op CPU kernels compiled for sse2; fused_cpu.cc picks the widest one the CPU runs.
// Standard headers come first so that only the kernel body gets the target ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "kernels/common/philox.h"
#include "kernels/cpu/fused_cpu.h"

// baseline x86-64 (SSE2): no target pragma
#define FUSED_ISA sse2
#define FUSED_VLEN 4
#include "kernels/cpu/fused_cpu_impl.h"

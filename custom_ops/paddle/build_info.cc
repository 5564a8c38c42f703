// What this build of the operator library contains, readable with ctypes before (or
// without) registering the operators with Paddle.
#include "kernels/cpu/fmha_cpu.h"

extern "C" {

// Bit 0: CPU kernels; bit 1: CUDA kernels.
int paddle_unpad_build_flags() {
#if defined(PADDLE_WITH_CUDA)
  return 3;
#else
  return 1;
#endif
}

// Instruction set the CPU kernels dispatch to on this machine.
const char* paddle_unpad_cpu_isa() { return paddle_unpad::fmha_cpu_isa(); }
}

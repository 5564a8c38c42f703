// What this build of the operator library contains, readable with ctypes before (or
// without) registering the operators with Paddle.
#include "kernels/common/runtime_settings.h"
#include "kernels/cpu/fmha_cpu.h"

#include <string>

extern "C" {

// Bit 0: CPU kernels; bit 1: CUDA kernels.
int paddle_unpad_build_flags() {
#if defined(PADDLE_WITH_CUDA)
  return 3;
#else
  return 1;
#endif
}

// The run-time settings (paddle_unpad/config.py): called by the package right after it
// registers the library, before any kernel runs. cpu_isa: "auto", "avx512", "avx2", "sse2".
void paddle_unpad_configure(int num_threads, const char* cpu_isa, int fmha_streams) {
  paddle_unpad::RuntimeSettings& s = paddle_unpad::runtime_settings();
  s.num_threads = num_threads;  // <= 0: OMP_NUM_THREADS, else the cores (thread_pool.cc)
  const std::string isa = cpu_isa ? cpu_isa : "auto";
  s.cpu_isa = isa == "sse2" ? 0 : isa == "avx2" ? 1 : isa == "avx512" ? 2 : -1;
  s.fmha_streams = fmha_streams;  // the launch keeps it within [1, kMaxStreams]
}

// Instruction set the CPU kernels dispatch to on this machine.
const char* paddle_unpad_cpu_isa() { return paddle_unpad::fmha_cpu_isa(); }
}

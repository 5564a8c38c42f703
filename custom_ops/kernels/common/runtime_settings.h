// Settings the kernels read at run time, set once by the Python package when it registers
// the operator library (paddle_unpad/config.py declares them; _native.py passes their
// values through paddle_unpad_configure() before any kernel runs). The kernels never read
// the environment themselves: one place parses every setting, with one rule.
#pragma once

namespace paddle_unpad {

struct RuntimeSettings {
  int num_threads = 0;   // CPU kernel threads; 0: OMP_NUM_THREADS, else the hardware's
  int cpu_isa = -1;      // widest CPU kernel path allowed: -1 auto, 0 sse2, 1 avx2, 2 avx512
  int fmha_streams = 4;  // CUDA streams of the grouped FMHA launch
};

// The process's settings (defaults until configured).
RuntimeSettings& runtime_settings();

}  // namespace paddle_unpad

// What the CPU and the CUDA kernels of an operator share of their problem description; each
// problem struct adds what only its kernels take (kernels/cpu/*.h, kernels/cuda/*.cuh), and the
// glue hands the shared part from one to the other whole. Framework-free.
#pragma once
#include <cstdint>

namespace paddle_unpad {

// Attention over packed variable-length sequences (FmhaProblem, cuda::FmhaCudaProblem).
struct FmhaDesc {
  const int32_t* cu_seqlens = nullptr;  // host memory, [batch + 1]
  int64_t batch = 0;                    // B
  int64_t total = 0;                    // T
  int64_t heads = 0;                    // H
  int64_t head_dim = 0;                 // D
  float scale = 1.0f;                   // applied to q k^T
  float dropout = 0.0f;                 // attention-probability dropout in [0, 1), 0 = off
  uint64_t seed = 0;                    // Philox key (all 64 bits)
  uint64_t offset = 0;                  // Philox counter word 3 (low 32 bits used)
};

// bias_dropout_residual_layer_norm (BdrlnProblem, cuda::BdrlnCudaProblem).
struct BdrlnDesc {
  int64_t rows = 0;        // N (all leading dimensions), < 2^32
  int64_t cols = 0;        // F, the normalised size, >= 1
  float dropout = 0.0f;    // drop probability of (x + bias) in [0, 1), 0 = off
  float epsilon = 1e-12f;  // added to the variance
  uint64_t seed = 0;       // Philox key (all 64 bits)
  uint64_t offset = 0;     // Philox counter word 3 (low 32 bits used)
};

}  // namespace paddle_unpad

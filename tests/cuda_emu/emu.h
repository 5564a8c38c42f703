// A small CPU emulation of the CUDA execution model, enough to run the fused kernels of
// custom_ops/kernels/cuda on a machine without a GPU (tests/test_cuda_emulated.py):
//   - a launch runs its blocks one after another; a block's threads are std::threads;
//   - __shared__ is `static` (one block is alive at a time, so it is the block's memory);
//   - __syncthreads() is a barrier of the block (a thread leaving the kernel drops out);
//   - __shfl_xor_sync() exchanges through a per-block buffer between two warp barriers.
// Kernel launches `k<<<grid, block, smem, stream>>>(args)` are rewritten by the test into
// emu::launch(k, grid, block, smem, stream, args). Device math runs as host math.
// It checks indexing, chunking, reductions and dropout layouts, not GPU behaviour.
#pragma once
#define __shared__ static
#define __launch_bounds__(...)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace emu {

struct Block {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> lanes;  // shuffle exchange, one slot per thread
};

inline thread_local dim3 tid, bid;
inline thread_local Block* block = nullptr;
inline thread_local unsigned linear = 0;
inline dim3 block_dim, grid_dim;

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, dim3 threads, size_t, cudaStream_t, Args... args) {
  block_dim = threads;
  grid_dim = grid;
  const unsigned n = threads.x * threads.y * threads.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.all.reset(new std::barrier<>(n));
        for (unsigned w = 0; w < (n + 31) / 32; ++w)
          b.warps.emplace_back(new std::barrier<>(std::min(32u, n - 32 * w)));
        b.lanes.assign(n, 0.0f);
        std::vector<std::thread> pool;
        pool.reserve(n);
        for (unsigned t = 0; t < n; ++t)
          pool.emplace_back([&, t] {
            block = &b;
            linear = t;
            tid = dim3(t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y));
            bid = dim3(bx, by, bz);
            kernel(args...);
            b.all->arrive_and_drop();
            b.warps[t / 32]->arrive_and_drop();
          });
        for (std::thread& th : pool) th.join();
      }
}

}  // namespace emu

#define threadIdx (emu::tid)
#define blockIdx (emu::bid)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  emu::Block* b = emu::block;
  const unsigned me = emu::linear;
  b->lanes[me] = v;
  b->warps[me / 32]->arrive_and_wait();
  const float r = b->lanes[(me & ~31u) | ((me & 31u) ^ static_cast<unsigned>(lane_mask))];
  b->warps[me / 32]->arrive_and_wait();
  return r;
}

using std::max;
using std::min;

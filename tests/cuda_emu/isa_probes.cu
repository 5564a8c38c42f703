// Single-instruction kernels over the helpers of kernels/cuda/cuda_common.cuh, so that the
// emulated instructions (emu_isa.h) are checked on their own, against a plain matrix
// product / transpose written in Python from the PTX ISA (tests/test_cuda_emulated_isa.py),
// before they are trusted to check the FMHA kernels. One warp per launch; host memory.
// Also kernels that break the execution model on purpose (a divergent barrier, an
// out-of-bounds shared access, a tensor-core instruction with a lane missing, a missing
// __syncthreads around an asynchronous copy) to
// show the emulation reports them instead of hanging or passing.
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace {

using paddle_unpad::cuda::cp_async16;
using paddle_unpad::cuda::cp_async_commit;
using paddle_unpad::cuda::cp_async_wait;

thread_local std::string g_error;

int finish() {
  const cudaError_t e = cudaGetLastError();
  g_error = e == cudaSuccess ? "" : cudaGetErrorString(e);
  return e == cudaSuccess ? 0 : 1;
}

template <typename T>
__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  const int l = static_cast<int>(threadIdx.x);
  const uint32_t af[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
  float acc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
  paddle_unpad::cuda::mma16816<T>(acc, af, b[2 * l], b[2 * l + 1]);
  for (int i = 0; i < 4; ++i) d[4 * l + i] = acc[i];
}

// The image goes to shared memory, then every lane hands ldmatrix its own row address.
__global__ void ldmatrix_kernel(const uint16_t* image, int elems, const int* row_offset, int trans,
                                uint32_t* out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* s = reinterpret_cast<uint16_t*>(smem_raw);
  const int l = static_cast<int>(threadIdx.x);
  for (int i = l; i < elems; i += 32) s[i] = image[i];
  __syncthreads();
  uint32_t r[4];
  if (trans)
    paddle_unpad::cuda::ldmatrix_x4_trans(r, s + row_offset[l]);
  else
    paddle_unpad::cuda::ldmatrix_x4(r, s + row_offset[l]);
  for (int i = 0; i < 4; ++i) out[4 * l + i] = r[i];
}

// Lane l copies chunk l (group 0) and chunk 32 + l (group 1) of 16 bytes; snapshots of
// shared memory after wait_group 1 and after wait_group 0.
__global__ void cp_async_kernel(const uint16_t* src, const int* valid, uint16_t* after1,
                                uint16_t* after0) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* s = reinterpret_cast<uint16_t*>(smem_raw);
  const int l = static_cast<int>(threadIdx.x);
  for (int grp = 0; grp < 2; ++grp) {
    const int ch = 32 * grp + l;
    cp_async16(s + 8 * ch, src + 8 * ch, valid[ch] != 0);
    cp_async_commit();
  }
  cp_async_wait<1>();
  __syncthreads();
  for (int i = l; i < 64 * 8; i += 32) after1[i] = s[i];
  __syncthreads();
  cp_async_wait<0>();
  __syncthreads();
  for (int i = l; i < 64 * 8; i += 32) after0[i] = s[i];
}

// Lane 31 leaves before the warp's mma.sync (.aligned: every lane must execute it).
__global__ void partial_warp_mma_kernel(float* d) {
  if (threadIdx.x == 31) return;
  const uint32_t a[4] = {0, 0, 0, 0};
  float acc[4] = {0, 0, 0, 0};
  paddle_unpad::cuda::mma16816<__half>(acc, a, 0u, 0u);
  d[threadIdx.x] = acc[0];
}

__global__ void exp2_kernel(const float* x, float* y, int n) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += 32)
    y[i] = paddle_unpad::cuda::fast_exp2(x[i]);
}

__global__ void divergent_barrier_kernel(int* out) {
  // Thread 32 waits for its warp, which waits for the block, which waits for thread 32.
  if (threadIdx.x == 32) __syncwarp();
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Two warps share 32 rows of 16 bytes without a __syncthreads between a cp.async and an
// ldmatrix of the other warp: read after write (war = 0) or write after read (war = 1).
__global__ void race_kernel(const uint16_t* src, int war, uint32_t* out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* s = reinterpret_cast<uint16_t*>(smem_raw);
  const int l = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  uint32_t r[4] = {0, 0, 0, 0};
  for (int i = static_cast<int>(threadIdx.x); i < 32 * 8; i += 64) s[i] = 0;
  __syncthreads();
  const int writer = war ? 1 : 0;
  if (warp == writer) {
    cp_async16(s + 8 * l, src + 8 * l, true);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    paddle_unpad::cuda::ldmatrix_x4(r, s + 8 * l);
  }
  __syncthreads();
  for (int i = 0; i < 4; ++i) out[4 * threadIdx.x + i] = r[i];
}

__global__ void movmatrix_kernel(const uint32_t* x, uint32_t* y) {
  const int l = static_cast<int>(threadIdx.x);
  y[l] = paddle_unpad::cuda::movmatrix_trans(x[l]);
}

__global__ void shuffle_kernel(const float* x, float* y, int lane_mask) {
  const int l = static_cast<int>(threadIdx.x);
  y[l] = __shfl_xor_sync(0xffffffffu, x[l], lane_mask);
}

}  // namespace

extern "C" {

const char* emu_probe_last_error() { return g_error.c_str(); }

// a [32][4], b [32][2] b32 registers per lane (dtype 0 = f16, 1 = bf16); c, d [32][4] fp32.
int emu_probe_mma(int dtype, const uint32_t* a, const uint32_t* b, const float* c, float* d) {
  if (dtype == 0)
    mma_kernel<__half><<<1, 32, 0, nullptr>>>(a, b, c, d);
  else
    mma_kernel<__nv_bfloat16><<<1, 32, 0, nullptr>>>(a, b, c, d);
  return finish();
}

// image [elems] b16 placed at the start of shared memory; row_offset [32] in elements.
int emu_probe_ldmatrix(const uint16_t* image, int elems, const int* row_offset, int trans,
                       uint32_t* out) {
  ldmatrix_kernel<<<1, 32, static_cast<size_t>(elems) * 2, nullptr>>>(image, elems, row_offset,
                                                                      trans, out);
  return finish();
}

// src [64 * 8] b16 (16-byte aligned), valid [64]; after1, after0 [64 * 8].
int emu_probe_cp_async(const uint16_t* src, const int* valid, uint16_t* after1, uint16_t* after0) {
  cp_async_kernel<<<1, 32, 64 * 16, nullptr>>>(src, valid, after1, after0);
  return finish();
}

int emu_probe_partial_warp_mma(float* d) {
  partial_warp_mma_kernel<<<1, 32, 0, nullptr>>>(d);
  return finish();
}

int emu_probe_exp2(const float* x, float* y, int n) {
  exp2_kernel<<<1, 32, 0, nullptr>>>(x, y, n);
  return finish();
}

int emu_probe_movmatrix(const uint32_t* x, uint32_t* y) {
  movmatrix_kernel<<<1, 32, 0, nullptr>>>(x, y);
  return finish();
}

int emu_probe_shuffle(const float* x, float* y, int lane_mask) {
  shuffle_kernel<<<1, 32, 0, nullptr>>>(x, y, lane_mask);
  return finish();
}

// src [32 * 8] b16; out [64][4].
int emu_probe_race(const uint16_t* src, int war, uint32_t* out) {
  race_kernel<<<1, 64, 32 * 16, nullptr>>>(src, war, out);
  return finish();
}

int emu_probe_divergent_barrier(int* out) {
  divergent_barrier_kernel<<<1, 64, 0, nullptr>>>(out);
  return finish();
}

}  // extern "C"

// Device helpers shared by the CUDA kernels: sm80 tensor-core MMA, ldmatrix, cp.async,
// ex2.approx, packing of fp32 pairs into fp16/bf16 registers. CUDA headers only (no
// framework); the instructions are inline PTX except in the CPU emulation build.
//
// Fragment layouts of mma.sync.m16n8k16 (g = lane / 4, c = lane % 4), used throughout:
//   A 16x16 (row-major), 4 x b32: a0 (row g, cols 2c..2c+1), a1 (row g+8, cols 2c..),
//                                  a2 (row g, cols 2c+8..),   a3 (row g+8, cols 2c+8..)
//   B 16x8  ("col"),     2 x b32: b0 (rows k = 2c..2c+1, col g), b1 (rows 2c+8.., col g)
//   C 16x8  fp32,        4 x f32: c0, c1 (row g, cols 2c, 2c+1), c2, c3 (row g+8, same cols)
// Two C tiles side by side (16 columns) are exactly one A fragment: that is how the
// probabilities of one GEMM become the left operand of the next without shared memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace paddle_unpad {
namespace cuda {

// ---------------------------------------------------------------- element types

// fp16 / bf16 pairs in one 32-bit register, the form mma.sync takes and gives. CUDA names each
// conversion per type; these overloads give them one name (the tag argument picks the pair type).
__device__ __forceinline__ __half2 floats_to_pair(__half, float lo, float hi) {
  return __floats2half2_rn(lo, hi);
}
__device__ __forceinline__ __nv_bfloat162 floats_to_pair(__nv_bfloat16, float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}
__device__ __forceinline__ float2 pair_to_floats(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 pair_to_floats(__nv_bfloat162 h) { return __bfloat1622float2(h); }

template <typename T>
struct ElemTraits {
  using Pair = decltype(floats_to_pair(T{}, 0.0f, 0.0f));
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    Pair h = floats_to_pair(T{}, lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t u) {
    return pair_to_floats(*reinterpret_cast<Pair*>(&u));
  }
};

}  // namespace cuda
}  // namespace paddle_unpad

// ---------------------------------------------------------------- sm80 instructions
// The CPU emulation build (tests/cuda_emu, which defines PU_CUDA_EMULATION)
// replaces the inline PTX below with emulated instructions of the same signatures,
// written from the same fragment layouts, so the kernels' logic can run in CI.
#if defined(PU_CUDA_EMULATION)
#include "emu_isa.h"
#else
namespace paddle_unpad {
namespace cuda {

// D (+)= A B on tensor cores, fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i
// receives matrix i (lane holds row lane/4, elements 2*(lane%4), +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Same, each matrix transposed (lane holds column lane/4, rows 2*(lane%4), +1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16-byte global -> shared copy; when !valid the destination is zero-filled and nothing
// is read (src must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(n)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The 8x8 b16 matrix whose rows the lanes hold (lane holds row lane/4, elements
// 2*(lane%4), +1), transposed in registers: the same lane then holds column lane/4.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Spins until *word (a count another block raises) is non-zero.
__device__ __forceinline__ void wait_nonzero(const int* word) {
  while (*reinterpret_cast<const volatile int*>(word) == 0) {}
}

// Drops the 128-byte line at p (128-byte aligned) from L2 without writing it back: its data
// is dead (a scratch value that was read for the last time).
__device__ __forceinline__ void discard_l2_line(const void* p) {
  asm volatile("discard.global.L2 [%0], 128;\n" ::"l"(p) : "memory");
}

// 2^x, ~2 ulp; exp2(-inf) = +0 (masked scores), never NaN for finite or -inf input.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace cuda
}  // namespace paddle_unpad
#endif

namespace paddle_unpad {
namespace cuda {

// ---------------------------------------------------------------- shared memory

// Rows [row0, row0 + kRows) of a row-major [s, kCols] matrix (row stride ld elements,
// 16-byte aligned rows) into shared memory with row stride kCols + 8 elements (the 16
// padding bytes make ldmatrix conflict-free). Rows >= s are zero-filled and never read,
// so a tile never touches a neighbouring sequence. Issues cp.async; the caller commits.
template <typename T, int kCols, int kRows, int kThreads>
__device__ __forceinline__ void load_rows_async(T* smem, const T* g, int row0, int s, int64_t ld) {
  constexpr int kChunks = kCols * static_cast<int>(sizeof(T)) / 16;
  constexpr int kElems = 16 / static_cast<int>(sizeof(T));
  constexpr int kStride = kCols + 8;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = it * kThreads + static_cast<int>(threadIdx.x);
    if (kTotal % kThreads == 0 || i < kTotal) {
      const int r = i / kChunks, ch = i % kChunks;
      const int gr = row0 + r;
      const bool ok = gr < s;
      const T* src = g + static_cast<int64_t>(ok ? gr : 0) * ld + ch * kElems;
      cp_async16(smem + r * kStride + ch * kElems, src, ok);
    }
  }
}

// ---------------------------------------------------------------- math

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// *addr += a, *(addr + 1) += b in global memory, without a return value (RED). addr is
// 8-byte aligned. sm_90 adds both floats in one vector atomic.
__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(addr), make_float2(a, b));
#else
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
#endif
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace cuda
}  // namespace paddle_unpad

// The sm80 instructions of kernels/cuda/cuda_common.cuh, emulated on the CPU for the
// emulation build (emu.h defines PU_CUDA_EMULATION; cuda_common.cuh then
// includes this file instead of its inline PTX). Written from the PTX ISA's definitions:
//
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32  D = A B + C
//     g = lane / 4, c = lane % 4; a b32 register holds two elements, the lower index in
//     its low 16 bits.
//     A 16x16: a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//     B 16x8:  b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//     C, D 16x8 fp32: {c0, c1} = row g, cols 2c, 2c+1; {c2, c3} = row g+8, same cols
//   A warp collective: every lane deposits its A and B registers, then computes its own
//   four D elements from the deposits in fp32 (the products of two f16 / bf16 values are
//   exact in fp32; the ISA leaves the order of the sum open: here the 16 products are
//   summed in k order, then C is added).
//
//   ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
//     lane 8i + r gives the address of row r of matrix i (16 bytes, 16-byte aligned);
//     register i of lane 4r + w receives row r, elements 2w and 2w + 1 of matrix i, or
//     with .trans column r, elements (rows) 2w and 2w + 1.
//
//   cp.async.cg.shared.global [dst], [src], 16, src_size (src_size 16 or 0: zero-fill,
//     nothing read), cp.async.commit_group, cp.async.wait_group N: the copies of a
//     thread are queued in groups and performed when a wait_group lets the thread go on
//     (all committed groups but the newest N), the latest moment the ISA allows, so a
//     missing or too weak wait leaves the 0xff fill of shared memory (NaN) in its place.
//
//   ex2.approx.ftz.f32: exp2f, results below the smallest normal flushed to +0.
//
//   movmatrix.sync.aligned.m8n8.trans.b16: the 8x8 matrix whose rows the lanes hold (as an
//     ldmatrix register) comes back transposed.
//
// Shared-memory operands are checked: in bounds of the block's dynamic shared memory and
// 16-byte aligned, or the launch fails; so is an ldmatrix of data another warp's cp.async
// has not been waited for and published by a __syncthreads, or a cp.async into data another
// warp reads in the same barrier interval (emu.h, Granule).
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace paddle_unpad {
namespace cuda {
namespace isa_emu {

inline float to_float(__half, uint16_t bits) {
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}

inline float to_float(__nv_bfloat16, uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Element `half` (0 = low 16 bits) of a b32 register, as a float.
template <typename T>
inline float element(uint32_t reg, int half) {
  return to_float(T{}, static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu));
}

// A[row][k] of the warp's A operand (register file of the deposits).
template <typename T>
inline float a_elem(const emu::Deposit* all, int row, int k) {
  const int owner = (row % 8) * 4 + (k % 8) / 2;
  const int reg = (row / 8) + 2 * (k / 8);
  return element<T>(all[owner].w[reg], k % 2);
}

// B[k][col] of the warp's B operand.
template <typename T>
inline float b_elem(const emu::Deposit* all, int k, int col) {
  const int owner = col * 4 + (k % 8) / 2;
  return element<T>(all[owner].w[4 + k / 8], k % 2);
}

}  // namespace isa_emu

template <typename T>
inline void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::require_full_warp("mma.sync.m16n8k16");
  if (emu::lane() == 0) ++emu::counters.mma;
  emu::Deposit mine{};
  for (int i = 0; i < 4; ++i) mine.w[i] = a[i];
  mine.w[4] = b0;
  mine.w[5] = b1;
  const emu::Deposit* all = emu::warp_exchange(mine, "mma.sync.m16n8k16");
  emu::require_all_deposits(all, "mma.sync.m16n8k16");
  const int g = static_cast<int>(emu::lane()) / 4, q = static_cast<int>(emu::lane()) % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * q + i % 2;
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k)
      sum += isa_emu::a_elem<T>(all, row, k) * isa_emu::b_elem<T>(all, k, col);
    c[i] += sum;
  }
}

namespace isa_emu {

inline uint16_t b16_at(const void* row, int i) {
  uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(row) + 2 * i, 2);
  return v;
}

inline void ldmatrix(uint32_t (&r)[4], const void* p, bool trans, const char* what) {
  emu::require_full_warp(what);
  emu::require_smem16(p, what);
  emu::note_smem_read(p, what);
  emu::Deposit mine{};
  mine.ptr = p;
  const emu::Deposit* all = emu::warp_exchange(mine, what);
  emu::require_all_deposits(all, what);
  const int row = static_cast<int>(emu::lane()) / 4, w = static_cast<int>(emu::lane()) % 4;
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (trans) {
      lo = b16_at(all[8 * i + 2 * w].ptr, row);
      hi = b16_at(all[8 * i + 2 * w + 1].ptr, row);
    } else {
      lo = b16_at(all[8 * i + row].ptr, 2 * w);
      hi = b16_at(all[8 * i + row].ptr, 2 * w + 1);
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

}  // namespace isa_emu

// movmatrix.sync.aligned.m8n8.trans.b16: lane 4r + w holds row r, elements 2w, 2w + 1 of
// an 8x8 matrix; afterwards it holds row r of the transpose, i.e. column r, elements (rows)
// 2w and 2w + 1, which lanes 4(2w) + r/2 and 4(2w + 1) + r/2 held (their half r % 2).
inline uint32_t movmatrix_trans(uint32_t x) {
  emu::require_full_warp("movmatrix.trans");
  emu::Deposit mine{};
  mine.w[0] = x;
  const emu::Deposit* all = emu::warp_exchange(mine, "movmatrix.trans");
  emu::require_all_deposits(all, "movmatrix.trans");
  const unsigned r = emu::lane() / 4, w = emu::lane() % 4, half = (r % 2) * 16;
  const uint32_t lo = (all[4 * (2 * w) + r / 2].w[0] >> half) & 0xffffu;
  const uint32_t hi = (all[4 * (2 * w + 1) + r / 2].w[0] >> half) & 0xffffu;
  return lo | (hi << 16);
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  isa_emu::ldmatrix(r, p, false, "ldmatrix.x4");
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  isa_emu::ldmatrix(r, p, true, "ldmatrix.x4.trans");
}

inline void cp_async16(void* dst, const void* src, bool valid) {
  emu::require_smem16(dst, "cp.async");
  if ((reinterpret_cast<uintptr_t>(src) & 15u) != 0u)
    emu::fail("cp.async: global source not 16-byte aligned");
  emu::note_copy_issue(dst);
  emu::self->copies.push_back({dst, src, valid, emu::self->open_group});
}

inline void cp_async_commit() { ++emu::self->open_group; }

template <int N>
inline void cp_async_wait() {
  // Groups older than the newest N committed ones are complete after the wait.
  const uint64_t committed = emu::self->open_group;
  const uint64_t done_below = committed >= static_cast<uint64_t>(N) ? committed - N : 0;
  std::vector<emu::PendingCopy>& q = emu::self->copies;
  size_t kept = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    if (q[i].group < done_below) {
      if (q[i].valid)
        std::memcpy(q[i].dst, q[i].src, 16);
      else
        std::memset(q[i].dst, 0, 16);
      emu::note_copy_landed(q[i].dst);
    } else {
      q[kept++] = q[i];
    }
  }
  q.resize(kept);
}

// Blocks run one after another: a block can only wait for one that ran before it. A count
// still at zero here would be a wait on a later block, which the emulation cannot run (and
// which on a GPU would depend on the order blocks are scheduled in): it fails the launch.
inline void wait_nonzero(const int* word) {
  if (*word == 0) emu::fail("wait on a count no earlier block has raised");
}

inline void discard_l2_line(const void*) {}

inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return y < FLT_MIN ? 0.0f : y;
}

}  // namespace cuda
}  // namespace paddle_unpad

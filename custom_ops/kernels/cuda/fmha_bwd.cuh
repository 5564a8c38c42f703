// FMHA backward kernels, included by fmha_bwd_{fp16,bf16}.cu.
//
// Deterministic by construction (no atomics): three kernels, each output element written
// by exactly one thread with a fixed order of operations.
//   1. delta = rowsum(dO * O)                                   [T, H] fp32 workspace
//   2. dK/dV kernel: one block per (key block, sequence, head); each warp owns 16 keys
//      and walks all query blocks (double-buffered Q/dO tiles):
//        S^T = K Q^T, P^T = exp2(S^T * scale_log2 - lse_log2), dP^T = V dO^T,
//        dS^T = P^T (dP^T Z - delta),  dV += (P^T Z) dO,  dK += scale * dS^T Q
//   3. dQ kernel: one block per (query block, sequence, head); each warp owns 16 queries
//      and walks all key blocks (double-buffered K/V tiles):
//        S = Q K^T, P, dP = dO V^T, dS = P (dP Z - delta),  dQ += scale * dS K
// The dQ kernel recomputes S and dP (7 GEMMs instead of 5) in exchange for no atomics
// and no fp32 dQ accumulator: reruns are bitwise identical.
#pragma once
#include "kernels/cuda/fmha_fwd.cuh"

namespace paddle_unpad {
namespace cuda {

template <typename T, int D>
__global__ void __launch_bounds__(256)
    fmha_bwd_delta_kernel(const T* __restrict__ out, const T* __restrict__ dout,
                          float* __restrict__ delta, int64_t rows) {
  constexpr int kLanes = D / 8;  // threads per row, 8 elements (16 bytes) each
  constexpr int kRowsPerBlock = 256 / kLanes;
  using Tr = ElemTraits<T>;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int ch = static_cast<int>(threadIdx.x) % kLanes;
  float acc = 0.0f;
  if (r < rows) {
    const uint4 a = *reinterpret_cast<const uint4*>(out + r * D + ch * 8);
    const uint4 b = *reinterpret_cast<const uint4*>(dout + r * D + ch * 8);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = Tr::unpack(av[i]), y = Tr::unpack(bv[i]);
      acc += x.x * y.x + x.y * y.y;
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (r < rows && ch == 0) delta[r] = acc;
}

// Two warp GEMMs of one shape: acc_a = A_a B_a^T and acc_b = A_b B_b^T, with A this warp's 16
// rows of D (registers fr_* when kInRegs, else shared memory at the lane's fragment row sa_*)
// and B kCols rows of D in shared memory (b_*, kStride apart). The dK/dV kernel takes
// S^T = K Q^T and dP^T = V dO^T with it, the dQ kernel S = Q K^T and dP = dO V^T.
template <typename T, int D, int kCols, int kStride, bool kInRegs, int kFr>
__device__ __forceinline__ void warp_gemm_pair_abt(float (&acc_a)[kCols / 8][4],
                                                   float (&acc_b)[kCols / 8][4],
                                                   const uint32_t (&fr_a)[kFr][4],
                                                   const uint32_t (&fr_b)[kFr][4], const T* sa_a,
                                                   const T* sa_b, const T* b_a, const T* b_b,
                                                   int lane) {
#pragma unroll
  for (int t = 0; t < kCols / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_a[t][e] = acc_b[t][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4], b[4];
    if (kInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = fr_a[kInRegs ? kk : 0][i];
        b[i] = fr_b[kInRegs ? kk : 0][i];
      }
    } else {
      ldmatrix_x4(a, sa_a + kk * 16);
      ldmatrix_x4(b, sa_b + kk * 16);
    }
#pragma unroll
    for (int c2 = 0; c2 < kCols / 16; ++c2) {
      const int off = (c2 * 16 + (lane & 7) + (lane >> 4) * 8) * kStride + kk * 16 +
                      ((lane >> 3) & 1) * 8;
      mma_two_tiles<T, false>(acc_a[2 * c2], acc_a[2 * c2 + 1], a, b_a + off);
      mma_two_tiles<T, false>(acc_b[2 * c2], acc_b[2 * c2 + 1], b, b_b + off);
    }
  }
}

// dK, dV. kQM: queries per step; kKVInRegs: keep this warp's K and V A-fragments in
// registers across the query loop (else reload them from shared memory each step).
template <typename T, int D, int kQM, bool kKVInRegs>
__global__ void __launch_bounds__(128)
    fmha_bwd_dkdv_kernel(const __grid_constant__ FmhaParams p) {
  constexpr int kThreads = 128;
  constexpr int kBlockN = kBwdKeysPerBlock;  // 4 warps x 16 keys
  static_assert(kBlockN == 64, "4 warps own 16 keys each");
  constexpr int kStride = D + 8;
  constexpr int kKT = D / 16;
  constexpr int kQT = kQM / 8;
  constexpr int kDT = D / 8;
  constexpr int kFr = kKVInRegs ? kKT : 1;
  using Tr = ElemTraits<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;   // [2][kQM][kStride]
  T* sdO = sQ + 2 * kQM * kStride;  // [2][kQM][kStride]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kQM * kStride);  // [2][kQM], * log2(e)
  float* sDelta = sLse + 2 * kQM;                                   // [2][kQM]

  const SeqSpan seq = p.seqs[blockIdx.y];
  const int s = seq.len;
  const int j0 = static_cast<int>(blockIdx.x) * kBlockN;
  if (j0 >= s) return;
  const VarlenTile<T, D> tile(p, seq);
  const int h = tile.head, warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;

  auto issue_q = [&](int qb, int st) {
    load_rows_async<T, D, kQM, kThreads>(sQ + st * kQM * kStride, tile.q, qb * kQM, s, tile.ld);
    load_rows_async<T, D, kQM, kThreads>(sdO + st * kQM * kStride, tile.in(p.dout), qb * kQM, s,
                                         tile.ld);
    for (int i = static_cast<int>(threadIdx.x); i < kQM; i += kThreads) {
      const int r = qb * kQM + i;
      const bool ok = r < s;
      const int64_t row = static_cast<int64_t>(seq.start + (ok ? r : 0)) * p.heads + h;
      // Queries past the end get lse = +inf: P = 0, so they add nothing to dK and dV.
      sLse[st * kQM + i] = ok ? p.lse[row] * kLog2e : INFINITY;
      sDelta[st * kQM + i] = ok ? p.delta[row] : 0.0f;
    }
  };

  load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, j0, s, tile.ld);
  load_rows_async<T, D, kBlockN, kThreads>(sV, tile.v, j0, s, tile.ld);
  issue_q(0, 0);
  cp_async_commit();

  uint32_t kf[kFr][4], vf[kFr][4];
  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  const int kr0 = warp * 16;  // this warp's keys within the block
  const uint32_t key_g = static_cast<uint32_t>(j0 + kr0 + g);  // key of rows g (g + 8: +8)
  const T* sKw = sK + (kr0 + (lane & 15)) * kStride + (lane >> 4) * 8;  // A-fragment rows
  const T* sVw = sV + (kr0 + (lane & 15)) * kStride + (lane >> 4) * 8;

  const int nqb = (s + kQM - 1) / kQM;
  for (int qb = 0; qb < nqb; ++qb) {
    const int st = qb & 1;
    if (qb + 1 < nqb) {
      issue_q(qb + 1, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage st (and K, V) landed
    if (kKVInRegs && qb == 0) {
#pragma unroll
      for (int kk = 0; kk < kFr; ++kk) {
        ldmatrix_x4(kf[kk], sKw + kk * 16);
        ldmatrix_x4(vf[kk], sVw + kk * 16);
      }
    }
    const T* qs = sQ + st * kQM * kStride;
    const T* dos = sdO + st * kQM * kStride;
    const float* lse_s = sLse + st * kQM;
    const float* dl_s = sDelta + st * kQM;

    // S^T = K Q^T and dP^T = V dO^T: rows = this warp's 16 keys, columns = kQM queries.
    float sT[kQT][4], dpT[kQT][4];
    warp_gemm_pair_abt<T, D, kQM, kStride, kKVInRegs, kFr>(sT, dpT, kf, vf, sKw, sVw, qs, dos,
                                                           lane);

    // P^T Z into sT, dS^T into dpT.
    const uint32_t t_q = static_cast<uint32_t>(seq.start + qb * kQM + 2 * c);
#pragma unroll
    for (int qt = 0; qt < kQT; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = qt * 8 + 2 * c + (e & 1);
        const float pr = fast_exp2(sT[qt][e] * p.scale_log2 - lse_s[qc]);
        float z = 1.0f;
        if (p.dropout)
          z = dropout_one(p, key_g + 8u * (e >> 1), t_q + static_cast<uint32_t>(qt * 8 + (e & 1)),
                          static_cast<uint32_t>(h));
        sT[qt][e] = pr * z;
        dpT[qt][e] = pr * (dpT[qt][e] * z - dl_s[qc]);
      }

    // dV += (P^T Z) dO, dK += dS^T Q: B operands are dO and Q transposed out of shared.
#pragma unroll
    for (int q16 = 0; q16 < kQM / 16; ++q16) {
      uint32_t ap[4], as[4];
      a_fragment<T>(ap, sT[2 * q16], sT[2 * q16 + 1]);
      a_fragment<T>(as, dpT[2 * q16], dpT[2 * q16 + 1]);
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        const int off = (q16 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + d2 * 16 +
                        (lane >> 4) * 8;
        mma_two_tiles<T, true>(dv[2 * d2], dv[2 * d2 + 1], ap, dos + off);
        mma_two_tiles<T, true>(dk[2 * d2], dk[2 * d2 + 1], as, qs + off);
      }
    }
    __syncthreads();  // every warp is done with stage st before it is refilled
  }

  // Epilogue: stage in this warp's own rows of sK / sV, 16-byte stores of existing keys.
  T* sk_w = sK + kr0 * kStride;
  T* sv_w = sV + kr0 * kStride;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int off = (g + 8 * i) * kStride + dt * 8 + 2 * c;
      *reinterpret_cast<uint32_t*>(sk_w + off) =
          Tr::pack(dk[dt][2 * i] * p.scale, dk[dt][2 * i + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(sv_w + off) = Tr::pack(dv[dt][2 * i], dv[dt][2 * i + 1]);
    }
  __syncwarp();
  T* gdk = tile.out(p.dk);
  T* gdv = tile.out(p.dv);
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = idx / kChunks, ch = idx % kChunks;
    const int key = j0 + kr0 + r;
    if (key < s) {
      const int64_t go = static_cast<int64_t>(key) * tile.ld + ch * 8;
      *reinterpret_cast<uint4*>(gdk + go) = *reinterpret_cast<const uint4*>(sk_w + r * kStride + ch * 8);
      *reinterpret_cast<uint4*>(gdv + go) = *reinterpret_cast<const uint4*>(sv_w + r * kStride + ch * 8);
    }
  }
}

// dQ. kBlockN: keys per step; kQInRegs: keep this warp's Q and dO A-fragments in registers.
template <typename T, int D, int kBlockN, bool kQInRegs>
__global__ void __launch_bounds__(128)
    fmha_bwd_dq_kernel(const __grid_constant__ FmhaParams p) {
  constexpr int kThreads = 128;
  constexpr int kBlockM = kBwdQueriesPerBlock;  // 4 warps x 16 queries
  static_assert(kBlockM == 64, "4 warps own 16 queries each");
  constexpr int kStride = D + 8;
  constexpr int kKT = D / 16;
  constexpr int kNT = kBlockN / 8;
  constexpr int kDT = D / 8;
  constexpr int kFr = kQInRegs ? kKT : 1;
  using Tr = ElemTraits<T>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kStride;
  T* sK = sdO + kBlockM * kStride;     // [2][kBlockN][kStride]
  T* sV = sK + 2 * kBlockN * kStride;  // [2][kBlockN][kStride]

  const SeqSpan seq = p.seqs[blockIdx.y];
  const int s = seq.len;
  const int q0 = static_cast<int>(blockIdx.x) * kBlockM;
  if (q0 >= s) return;
  const VarlenTile<T, D> tile(p, seq);
  const int h = tile.head, warp = tile.warp, lane = tile.lane, g = tile.g, c = tile.c;

  load_rows_async<T, D, kBlockM, kThreads>(sQ, tile.q, q0, s, tile.ld);
  load_rows_async<T, D, kBlockM, kThreads>(sdO, tile.in(p.dout), q0, s, tile.ld);
  load_rows_async<T, D, kBlockN, kThreads>(sK, tile.k, 0, s, tile.ld);
  load_rows_async<T, D, kBlockN, kThreads>(sV, tile.v, 0, s, tile.ld);
  cp_async_commit();

  // lse (base 2) and delta of this thread's rows g, g + 8.
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = q0 + warp * 16 + g + 8 * i;
    const bool ok = r < s;
    const int64_t row = static_cast<int64_t>(seq.start + (ok ? r : 0)) * p.heads + h;
    lse2[i] = ok ? p.lse[row] * kLog2e : INFINITY;
    dl[i] = ok ? p.delta[row] : 0.0f;
  }
  const uint32_t t_row = static_cast<uint32_t>(seq.start + q0 + warp * 16 + g);

  uint32_t qf[kFr][4], df[kFr][4];
  float dq[kDT][4];
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.0f;
  const T* sQw = sQ + (warp * 16 + (lane & 15)) * kStride + (lane >> 4) * 8;
  const T* sdOw = sdO + (warp * 16 + (lane & 15)) * kStride + (lane >> 4) * 8;

  const int nkb = (s + kBlockN - 1) / kBlockN;
  for (int kb = 0; kb < nkb; ++kb) {
    const int st = kb & 1;
    const int j0 = kb * kBlockN;
    if (kb + 1 < nkb) {
      load_rows_async<T, D, kBlockN, kThreads>(sK + (st ^ 1) * kBlockN * kStride, tile.k,
                                               j0 + kBlockN, s, tile.ld);
      load_rows_async<T, D, kBlockN, kThreads>(sV + (st ^ 1) * kBlockN * kStride, tile.v,
                                               j0 + kBlockN, s, tile.ld);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kQInRegs && kb == 0) {
#pragma unroll
      for (int kk = 0; kk < kFr; ++kk) {
        ldmatrix_x4(qf[kk], sQw + kk * 16);
        ldmatrix_x4(df[kk], sdOw + kk * 16);
      }
    }
    const T* ks = sK + st * kBlockN * kStride;
    const T* vs = sV + st * kBlockN * kStride;

    float sc[kNT][4], dp[kNT][4];
    warp_gemm_pair_abt<T, D, kBlockN, kStride, kQInRegs, kFr>(sc, dp, qf, df, sQw, sdOw, ks,
                                                              vs, lane);

    // dS = P (dP Z - delta) into sc; keys past the end have P = 0.
    const int valid = s - j0;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float z0 = 1.0f, z1 = 1.0f;
        if (p.dropout)
          dropout_pair(p, static_cast<uint32_t>(j0 + nt * 8 + 2 * c), t_row + 8u * i,
                       static_cast<uint32_t>(h), &z0, &z1);
        const int col = nt * 8 + 2 * c;
        const float p0 = col < valid ? fast_exp2(sc[nt][2 * i] * p.scale_log2 - lse2[i]) : 0.0f;
        const float p1 =
            col + 1 < valid ? fast_exp2(sc[nt][2 * i + 1] * p.scale_log2 - lse2[i]) : 0.0f;
        sc[nt][2 * i] = p0 * (dp[nt][2 * i] * z0 - dl[i]);
        sc[nt][2 * i + 1] = p1 * (dp[nt][2 * i + 1] * z1 - dl[i]);
      }

    // dQ += dS K: K transposed out of shared memory is the B operand.
#pragma unroll
    for (int kt = 0; kt < kBlockN / 16; ++kt) {
      uint32_t a[4];
      a_fragment<T>(a, sc[2 * kt], sc[2 * kt + 1]);
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        const T* src = ks + (kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + d2 * 16 +
                       (lane >> 4) * 8;
        uint32_t b[4];  // written out: through mma_two_tiles ptxas schedules this loop otherwise
        ldmatrix_x4_trans(b, src);
        mma16816<T>(dq[2 * d2], a, b[0], b[1]);
        mma16816<T>(dq[2 * d2 + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with stage st before it is refilled
  }

  T* sq_w = sQ + warp * 16 * kStride;  // only this warp ever read these rows
  __syncwarp();
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
    for (int i = 0; i < 2; ++i)
      *reinterpret_cast<uint32_t*>(sq_w + (g + 8 * i) * kStride + dt * 8 + 2 * c) =
          Tr::pack(dq[dt][2 * i] * p.scale, dq[dt][2 * i + 1] * p.scale);
  __syncwarp();
  T* gdq = tile.out(p.dq);
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int it = 0; it < 16 * kChunks / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = idx / kChunks, ch = idx % kChunks;
    const int row = q0 + warp * 16 + r;
    if (row < s)
      *reinterpret_cast<uint4*>(gdq + static_cast<int64_t>(row) * tile.ld + ch * 8) =
          *reinterpret_cast<const uint4*>(sq_w + r * kStride + ch * 8);
  }
}

template <typename T, int D>
cudaError_t launch_bwd_delta_dim(const FmhaParams& p, int64_t rows, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 256 / (D / 8);
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (blocks == 0) return cudaSuccess;
  fmha_bwd_delta_kernel<T, D><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const T*>(p.out), static_cast<const T*>(p.dout), p.delta, rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fmha_bwd_delta(const FmhaParams& p, int64_t rows, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return launch_bwd_delta_dim<T, 32>(p, rows, stream);
    case 64:
      return launch_bwd_delta_dim<T, 64>(p, rows, stream);
    case 128:
      return launch_bwd_delta_dim<T, 128>(p, rows, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

template <typename T, int D, int kQM, bool kKVInRegs, int kDqBlockN, bool kQInRegs>
cudaError_t launch_bwd_config(const FmhaParams& p, cudaStream_t stream) {
  constexpr size_t kStrideBytes = (D + 8) * sizeof(T);
  constexpr size_t kSmemDkdv =
      (2 * kBwdKeysPerBlock + 4 * kQM) * kStrideBytes + 4 * kQM * sizeof(float);
  constexpr size_t kSmemDq = (2 * kBwdQueriesPerBlock + 4 * kDqBlockN) * kStrideBytes;
  auto dkdv = fmha_bwd_dkdv_kernel<T, D, kQM, kKVInRegs>;
  auto dq = fmha_bwd_dq_kernel<T, D, kDqBlockN, kQInRegs>;
  cudaError_t e = allow_smem(dkdv, kSmemDkdv);
  if (e != cudaSuccess) return e;
  e = allow_smem(dq, kSmemDq);
  if (e != cudaSuccess) return e;
  const dim3 grid_kv((p.max_len + kBwdKeysPerBlock - 1) / kBwdKeysPerBlock, p.num_seqs, p.heads);
  dkdv<<<grid_kv, 128, kSmemDkdv, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 grid_q((p.max_len + kBwdQueriesPerBlock - 1) / kBwdQueriesPerBlock, p.num_seqs,
                    p.heads);
  dq<<<grid_q, 128, kSmemDq, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fmha_bwd(const FmhaParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      return launch_bwd_config<T, 32, 64, true, 64, true>(p, stream);
    case 64:
      return launch_bwd_config<T, 64, 64, true, 64, true>(p, stream);
    case 128:  // register budget: fragments from shared memory, half-size steps
      return launch_bwd_config<T, 128, 32, false, 32, false>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace paddle_unpad

// Row kernels of the fused encoder operators, compiled once per instruction set.
//
// Included by fused_cpu_<isa>.cc after `#pragma GCC target(...)` with
//   FUSED_ISA         namespace name (avx512, avx2, sse2)
//   FUSED_VLEN        floats per vector register
// GCC vector extensions keep one source for every ISA. fused_cpu.cc schedules rows and
// chunks of rows over the thread pool and reduces the column partials.
//
// Every row is processed with full vectors and one zero-padded tail vector, so a
// column's arithmetic never depends on which work item or thread handles its row.
#ifndef FUSED_ISA
#error "fused_cpu_impl.h is included by fused_cpu_<isa>.cc only"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/common/philox.h"
#include "kernels/cpu/fused_cpu.h"

namespace paddle_unpad {
namespace FUSED_ISA {

constexpr int V = FUSED_VLEN;

#include "kernels/cpu/simd.h"
#define PU_SIMD_VLEN FUSED_VLEN
#include "kernels/cpu/philox_simd.h"

// The first n (< V) elements of p, zeros after them; and the store of those n only.
static inline vf vload_n(const float* p, int64_t n) {
  vf v = vf{};
  for (int64_t e = 0; e < n; ++e) v[e] = p[e];
  return v;
}
static inline void vstore_n(float* p, vf x, int64_t n) {
  for (int64_t e = 0; e < n; ++e) p[e] = x[e];
}
// Lanes [0, n) = 1, the rest 0.
static inline vf vprefix(int64_t n) {
  vf m = vf{};
  for (int64_t e = 0; e < n; ++e) m[e] = 1.0f;
  return m;
}
// Horizontal sum in a fixed order.
static inline float hsum(vf a) {
  float s = 0.0f;
  for (int e = 0; e < V; ++e) s += a[e];
  return s;
}

static inline vf vexp_neg(vf x) { return vexp(x); }  // x <= 0 here

// The pieces of gelu(u) = u * Phi(u) and gelu'(u) = Phi(u) + u * phi(u).
//   z = |u| / sqrt(2);  erfc(z) = exp(-z^2) * erfcx(z);  Phi(-|u|) = erfc(z) / 2.
// erfcx(z) = t * Q(w), t = 1 / (1 + z/2), w = 1 - t = (z/2) t, with Q a degree-10
// polynomial fitted (weighted least squares in Chebyshev form) to erfcx on z in [0, 9]:
// relative error of erfcx < 4e-7 in fp32 arithmetic (< 3e-9 in exact arithmetic), so
// Phi is right to ~1e-7 absolute everywhere and to ~1e-6 relative in the lower tail.
// z is clamped at 9 (erfc(9) = 4e-37: beyond it gelu(u) is below 1e-35).
struct GeluParts {
  vf phi_cdf;  // Phi(u)
  vf e;        // exp(-u^2 / 2) (for the clamped u)
};
static inline GeluParts gelu_parts(vf u) {
  const vf zero = vf{};
  vf z = (u < zero ? -u : u) * 0.70710678118654752f;
  const vf zmax = vsplat(9.0f);
  z = z < zmax ? z : zmax;  // also maps NaN to 9: u * Phi(u) stays NaN through u
  const vf hz = z * 0.5f;
  const vf t = 1.0f / (hz + 1.0f);
  const vf w = hz * t;
  vf q = vsplat(0.03308074548840523f);
  q = q * w - 0.15583020448684692f;
  q = q * w + 0.25315508246421814f;
  q = q * w - 0.15910457074642181f;
  q = q * w + 0.08489914238452911f;
  q = q * w - 0.12125322967767715f;
  q = q * w - 0.0937267318367958f;
  q = q * w + 0.21110624074935913f;
  q = q * w + 0.4865172803401947f;
  q = q * w - 1.2567590475082397f;
  q = q * w + 1.0f;
  const vf e = vexp_neg(-(z * z));
  const vf half_erfc = (e * 0.5f) * (q * t);
  GeluParts g;
  g.phi_cdf = u < zero ? half_erfc : 1.0f - half_erfc;
  g.e = e;
  return g;
}

static inline vf gelu(vf u) { return u * gelu_parts(u).phi_cdf; }

static inline vf gelu_grad(vf u) {
  const GeluParts g = gelu_parts(u);
  return g.phi_cdf + u * g.e * 0.3989422804014327f;  // 1 / sqrt(2 pi)
}

// ---------------------------------------------------------------------------- bias_gelu

void gelu_fwd_rows(int64_t r0, int64_t r1, int64_t cols, const float* x, const float* bias,
                   float* y) {
  const int64_t full = cols - cols % V, tail = cols - full;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    for (int64_t j = 0; j < full; j += V) vstore(yr + j, gelu(vload(xr + j) + vload(bias + j)));
    if (tail)
      vstore_n(yr + full, gelu(vload_n(xr + full, tail) + vload_n(bias + full, tail)), tail);
  }
}

// dx for rows [r0, r1) and their column sums in part[cols] (overwritten).
void gelu_bwd_chunk(int64_t r0, int64_t r1, int64_t cols, const float* x, const float* bias,
                    const float* dy, float* dx, float* part) {
  const int64_t full = cols - cols % V, tail = cols - full;
  std::memset(part, 0, sizeof(float) * cols);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * cols;
    const float* gr = dy + r * cols;
    float* dr = dx + r * cols;
    for (int64_t j = 0; j < full; j += V) {
      const vf d = vload(gr + j) * gelu_grad(vload(xr + j) + vload(bias + j));
      vstore(dr + j, d);
      vstore(part + j, vload(part + j) + d);
    }
    if (tail) {
      const vf d = vload_n(gr + full, tail) *
                   gelu_grad(vload_n(xr + full, tail) + vload_n(bias + full, tail));
      vstore_n(dr + full, d, tail);
      vstore_n(part + full, vload_n(part + full, tail) + d, tail);
    }
  }
}

// ---------------------------------------------------------------------------- dropout words

// Per-row state of the dropout: its words and the multipliers they select.
struct RowDropout {
  bool on;
  vu threshold;
  vf keep_scale;
  const uint32_t* words;
  // Multiplier (0 or 1/(1-p)) of the V columns starting at j.
  inline vf mult(int64_t j) const {
    const vi drop = (vi)(vloadu(words + j) < threshold);
    return drop ? vf{} : keep_scale;
  }
};

// n elements of per-thread scratch, 64-byte aligned (whole-vector accesses never split
// a cache line).
template <typename T>
static inline T* scratch(std::vector<T>& buf, size_t n) {
  const size_t pad = 64 / sizeof(T);
  if (buf.size() < n + pad) buf.resize(n + pad);
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((a + 63) & ~static_cast<uintptr_t>(63));
}

static RowDropout row_dropout(const BdrlnProblem& P, int64_t row, std::vector<uint32_t>& buf) {
  RowDropout d;
  d.on = P.dropout > 0.0f;
  d.words = nullptr;
  if (!d.on) return d;
  const int64_t nblocks = ((P.cols + 4 * L - 1) / (4 * L)) * L;  // whole groups of L blocks
  uint32_t* words = scratch(buf, nblocks * 4);
  // the row-wise layout of common/philox.h: counter (j / 4, row, 0xffffffff, offset)
  philox_words(words, 0, nblocks, static_cast<uint32_t>(row), 0xffffffffu,
               static_cast<uint32_t>(P.offset), P.seed);
  d.words = words;
  d.threshold = vu{} + dropout_threshold(P.dropout);
  d.keep_scale = vsplat(1.0f / (1.0f - P.dropout));
  return d;
}

// ---------------------------------------------------------------------------- layer norm

// z = residual + dropout(x + bias) for the V columns at j (n < V: a zero-padded tail).
template <bool kDrop>
static inline vf pre_norm(const float* xr, const float* bias, const float* rr, const RowDropout& d,
                          int64_t j, int64_t n) {
  vf v = n == V ? vload(xr + j) + vload(bias + j) : vload_n(xr + j, n) + vload_n(bias + j, n);
  if (kDrop) v = v * d.mult(j);
  return (n == V ? vload(rr + j) : vload_n(rr + j, n)) + v;
}

template <bool kDrop>
static void ln_fwd_row(const BdrlnProblem& P, int64_t r, const float* x, const float* bias,
                       const float* residual, const float* w, const float* b, float* y, float* mean,
                       float* rstd, const RowDropout& d) {
  const int64_t F = P.cols, full = F - F % V, tail = F - full;
  const float* xr = x + r * F;
  const float* rr = residual + r * F;
  float* yr = y + r * F;
  // Pass 1: z into y (the row stays in L1), its sum.
  vf s0 = vf{}, s1 = vf{};
  int64_t j = 0;
  for (; j + 2 * V <= full; j += 2 * V) {
    const vf z0 = pre_norm<kDrop>(xr, bias, rr, d, j, V);
    const vf z1 = pre_norm<kDrop>(xr, bias, rr, d, j + V, V);
    vstore(yr + j, z0);
    vstore(yr + j + V, z1);
    s0 += z0;
    s1 += z1;
  }
  for (; j < full; j += V) {
    const vf z0 = pre_norm<kDrop>(xr, bias, rr, d, j, V);
    vstore(yr + j, z0);
    s0 += z0;
  }
  if (tail) {
    const vf z0 = pre_norm<kDrop>(xr, bias, rr, d, full, tail);  // zeros past the row
    vstore_n(yr + full, z0, tail);
    s1 += z0;
  }
  const float mu = hsum(s0 + s1) / static_cast<float>(F);
  // Pass 2: biased variance around the mean (two-pass: no cancellation).
  const vf muv = vsplat(mu);
  vf q0 = vf{}, q1 = vf{};
  for (j = 0; j + 2 * V <= full; j += 2 * V) {
    const vf a = vload(yr + j) - muv, c = vload(yr + j + V) - muv;
    q0 += a * a;
    q1 += c * c;
  }
  for (; j < full; j += V) {
    const vf a = vload(yr + j) - muv;
    q0 += a * a;
  }
  if (tail) {
    const vf a = (vload_n(yr + full, tail) - muv) * vprefix(tail);
    q1 += a * a;
  }
  const float var = hsum(q0 + q1) / static_cast<float>(F);
  const float rs = 1.0f / std::sqrt(var + P.epsilon);
  // Pass 3: normalise and apply the affine transform in place.
  const vf rsv = vsplat(rs);
  for (j = 0; j < full; j += V)
    vstore(yr + j, (vload(yr + j) - muv) * rsv * vload(w + j) + vload(b + j));
  if (tail)
    vstore_n(
        yr + full,
        (vload_n(yr + full, tail) - muv) * rsv * vload_n(w + full, tail) + vload_n(b + full, tail),
        tail);
  mean[r] = mu;
  rstd[r] = rs;
}

void ln_fwd_rows(const BdrlnProblem& P, int64_t r0, int64_t r1, const float* x, const float* bias,
                 const float* residual, const float* w, const float* b, float* y, float* mean,
                 float* rstd) {
  thread_local std::vector<uint32_t> words;
  for (int64_t r = r0; r < r1; ++r) {
    const RowDropout d = row_dropout(P, r, words);
    if (d.on)
      ln_fwd_row<true>(P, r, x, bias, residual, w, b, y, mean, rstd, d);
    else
      ln_fwd_row<false>(P, r, x, bias, residual, w, b, y, mean, rstd, d);
  }
}

template <bool kDrop>
static void ln_bwd_row(const BdrlnProblem& P, int64_t r, const float* x, const float* bias,
                       const float* residual, const float* w, const float* mean, const float* rstd,
                       const float* dy, float* dx, float* dres, float* p_dbias, float* p_dw,
                       float* p_db, float* xhat, float* gwbuf, const RowDropout& d) {
  const int64_t F = P.cols, full = F - F % V, tail = F - full;
  const float* xr = x + r * F;
  const float* rr = residual + r * F;
  const float* gr = dy + r * F;
  const vf muv = vsplat(mean[r]), rsv = vsplat(rstd[r]);
  // Pass 1: xhat and g = dy * w (kept in scratch), sum(g) and sum(g * xhat), and the
  // column partials of dln_weight (dy * xhat) and dln_bias (dy).
  vf sg = vf{}, sgx = vf{};
  const auto step = [&](int64_t j, int64_t n) __attribute__((always_inline)) {
    const vf xh = (pre_norm<kDrop>(xr, bias, rr, d, j, n) - muv) * rsv;
    const vf g = n == V ? vload(gr + j) : vload_n(gr + j, n);  // zero past the row
    const vf gw = g * (n == V ? vload(w + j) : vload_n(w + j, n));
    sg += gw;
    sgx += gw * xh;
    vstore(xhat + j, xh);
    vstore(gwbuf + j, gw);  // rounded once: pass 2 must not re-fuse dy * w into an FMA
    vstore(p_dw + j, vload(p_dw + j) + g * xh);  // scratch rows are padded to whole vectors
    vstore(p_db + j, vload(p_db + j) + g);
  };
  for (int64_t j = 0; j < full; j += V) step(j, V);
  if (tail) step(full, tail);
  const float inv_f = 1.0f / static_cast<float>(F);
  const vf c1 = vsplat(hsum(sg) * inv_f), c2 = vsplat(hsum(sgx) * inv_f);
  // Pass 2: dz = rstd * (g - mean(g) - xhat * mean(g * xhat)); dres = dz; dx = dz * mask.
  float* dxr = dx + r * F;
  float* drr = dres + r * F;
  for (int64_t j = 0; j < full; j += V) {
    const vf dz = (vload(gwbuf + j) - c1 - vload(xhat + j) * c2) * rsv;
    vstore(drr + j, dz);
    const vf dv = kDrop ? dz * d.mult(j) : dz;
    vstore(dxr + j, dv);
    vstore(p_dbias + j, vload(p_dbias + j) + dv);
  }
  if (tail) {
    const vf dz = (vload(gwbuf + full) - c1 - vload(xhat + full) * c2) * rsv;
    vstore_n(drr + full, dz, tail);
    const vf dv = kDrop ? dz * d.mult(full) : dz;
    vstore_n(dxr + full, dv, tail);
    vstore(p_dbias + full, vload(p_dbias + full) + dv);  // the partial rows are padded
  }
}

// Backward of rows [r0, r1); the chunk's column partials p_* (each padded to a multiple
// of V) are overwritten.
void ln_bwd_chunk(const BdrlnProblem& P, int64_t r0, int64_t r1, const float* x, const float* bias,
                  const float* residual, const float* w, const float* mean, const float* rstd,
                  const float* dy, float* dx, float* dres, float* p_dbias, float* p_dw,
                  float* p_db) {
  const int64_t Fp = (P.cols + V - 1) / V * V;
  std::memset(p_dbias, 0, sizeof(float) * Fp);
  std::memset(p_dw, 0, sizeof(float) * Fp);
  std::memset(p_db, 0, sizeof(float) * Fp);
  thread_local std::vector<uint32_t> words;
  thread_local std::vector<float> row_buf;
  float* xhat = scratch(row_buf, 2 * Fp);
  float* gwbuf = xhat + Fp;
  for (int64_t r = r0; r < r1; ++r) {
    const RowDropout d = row_dropout(P, r, words);
    if (d.on)
      ln_bwd_row<true>(P, r, x, bias, residual, w, mean, rstd, dy, dx, dres, p_dbias, p_dw, p_db,
                       xhat, gwbuf, d);
    else
      ln_bwd_row<false>(P, r, x, bias, residual, w, mean, rstd, dy, dx, dres, p_dbias, p_dw, p_db,
                        xhat, gwbuf, d);
  }
}

}  // namespace FUSED_ISA
}  // namespace paddle_unpad

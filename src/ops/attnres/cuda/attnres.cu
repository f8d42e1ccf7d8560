// Block Attention Residuals read on the GPU (ops/attnres/cuda/attnres_cuda.hpp), fp32: the formulas of
// ops/attnres/attnres.cpp (one-shot forward and backward).
//
// Legend: N sources (<= 32), T tokens, d hidden, q = gamma ⊙ w, gn the fused RMSNorm's gain, NT threads per
//         token (blockDim), V floats per vector access (4 when d % 4 == 0 and every pointer is 16-byte aligned,
//         else 1), VPT vectors per thread and row (register path), nb fixed token blocks of the backward
//         (<= kMaxBlocks).
// One block per token at a time. Two paths:
//   register path (N <= 8, d <= 512·VPT·V): thread tid owns columns (k·NT + tid)·V, k < VPT, of every row of
//     the token. All its loads (N sources, and in the backward dh and the N dv[j]) are issued at once into
//     registers, so each byte is read from DRAM once and the block has one memory round trip in flight per
//     token instead of one per source and pass. Per-warp partials of (Σv², q·v[, δ·v]) go to shared memory
//     (double-buffered by token parity: one barrier per token); every warp then finishes the N scores and
//     the softmax itself (lane j holds source j) and the column pass runs from registers.
//   loop path (anything else): per source one pass over its row into per-warp partials, warp 0 finishes the
//     softmax, a last column pass re-reads the sources (L1/L2) and writes h, or dv and the dq partials.
// attnres_norm_*: the register path with the following RMSNorm applied in registers (NORM kernels: a second
// reduction per token); the loop path composes the two ops through a scratch h.
// Backward: nb blocks, each a contiguous token range; dq = Σ_t Σ_j dz_j v_j / r_j accumulates per block
// (registers, or shared memory on the loop path; each thread owns its columns), is written to scratch [nb, d],
// and a second kernel sums it over b in a fixed order (double: strided slices, then a fixed tree), adding
// dq ⊙ gamma to dw and dq ⊙ w to dgamma: reproducible for given T and d.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/reduce.cuh"
#include "ops/attnres/cuda/attnres_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using cu::column_sum;  // core/cuda/reduce.cuh: deterministic warp and column reductions
using cu::warp_max;
using cu::warp_sum;

constexpr int kMaxSources = 32;  // one warp lane per source in the softmax
constexpr int kMaxWarps = 8;     // loop path: NT <= 256
constexpr int kRegMaxSources = 8;     // register path: N is a template argument up to here
constexpr int kRegMaxThreads = 512;   // register path: NT <= 512, so ptxas may use up to 128 registers
constexpr int kRegMaxWarps = kRegMaxThreads / 32;
// The fused-norm kernels hold more rows per thread: NT <= 192 with two blocks per SM, so ptxas may use up to 168
// registers (at 128 the backward needed 384-thread blocks, one per SM: half the tokens in flight).
constexpr int kNormMaxThreads = 192;
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kMaxGrid = 1024;  // forward loop path: blocks loop over tokens, so q is built once per block
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr int kRedCols = 8, kRedSlices = 64;  // dq reduction block: 8 columns (one 32-byte sector) x 64 slices

// Floats a thread may hold per row in the register path, by N: the backward keeps N sources, N dv rows, dh
// and dq ((2N + 2)·E floats), the forward N sources and h; about 96 data registers at most, so the kernels
// stay under 128 registers without spilling.
// Scalar accesses (V = 1) need an address per element, so the backward holds at most 2 of them.
constexpr int bwd_max_elems(int n) { return n <= 2 ? 16 : n <= 5 ? 8 : 4; }
// The fused norm's backward also holds h (rebuilt) and the gain's partial sums: (2N + 4)·E floats.
constexpr int bwd_norm_max_elems(int n) { return n <= 5 ? 8 : 4; }
constexpr int bwd_max_elems_for(int n, bool norm) { return norm ? bwd_norm_max_elems(n) : bwd_max_elems(n); }
constexpr int fwd_max_elems(int n) { return n <= 4 ? 16 : 8; }
constexpr int fwd_norm_max_elems(int n) { return n <= 5 ? 16 : 8; }
constexpr int fwd_max_elems_for(int n, bool norm) { return norm ? fwd_norm_max_elems(n) : fwd_max_elems(n); }
constexpr int bwd_max_vpt(int v) { return v == 1 ? 2 : 4; }
constexpr int fwd_max_vpt(int) { return 4; }

constexpr cu::Checker check{"attnres cuda"};

// Source pointers travel by value in the kernel arguments (the host holds the array).
struct Srcs {
  const float* p[kMaxSources];
};
struct DSrcs {
  float* p[kMaxSources];  // null: that source's gradient is skipped
};
// The RMSNorm that follows a read, fused (attnres_norm_*): y = bf16(h · rstd · gn), rstd = 1/sqrt(mean(h²) + eps).
struct NormFwd {
  const float* gn = nullptr;
  float eps = 0.f;
  __nv_bfloat16* y = nullptr;
  float* rstd = nullptr;
};
// Its backward: dy [T, d] fp32 (the gradient of y), rstd from the forward; dgn partials per token block go to
// dgn_part [nb, d]; dlast (nullable) receives the updated dv[N−1] rounded to bf16.
struct NormBwd {
  const float* gn = nullptr;
  const float* rstd = nullptr;
  const float* dy = nullptr;
  float* dgn_part = nullptr;
  __nv_bfloat16* dlast = nullptr;
  // Deferred closed sources (attnres_flush): δ [T, d] bf16, per token (a_j, dz_j / r_j, dz_j z_j / (r_j² d), 0)
  // for j < closed, and q [d] (block 0 writes it). Null coef: nothing deferred.
  __nv_bfloat16* delta = nullptr;
  float4* coef = nullptr;
  float* qout = nullptr;
  int closed = 0;
};

// ---- device helpers ---------------------------------------------------------------------------------

template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    v[0] = *p;
  }
}
template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V == 4)
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else
    *p = v[0];
}
template <int V>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&lo), u.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}
template <int V>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x)),
                 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
    v[0] = __bfloat162float(*p);
  }
}
template <int V>
__device__ __forceinline__ void zero(float (&v)[V]) {
#pragma unroll
  for (int e = 0; e < V; ++e) v[e] = 0.f;
}

// h = Σ_j a_j x_j over this thread's columns (a_j in lane j of a), in source order.
template <int NS, int VPT, int V>
__device__ __forceinline__ void mix(const float (&x)[NS][VPT][V], float a, float (&h)[VPT][V]) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) zero(h[k]);
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const float aj = __shfl_sync(0xffffffffu, a, j);
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) h[k][e] += aj * x[j][k][e];
  }
}

// q = gamma ⊙ w into shared memory, once per block.
__device__ __forceinline__ void load_query(float* q, const float* w, const float* gamma, int d) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) q[c] = gamma[c] * w[c];
}

// ---- register path ----------------------------------------------------------------------------------

// h = Σ_j a_j v_j with every source row read once into registers. The grid is one resident wave; blocks
// stride over tokens. q (VPT·V floats) stays in registers for the whole kernel.
// NORM: the RMSNorm that follows the read is applied in registers (a second reduction per token, Σh²), and
// its bf16 output and rstd are written instead of (or besides, when h is not null) h.
template <int V, int VPT, int NS, bool NORM>
__global__ void __launch_bounds__(NORM ? kNormMaxThreads : kRegMaxThreads, NORM ? 2 : 1)
    fwd_reg_kernel(Srcs v, int64_t T, int d, const float* w, const float* gamma, float eps, float* h, NormFwd nf) {
  __shared__ float2 red[2][NS][kRegMaxWarps];  // (Σv², q·v) per token parity, source and warp
  __shared__ float red2[2][kRegMaxWarps];      // NORM: Σh² per token parity and warp
  const int tid = threadIdx.x, NT = blockDim.x, warp = tid >> 5, lane = tid & 31, nw = NT >> 5;
  int col[VPT];
  bool ok[VPT];
  float q[VPT][V], gn[NORM ? VPT : 1][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    col[k] = (k * NT + tid) * V;
    ok[k] = col[k] < d;
    float wv[V], gv[V];
    zero(wv), zero(gv);
    if (ok[k]) load<V>(w + col[k], wv), load<V>(gamma + col[k], gv);
#pragma unroll
    for (int e = 0; e < V; ++e) q[k][e] = gv[e] * wv[e];
    if constexpr (NORM) {
      zero(gn[k]);
      if (ok[k]) load<V>(nf.gn + col[k], gn[k]);
    }
  }
  int par = 0;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x, par ^= 1) {
    const int64_t off = t * d;
    float x[NS][VPT][V];
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        zero(x[j][k]);
        if (ok[k]) load<V>(v.p[j] + off + col[k], x[j][k]);
      }
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      float ss = 0.f, qv = 0.f;
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) ss += x[j][k][e] * x[j][k][e], qv += q[k][e] * x[j][k][e];
      ss = warp_sum(ss), qv = warp_sum(qv);
      if (lane == 0) red[par][j][warp] = make_float2(ss, qv);
    }
    // The only barrier per token: red[par] is next written two tokens on, after every warp has passed the
    // barrier of the token in between (and so has finished reading this one).
    __syncthreads();
    float z = -INFINITY;
    if (lane < NS) {
      float2 s = red[par][lane][0];
      for (int i = 1; i < nw; ++i) s.x += red[par][lane][i].x, s.y += red[par][lane][i].y;
      z = s.y * (1.f / sqrtf(s.x / float(d) + eps));
    }
    const float m = warp_max(z);
    const float ex = lane < NS ? expf(z - m) : 0.f;
    const float p = ex * (1.f / warp_sum(ex));
    float o[VPT][V];
    mix(x, p, o);
    if (!NORM || h)
#pragma unroll
      for (int k = 0; k < VPT; ++k)
        if (ok[k]) store<V>(h + off + col[k], o[k]);
    if constexpr (NORM) {
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) ss += o[k][e] * o[k][e];
      ss = warp_sum(ss);
      if (lane == 0) red2[par][warp] = ss;
      __syncthreads();  // red2 is double-buffered like red (two barriers per token now)
      float tot = red2[par][0];
      for (int i = 1; i < nw; ++i) tot += red2[par][i];
      const float r = 1.f / sqrtf(tot / float(d) + nf.eps);
      if (tid == 0) nf.rstd[t] = r;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        float y[V];
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = o[k][e] * r * gn[k][e];
        if (ok[k]) store_bf16<V>(nf.y + off + col[k], y);
      }
    }
  }
}

// Per token, with δ = dh: a = softmax(z), dz_j = a_j (δ·v_j − δ·h) where δ·h = Σ_j a_j δ·v_j, and
//   dv_j += a_j δ + (dz_j / r_j) q − (dz_j z_j / (r_j² d)) v_j,   dq += Σ_j (dz_j / r_j) v_j.
// The dv[j] rows are loaded together with the sources, before the barrier, so their latency hides behind
// the reductions; every element is read before the same thread writes it, so dh or a source may alias dv[j].
// NORM: δ is the RMSNorm's input gradient, made in registers from its output gradient dy (loaded in place of
// dh): with ĝ = gn ⊙ dy and h = Σ_j a_j v_j rebuilt from the sources, δ = rstd·ĝ − rstd³ (ĝ·h / d)·h, where
// ĝ·h = Σ_j a_j ĝ·v_j comes out of the first reduction; δ·v_j needs a second one (two barriers per token).
// DEFER (with NORM): every source but the last is deferred, so only the last one's gradient row is held, and
// the freed registers, with the dq and dgn sums in shared memory, buy a fourth block per SM: the kernel waits on
// memory, so more tokens in flight.
template <int V, int VPT, int NS, bool NORM, bool DEFER = false>
__global__ void __launch_bounds__(NORM ? kNormMaxThreads : kRegMaxThreads, DEFER ? 4 : NORM ? 2 : 1)
    bwd_reg_kernel(Srcs v, DSrcs dv, int64_t T, int d, const float* w, const float* gamma, float eps, const float* dh,
                   float* part, NormBwd nb_) {
  // q [d] (read twice per token rather than held across the barrier); NORM: gn [d]; DEFER: the dq and dgn sums
  // [d] each (in registers otherwise; each thread owns its columns, and the arithmetic is the same)
  extern __shared__ float4 smem_q[];
  __shared__ float red[2][3][NS][kRegMaxWarps];  // Σv², q·v, δ·v (NORM: ĝ·v) per token parity, source and warp
  __shared__ float red2[2][NORM ? NS : 1][kRegMaxWarps];  // NORM: δ·v
  float* q = reinterpret_cast<float*>(smem_q);
  float* gn = q + d;
  float *dq_s = gn + d, *dgn_s = dq_s + d;
  const int tid = threadIdx.x, NT = blockDim.x, warp = tid >> 5, lane = tid & 31, nw = NT >> 5;
  load_query(q, w, gamma, d);
  if constexpr (NORM) {
    for (int c = tid; c < d; c += NT) gn[c] = nb_.gn[c];
    if (nb_.qout && blockIdx.x == 0)
      for (int c = tid; c < d; c += NT) nb_.qout[c] = gamma[c] * w[c];  // the same product as q
  }
  int col[VPT];
  bool ok[VPT];
  float dq[VPT][V], dgn[NORM ? VPT : 1][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    col[k] = (k * NT + tid) * V, ok[k] = col[k] < d, zero(dq[k]);
    if constexpr (NORM) zero(dgn[k]);
    if (DEFER && ok[k]) store<V>(dq_s + col[k], dq[k]), store<V>(dgn_s + col[k], dgn[k]);
  }
  __syncthreads();
  const float inv_d = 1.f / float(d);
  const int64_t b = blockIdx.x, nb = gridDim.x;
  const int64_t t_end = (b + 1) * T / nb;
  const float* din = NORM ? nb_.dy : dh;
  int par = 0;
  for (int64_t t = b * T / nb; t < t_end; ++t, par ^= 1) {
    const int64_t off = t * d;
    float x[NS][VPT][V], g[DEFER ? 1 : NS][VPT][V], de[VPT][V];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      zero(de[k]);
      if (ok[k]) load<V>(din + off + col[k], de[k]);
    }
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        zero(x[j][k]);
        if (ok[k]) load<V>(v.p[j] + off + col[k], x[j][k]);
      }
#pragma unroll
    for (int j = DEFER ? NS - 1 : 0; j < NS; ++j)
      if (const float* gp = dv.p[j])
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          if (ok[k]) load<V>(gp + off + col[k], g[DEFER ? 0 : j][k]);
    float rs = 0.f;  // NORM: the forward's rstd of this token
    if constexpr (NORM) rs = nb_.rstd[t];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      float ss = 0.f, qv = 0.f, dd = 0.f;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        float qq[V], gg[V];
        zero(qq), zero(gg);
        if (ok[k]) {
          load<V>(q + col[k], qq);
          if constexpr (NORM) load<V>(gn + col[k], gg);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xe = x[j][k][e];
          ss += xe * xe, qv += qq[e] * xe, dd += (NORM ? gg[e] * de[k][e] : de[k][e]) * xe;
        }
      }
      ss = warp_sum(ss), qv = warp_sum(qv), dd = warp_sum(dd);
      if (lane == 0) red[par][0][j][warp] = ss, red[par][1][j][warp] = qv, red[par][2][j][warp] = dd;
    }
    __syncthreads();  // red (and red2) are double-buffered, as in the forward
    // Every warp finishes the softmax itself (lane j: source j), in the same order: identical coefficients.
    float z = -INFINITY, ri = 0.f, dd = 0.f;
    if (lane < NS) {
      float ss = red[par][0][lane][0], qv = red[par][1][lane][0];
      dd = red[par][2][lane][0];
      for (int i = 1; i < nw; ++i) ss += red[par][0][lane][i], qv += red[par][1][lane][i], dd += red[par][2][lane][i];
      ri = 1.f / sqrtf(ss / float(d) + eps);
      z = qv * ri;
    }
    const float m = warp_max(z);
    const float ex = lane < NS ? expf(z - m) : 0.f;
    const float a = ex * (1.f / warp_sum(ex));
    if constexpr (NORM) {
      // dd holds ĝ·v_j here: turn dy into δ (see above), then reduce δ·v_j.
      const float c = rs * rs * rs * warp_sum(lane < NS ? a * dd : 0.f) * inv_d;
      float hv[VPT][V];
      mix(x, a, hv);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        float gg[V];
        zero(gg);
        if (ok[k]) load<V>(gn + col[k], gg);
        if (DEFER && ok[k]) load<V>(dgn_s + col[k], dgn[k]);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          dgn[k][e] += de[k][e] * hv[k][e] * rs;
          de[k][e] = rs * gg[e] * de[k][e] - c * hv[k][e];
        }
        if (DEFER && ok[k]) store<V>(dgn_s + col[k], dgn[k]);
      }
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        float s2 = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k)
#pragma unroll
          for (int e = 0; e < V; ++e) s2 += de[k][e] * x[j][k][e];
        s2 = warp_sum(s2);
        if (lane == 0) red2[par][j][warp] = s2;
      }
      __syncthreads();
      dd = 0.f;
      if (lane < NS) {
        dd = red2[par][lane][0];
        for (int i = 1; i < nw; ++i) dd += red2[par][lane][i];
      }
    }
    const float delta_h = warp_sum(lane < NS ? a * dd : 0.f);
    const float dz = a * (dd - delta_h);
    const float cq = dz * ri, cv = lane < NS ? dz * z * ri * ri * inv_d : 0.f;
    if constexpr (NORM)
      if (nb_.coef) {  // deferred: the closed sources' coefficients and δ (their dv[j] are null)
        if (warp == 0 && lane < nb_.closed) nb_.coef[t * nb_.closed + lane] = make_float4(a, cq, cv, 0.f);
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          if (ok[k]) store_bf16<V>(nb_.delta + off + col[k], de[k]);
      }
    float dqa[VPT][V];
#pragma unroll
    for (int k = 0; k < VPT; ++k) zero(dqa[k]);
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      const float aj = __shfl_sync(0xffffffffu, a, j), cqj = __shfl_sync(0xffffffffu, cq, j),
                  cvj = __shfl_sync(0xffffffffu, cv, j);
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) dqa[k][e] += cqj * x[j][k][e];
      float* gp = !DEFER || j == NS - 1 ? dv.p[j] : nullptr;
      float(&gj)[VPT][V] = g[DEFER ? 0 : j];
      if (gp)
#pragma unroll
        for (int k = 0; k < VPT; ++k)
          if (ok[k]) {
            float qq[V];
            load<V>(q + col[k], qq);
#pragma unroll
            for (int e = 0; e < V; ++e) gj[k][e] += aj * de[k][e] + cqj * qq[e] - cvj * x[j][k][e];
            store<V>(gp + off + col[k], gj[k]);
            if (NORM && j == NS - 1 && nb_.dlast) store_bf16<V>(nb_.dlast + off + col[k], gj[k]);
          }
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (DEFER && ok[k]) load<V>(dq_s + col[k], dq[k]);
#pragma unroll
      for (int e = 0; e < V; ++e) dq[k][e] += dqa[k][e];
      if (DEFER && ok[k]) store<V>(dq_s + col[k], dq[k]);
    }
  }
  if constexpr (DEFER)
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (ok[k]) load<V>(dq_s + col[k], dq[k]), load<V>(dgn_s + col[k], dgn[k]);
  if constexpr (NORM)
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (ok[k]) store<V>(nb_.dgn_part + b * d + col[k], dgn[k]);
  if (!part) return;
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    if (ok[k]) store<V>(part + b * d + col[k], dq[k]);
}

// ---- deferred closed-source gradients ----------------------------------------------------------------

constexpr int kMaxReads = int(kAttnResMaxFlushReads);
constexpr int kFlushSources = 4;  // closed sources per pass (more: passes that read the δ_r again)
struct FlushReads {
  const __nv_bfloat16* delta[kMaxReads];
  const float4* coef[kMaxReads];
  const float* q[kMaxReads];
};

// dv_j += Σ_r (a_rj δ_r + c_rj q_r) − (Σ_r e_rj) v_j: elementwise (no reduction over d), so each thread takes
// V columns of one token; a warp's coefficient loads are broadcasts of one token's. The δ rows of kFlushBatch
// reads are loaded together, then the source and gradient rows. (Loading those with the δ rows was slower:
// 123 registers. The kernel is bound by its R·C coefficient and R q loads per item more than by DRAM.)
constexpr int kFlushBatch = 8, kFlushThreads = 128;  // (~92 registers: 128-thread blocks pack the SM best)
template <int V>
__global__ void __launch_bounds__(kFlushThreads) flush_kernel(Srcs v, DSrcs dv, int C, int R, int64_t T, int d,
                                                    const __grid_constant__ FlushReads fr) {
  const int64_t nv = d / V, total = T * nv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / nv, cq = (i - t * nv) * V, off = t * d + cq;
    for (int j0 = 0; j0 < C; j0 += kFlushSources) {
      float acc[kFlushSources][V], cs[kFlushSources];
#pragma unroll
      for (int jj = 0; jj < kFlushSources; ++jj) zero(acc[jj]), cs[jj] = 0.f;
      for (int r0 = 0; r0 < R; r0 += kFlushBatch) {
        using Raw = std::conditional_t<V == 4, uint2, __nv_bfloat16>;  // V bf16, unpacked at use (registers)
        Raw raw[kFlushBatch];
#pragma unroll
        for (int rr = 0; rr < kFlushBatch; ++rr)
          if (r0 + rr < R) raw[rr] = *reinterpret_cast<const Raw*>(fr.delta[r0 + rr] + off);
#pragma unroll
        for (int rr = 0; rr < kFlushBatch; ++rr) {
          if (r0 + rr >= R) break;
          float qq[V], dl[V];
          load<V>(fr.q[r0 + rr] + cq, qq);
          load_bf16<V>(reinterpret_cast<const __nv_bfloat16*>(&raw[rr]), dl);
          const float4* cf = fr.coef[r0 + rr] + t * C + j0;
#pragma unroll
          for (int jj = 0; jj < kFlushSources; ++jj)
            if (j0 + jj < C) {
              const float4 k = cf[jj];
              cs[jj] += k.z;
#pragma unroll
              for (int e = 0; e < V; ++e) acc[jj][e] += k.x * dl[e] + k.y * qq[e];
            }
        }
      }
      float x[kFlushSources][V], g[kFlushSources][V];
#pragma unroll
      for (int jj = 0; jj < kFlushSources; ++jj) {
        zero(x[jj]), zero(g[jj]);
        if (j0 + jj < C && dv.p[j0 + jj]) load<V>(v.p[j0 + jj] + off, x[jj]), load<V>(dv.p[j0 + jj] + off, g[jj]);
      }
#pragma unroll
      for (int jj = 0; jj < kFlushSources; ++jj)
        if (j0 + jj < C && dv.p[j0 + jj]) {
#pragma unroll
          for (int e = 0; e < V; ++e) g[jj][e] += acc[jj][e] - cs[jj] * x[jj][e];
          store<V>(dv.p[j0 + jj] + off, g[jj]);
        }
    }
  }
}

// ---- loop path (N > 8 or very wide d) ---------------------------------------------------------------

template <int V>
__global__ void __launch_bounds__(256) fwd_loop_kernel(Srcs v, int N, int64_t T, int d, const float* w,
                                                       const float* gamma, float eps, float* h) {
  extern __shared__ float4 smem_q[];  // q [d]
  __shared__ float2 red[kMaxSources][kMaxWarps];  // (Σv², q·v) per source and warp
  __shared__ float prob[kMaxSources];
  float* q = reinterpret_cast<float*>(smem_q);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int c0 = threadIdx.x * V, cstep = blockDim.x * V;
  load_query(q, w, gamma, d);
  __syncthreads();
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t off = t * d;
    for (int j = 0; j < N; ++j) {
      const float* vj = v.p[j] + off;
      float ss = 0.f, qv = 0.f;
      for (int c = c0; c < d; c += cstep) {
        float x[V], qq[V];
        load<V>(vj + c, x);
        load<V>(q + c, qq);
#pragma unroll
        for (int k = 0; k < V; ++k) ss += x[k] * x[k], qv += qq[k] * x[k];
      }
      ss = warp_sum(ss), qv = warp_sum(qv);
      if (lane == 0) red[j][warp] = make_float2(ss, qv);
    }
    __syncthreads();
    if (warp == 0) {
      float z = -INFINITY;
      if (lane < N) {
        float2 s = red[lane][0];
        for (int i = 1; i < nw; ++i) s.x += red[lane][i].x, s.y += red[lane][i].y;
        z = s.y * (1.f / sqrtf(s.x / float(d) + eps));
      }
      const float m = warp_max(z);
      const float e = lane < N ? expf(z - m) : 0.f;
      const float sum = warp_sum(e);
      if (lane < N) prob[lane] = e * (1.f / sum);
    }
    __syncthreads();
    // (red and prob are next written only after every thread has passed this token's barriers.)
    for (int c = c0; c < d; c += cstep) {
      float acc[V], x[V];
      load<V>(v.p[0] + off + c, x);
      const float a0 = prob[0];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = a0 * x[k];
      for (int j = 1; j < N; ++j) {
        load<V>(v.p[j] + off + c, x);
        const float aj = prob[j];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += aj * x[k];
      }
      store<V>(h + off + c, acc);
    }
  }
}

// The backward of the loop path (formulas as bwd_reg_kernel); dq accumulates in shared memory.
template <int V>
__global__ void __launch_bounds__(256) bwd_loop_kernel(Srcs v, DSrcs dv, int N, int64_t T, int d, const float* w,
                                                       const float* gamma, float eps, const float* dh, float* part) {
  extern __shared__ float4 smem_qd[];  // q [d], then dq [d] (when part)
  __shared__ float red[3][kMaxSources][kMaxWarps];  // Σv², q·v, δ·v per source and warp
  __shared__ float coef[3][kMaxSources];            // a_j, dz_j / r_j, dz_j z_j / (r_j² d)
  float* q = reinterpret_cast<float*>(smem_qd);
  float* dq = q + d;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int c0 = threadIdx.x * V, cstep = blockDim.x * V;
  load_query(q, w, gamma, d);
  if (part)
    for (int c = c0; c < d; c += cstep)
#pragma unroll
      for (int k = 0; k < V; ++k) dq[c + k] = 0.f;  // the same columns this thread accumulates below
  __syncthreads();
  const float inv_d = 1.f / float(d);
  const int64_t b = blockIdx.x, nb = gridDim.x;
  const int64_t t_end = (b + 1) * T / nb;
  for (int64_t t = b * T / nb; t < t_end; ++t) {
    const int64_t off = t * d;
    const float* delta = dh + off;
    for (int j = 0; j < N; ++j) {
      const float* vj = v.p[j] + off;
      float ss = 0.f, qv = 0.f, dd = 0.f;
      for (int c = c0; c < d; c += cstep) {
        float x[V], qq[V], de[V];
        load<V>(vj + c, x);
        load<V>(q + c, qq);
        load<V>(delta + c, de);
#pragma unroll
        for (int k = 0; k < V; ++k) ss += x[k] * x[k], qv += qq[k] * x[k], dd += de[k] * x[k];
      }
      ss = warp_sum(ss), qv = warp_sum(qv), dd = warp_sum(dd);
      if (lane == 0) red[0][j][warp] = ss, red[1][j][warp] = qv, red[2][j][warp] = dd;
    }
    __syncthreads();
    if (warp == 0) {
      float z = -INFINITY, ri = 0.f, dd = 0.f;
      if (lane < N) {
        float ss = red[0][lane][0], qv = red[1][lane][0];
        dd = red[2][lane][0];
        for (int i = 1; i < nw; ++i) ss += red[0][lane][i], qv += red[1][lane][i], dd += red[2][lane][i];
        ri = 1.f / sqrtf(ss / float(d) + eps);
        z = qv * ri;
      }
      const float m = warp_max(z);
      const float e = lane < N ? expf(z - m) : 0.f;
      const float a = e * (1.f / warp_sum(e));
      const float delta_h = warp_sum(lane < N ? a * dd : 0.f);
      if (lane < N) {
        const float dz = a * (dd - delta_h);
        coef[0][lane] = a;
        coef[1][lane] = dz * ri;
        coef[2][lane] = dz * z * ri * ri * inv_d;
      }
    }
    __syncthreads();
    for (int c = c0; c < d; c += cstep) {
      float de[V], qq[V], dqa[V];
      load<V>(delta + c, de);
      load<V>(q + c, qq);
#pragma unroll
      for (int k = 0; k < V; ++k) dqa[k] = 0.f;
      for (int j = 0; j < N; ++j) {
        float x[V];
        load<V>(v.p[j] + off + c, x);
        const float aj = coef[0][j], cq = coef[1][j], cv = coef[2][j];
#pragma unroll
        for (int k = 0; k < V; ++k) dqa[k] += cq * x[k];
        if (float* g = dv.p[j]) {
          float gv[V];
          load<V>(g + off + c, gv);
#pragma unroll
          for (int k = 0; k < V; ++k) gv[k] += aj * de[k] + cq * qq[k] - cv * x[k];
          store<V>(g + off + c, gv);
        }
      }
      if (part)
#pragma unroll
        for (int k = 0; k < V; ++k) dq[c + k] += dqa[k];
    }
  }
  if (!part) return;
  __syncthreads();
  for (int c = threadIdx.x; c < d; c += blockDim.x) part[b * d + c] = dq[c];
}

// dq[c] = Σ_b part[b, c] (core/cuda/reduce.cuh's column_sum, in a fixed order); dw += dq ⊙ gamma,
// dgamma += dq ⊙ w (or, with dsum, dsum += dq: the fused norm's gain).
__global__ void __launch_bounds__(kRedCols* kRedSlices) dq_reduce_kernel(const float* part, int64_t nb, int d,
                                                                         const float* w, const float* gamma,
                                                                         float* dw, float* dgamma, float* dsum) {
  __shared__ double acc[kRedSlices][kRedCols];
  const int cx = threadIdx.x % kRedCols, s = threadIdx.x / kRedCols;
  const int c = blockIdx.x * kRedCols + cx;
  column_sum(acc, part, nb, d, c, c < d, s, cx);
  if (s != 0 || c >= d) return;
  const float dq = float(acc[0][cx]);
  if (dsum) dsum[c] += dq;
  if (dw) dw[c] += dq * gamma[c];
  if (dgamma) dgamma[c] += dq * w[c];
}

// ---- host side --------------------------------------------------------------------------------------

template <int I>
using Int = std::integral_constant<int, I>;

template <class Fn>
void with_vec(bool vec, Fn&& fn) {
  if (vec)
    fn(Int<4>{});
  else
    fn(Int<1>{});
}
template <class Fn>
void with_vpt(int vpt, Fn&& fn) {
  switch (vpt) {
    case 1: fn(Int<1>{}); break;
    case 2: fn(Int<2>{}); break;
    default: fn(Int<4>{}); break;
  }
}
template <class Fn>
void with_sources(int n, Fn&& fn) {
  switch (n) {
    case 1: fn(Int<1>{}); break;
    case 2: fn(Int<2>{}); break;
    case 3: fn(Int<3>{}); break;
    case 4: fn(Int<4>{}); break;
    case 5: fn(Int<5>{}); break;
    case 6: fn(Int<6>{}); break;
    case 7: fn(Int<7>{}); break;
    default: fn(Int<8>{}); break;
  }
}

// Register-path geometry: VPT (0: use the loop path) and NT. VPT is the largest of 1, 2, 4 that the register
// budget allows (fewer, longer-lived threads: more loads in flight each), but no more than the columns need
// with one warp; NT covers d / V in multiples of 32.
struct RegPlan {
  int vpt = 0, nt = 0;
};
RegPlan reg_plan(int64_t N, int64_t d, int V, int max_elems, int max_vpt, int max_threads = kRegMaxThreads) {
  if (N > kRegMaxSources) return {};
  const int64_t n = d / V;  // vector columns (V = 4 only when d % 4 == 0)
  int vpt = std::min(max_vpt, max_elems / V);
  vpt = int(std::min<int64_t>(vpt, (n + 31) / 32));
  if (vpt == 3) vpt = 4;
  const int64_t nt = ((n + vpt - 1) / vpt + 31) / 32 * 32;
  if (nt > max_threads) return {};
  return {vpt, int(nt)};
}

int pick_threads(int64_t d) {
  int t = 32;
  while (t < 32 * kMaxWarps && int64_t(t) * 8 < d) t *= 2;
  return t;
}
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_args(const char* who, const float* const* v, int64_t N, int64_t T, int64_t d, const float* w,
                const float* gamma, float eps) {
  if (N < 1 || N > kMaxSources) check.fail(std::string(who) + ": need 1 <= N <= 32 sources, got " + std::to_string(N));
  if (T < 0 || d <= 0 || d > (int64_t(1) << 30))
    check.fail(std::string(who) + ": need T >= 0 and 0 < d < 2^30, got T=" + std::to_string(T) + " d=" + std::to_string(d));
  if (!(eps >= 0.f) || !std::isfinite(eps)) check.fail(std::string(who) + ": eps must be finite and >= 0");
  if (!v) check.fail(std::string(who) + ": source array is null");
  for (int64_t j = 0; j < N; ++j)
    if (!v[j]) check.fail(std::string(who) + ": source " + std::to_string(j) + " is null");
  if (!w || !gamma) check.fail(std::string(who) + ": w and gamma are required");
}

// Opts the kernel in to more than the default dynamic shared memory when d needs it.
template <class K>
cudaError_t smem_opt_in(K* kern, size_t bytes) {
  if (bytes <= kDefaultSmem) return cudaSuccess;
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

// Blocks of `kern` resident on the whole device at once (at least 1): the forward's grid.
template <class K>
int64_t resident_blocks(K* kern, int threads, size_t smem) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, threads, smem) != cudaSuccess) return kMaxGrid;
  return std::max<int64_t>(1, int64_t(cu::sm_count()) * per_sm);
}


// y = bf16 of x (the fused backward's fallback for dlast).
__global__ void cast_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

bool aligned8(const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; }

// The read, optionally followed by the fused norm (nf). False when the register path does not apply and nf
// is set (the caller composes the two ops instead).
bool forward_impl(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                  float eps, float* h, const NormFwd* nf, cudaStream_t s) {
  Srcs src{};
  bool vec = d % 4 == 0 && aligned16(w) && aligned16(gamma) && (!h || aligned16(h));
  if (nf) vec = vec && aligned16(nf->gn) && aligned8(nf->y);
  for (int64_t j = 0; j < N; ++j) src.p[j] = v[j], vec = vec && aligned16(v[j]);
  const RegPlan plan =
      reg_plan(N, d, vec ? 4 : 1, fwd_max_elems_for(int(std::min<int64_t>(N, kRegMaxSources)), nf != nullptr),
               fwd_max_vpt(vec ? 4 : 1), nf ? kNormMaxThreads : kRegMaxThreads);
  cudaError_t err = cudaSuccess;
  if (plan.vpt) {
    const NormFwd nfv = nf ? *nf : NormFwd{};
    with_vec(vec, [&](auto vv) {
      with_vpt(plan.vpt, [&](auto vp) {
        with_sources(int(N), [&](auto ns) {
          constexpr int V = decltype(vv)::value, VPT = decltype(vp)::value, NS = decltype(ns)::value;
          auto launch = [&](auto* kern) {
            const int64_t grid = std::min(T, resident_blocks(kern, plan.nt, 0));
            kern<<<unsigned(grid), plan.nt, 0, s>>>(src, T, int(d), w, gamma, eps, h, nfv);
            err = cudaGetLastError();
          };
          // (the other combinations are never planned)
          if (nf) {
            if constexpr (V * VPT <= fwd_norm_max_elems(NS) && VPT <= fwd_max_vpt(V))
              launch(fwd_reg_kernel<V, VPT, NS, true>);
          } else {
            if constexpr (V * VPT <= fwd_max_elems(NS) && VPT <= fwd_max_vpt(V))
              launch(fwd_reg_kernel<V, VPT, NS, false>);
          }
        });
      });
    });
  } else {
    if (nf) return false;
    const int nt = pick_threads(d);
    const unsigned grid = unsigned(std::min<int64_t>(T, kMaxGrid));
    const size_t smem = size_t(d) * sizeof(float);
    with_vec(vec, [&](auto vv) {
      auto* kern = fwd_loop_kernel<decltype(vv)::value>;
      err = smem_opt_in(kern, smem);
      if (err == cudaSuccess) {
        kern<<<grid, nt, smem, s>>>(src, int(N), T, int(d), w, gamma, eps, h);
        err = cudaGetLastError();
      }
    });
  }
  check(err, "forward launch (d too large for shared memory?)");
  return true;
}

// The read's backward from dh, or (nb set) from the fused norm's output gradient. False when nb is set and
// the register path does not apply (the caller composes the two ops instead).
bool backward_impl(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                   float eps, const float* dh, float* const* dv, float* dw, float* dgamma, const NormBwd* nb,
                   float* dgn, cudaStream_t s) {
  Srcs src{};
  DSrcs dsrc{};
  bool vec = d % 4 == 0 && aligned16(w) && aligned16(gamma) && (nb ? aligned16(nb->dy) && aligned16(nb->gn) &&
                                                                         (!nb->dlast || aligned8(nb->dlast))
                                                                    : aligned16(dh));
  const int64_t closed = nb && nb->coef ? nb->closed : 0;  // deferred: their dv[j] stay untouched
  for (int64_t j = 0; j < N; ++j) {
    src.p[j] = v[j];
    dsrc.p[j] = dv && j >= closed ? dv[j] : nullptr;
    vec = vec && aligned16(src.p[j]) && aligned16(dsrc.p[j]);
  }
  if (closed) vec = vec && aligned8(nb->delta) && aligned16(nb->coef);
  // Everything but the last source deferred, vector accesses: the DEFER kernel (dq, dgn sums in shared memory).
  const bool defer_kernel = closed > 0 && closed == N - 1 && vec;
  const bool want_dq = dw || dgamma;
  const int64_t nblk = std::min<int64_t>(T, kMaxBlocks);
  const int Nc = int(std::min<int64_t>(N, kRegMaxSources));
  const RegPlan plan = reg_plan(N, d, vec ? 4 : 1, bwd_max_elems_for(Nc, nb != nullptr), bwd_max_vpt(vec ? 4 : 1),
                                nb ? kNormMaxThreads : kRegMaxThreads);
  if (nb && !plan.vpt) {
    if (closed) check.fail("attnres_norm_backward: deferral needs the register path (see attnres_can_defer)");
    return false;
  }
  float* part = nullptr;  // dq partials [nblk, d], then (nb) the norm gain's [nblk, d]
  const size_t part_floats = size_t(nblk) * d * ((want_dq ? 1 : 0) + (nb ? 1 : 0));
  if (part_floats) check(cu::malloc_async(&part, part_floats * sizeof(float), s), "scratch");
  float* dq_part = want_dq ? part : nullptr;
  NormBwd nbv = nb ? *nb : NormBwd{};
  if (nb) nbv.dgn_part = part + (want_dq ? size_t(nblk) * d : 0);
  cudaError_t err = cudaSuccess;
  bool launched = false;
  if (plan.vpt) {
    const size_t smem = size_t(defer_kernel ? 4 : nb ? 2 : 1) * size_t(d) * sizeof(float);  // q (gn, dq, dgn)
    with_vec(vec, [&](auto vv) {
      with_vpt(plan.vpt, [&](auto vp) {
        with_sources(int(N), [&](auto ns) {
          constexpr int V = decltype(vv)::value, VPT = decltype(vp)::value, NS = decltype(ns)::value;
          auto launch = [&](auto* kern) {
            launched = true;
            err = smem_opt_in(kern, smem);
            if (err == cudaSuccess) {
              kern<<<unsigned(nblk), plan.nt, smem, s>>>(src, dsrc, T, int(d), w, gamma, eps, dh, dq_part, nbv);
              err = cudaGetLastError();
            }
          };
          // (the other combinations are never planned)
          if (defer_kernel) {
            if constexpr (V == 4 && V * VPT <= bwd_norm_max_elems(NS) && VPT <= bwd_max_vpt(V) && NS >= 2)
              launch(bwd_reg_kernel<V, VPT, NS, true, true>);
          } else if (nb) {
            if constexpr (V * VPT <= bwd_norm_max_elems(NS) && VPT <= bwd_max_vpt(V))
              launch(bwd_reg_kernel<V, VPT, NS, true>);
          } else {
            if constexpr (V * VPT <= bwd_max_elems(NS) && VPT <= bwd_max_vpt(V))
              launch(bwd_reg_kernel<V, VPT, NS, false>);
          }
        });
      });
    });
    if (!launched) check.fail("backward: no register-path kernel for this plan (internal)");
  } else {
    const int nt = pick_threads(d);
    const size_t smem = size_t(want_dq ? 2 : 1) * size_t(d) * sizeof(float);
    with_vec(vec, [&](auto vv) {
      auto* kern = bwd_loop_kernel<decltype(vv)::value>;
      err = smem_opt_in(kern, smem);
      if (err == cudaSuccess) {
        kern<<<unsigned(nblk), nt, smem, s>>>(src, dsrc, int(N), T, int(d), w, gamma, eps, dh, dq_part);
        err = cudaGetLastError();
      }
    });
  }
  const unsigned red_grid = unsigned((d + kRedCols - 1) / kRedCols);
  if (err == cudaSuccess && want_dq) {
    dq_reduce_kernel<<<red_grid, kRedCols * kRedSlices, 0, s>>>(dq_part, nblk, int(d), w, gamma, dw, dgamma, nullptr);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && nb && dgn) {
    dq_reduce_kernel<<<red_grid, kRedCols * kRedSlices, 0, s>>>(nbv.dgn_part, nblk, int(d), nullptr, nullptr, nullptr,
                                                                nullptr, dgn);
    err = cudaGetLastError();
  }
  if (part) {
    const cudaError_t e2 = cudaFreeAsync(part, s);
    if (err == cudaSuccess) err = e2;
  }
  check(err, "backward launch (d too large for shared memory?)");
  return true;
}

void check_norm_args(const char* who, const float* gn, float eps_n) {
  if (!gn) check.fail(std::string(who) + ": the norm gain gn is required");
  if (!(eps_n >= 0.f) || !std::isfinite(eps_n)) check.fail(std::string(who) + ": eps_n must be finite and >= 0");
}

}  // namespace

void attnres_forward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                     float eps, float* h, void* stream) {
  check_args("attnres_forward", v, N, T, d, w, gamma, eps);
  if (T == 0) return;
  if (!h) check.fail("attnres_forward: h is required");
  forward_impl(v, N, T, d, w, gamma, eps, h, nullptr, lm::cu::stream(stream));
}

void attnres_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                      float eps, const float* dh, float* const* dv, float* dw, float* dgamma, void* stream) {
  check_args("attnres_backward", v, N, T, d, w, gamma, eps);
  if (T == 0) return;
  if (!dh) check.fail("attnres_backward: dh is required");
  backward_impl(v, N, T, d, w, gamma, eps, dh, dv, dw, dgamma, nullptr, nullptr, lm::cu::stream(stream));
}

void attnres_norm_forward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                          float eps, const float* gn, float eps_n, void* y, float* rstd, float* h, void* stream) {
  check_args("attnres_norm_forward", v, N, T, d, w, gamma, eps);
  check_norm_args("attnres_norm_forward", gn, eps_n);
  if (T == 0) return;
  if (!y || !rstd) check.fail("attnres_norm_forward: y and rstd are required");
  auto s = lm::cu::stream(stream);
  NormFwd nf;
  nf.gn = gn, nf.eps = eps_n, nf.y = static_cast<__nv_bfloat16*>(y), nf.rstd = rstd;
  if (forward_impl(v, N, T, d, w, gamma, eps, h, &nf, s)) return;
  // Loop path: the two ops in turn through h (a scratch one when the caller does not want it).
  float* hh = h;
  if (!hh) check(cu::malloc_async(&hh, size_t(T) * d * sizeof(float), s), "scratch");
  forward_impl(v, N, T, d, w, gamma, eps, hh, nullptr, s);
  rmsnorm_forward(hh, DType::F32, gn, y, rstd, T, d, eps_n, 0, 0, stream);
  if (!h) check(cudaFreeAsync(hh, s), "scratch");
}

void attnres_norm_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w,
                           const float* gamma, float eps, const float* gn, float eps_n, const float* rstd,
                           const float* dy, float* const* dv, float* dw, float* dgamma, float* dgn, void* dlast,
                           void* stream, const AttnResDeferred* defer) {
  check_args("attnres_norm_backward", v, N, T, d, w, gamma, eps);
  check_norm_args("attnres_norm_backward", gn, eps_n);
  if (T == 0) return;
  if (!rstd || !dy) check.fail("attnres_norm_backward: rstd and dy are required");
  if (dlast && (!dv || !dv[N - 1])) check.fail("attnres_norm_backward: dlast needs the last source's gradient dv[N-1]");
  auto s = lm::cu::stream(stream);
  NormBwd nb;
  nb.gn = gn, nb.rstd = rstd, nb.dy = dy, nb.dlast = static_cast<__nv_bfloat16*>(dlast);
  if (defer) {
    if (defer->closed < 1 || defer->closed >= N)
      check.fail("attnres_norm_backward: need 1 <= closed < N deferred sources, got " + std::to_string(defer->closed));
    if (!defer->delta || !defer->coef || !defer->q) check.fail("attnres_norm_backward: deferral needs delta, coef and q");
    nb.delta = static_cast<__nv_bfloat16*>(defer->delta), nb.coef = reinterpret_cast<float4*>(defer->coef);
    nb.qout = defer->q, nb.closed = int(defer->closed);
  }
  if (backward_impl(v, N, T, d, w, gamma, eps, nullptr, dv, dw, dgamma, &nb, dgn, s)) return;
  // Loop path: rebuild h, the norm's backward into a scratch dh, then the read's backward.
  const size_t n = size_t(T) * d;
  float* scratch = nullptr;
  check(cu::malloc_async(&scratch, 2 * n * sizeof(float), s), "scratch");
  float *h = scratch, *dh = scratch + n;
  forward_impl(v, N, T, d, w, gamma, eps, h, nullptr, s);
  rmsnorm_backward(h, DType::F32, gn, rstd, dy, DType::F32, dh, DType::F32, dgn, T, d, eps_n, 0, 0, false, 0, stream);
  backward_impl(v, N, T, d, w, gamma, eps, dh, dv, dw, dgamma, nullptr, nullptr, s);
  if (dlast) {
    cast_bf16_kernel<<<unsigned(std::min<int64_t>((int64_t(n) + 255) / 256, 4096)), 256, 0, s>>>(
        dv[N - 1], static_cast<__nv_bfloat16*>(dlast), int64_t(n));
    check(cudaGetLastError(), "cast launch");
  }
  check(cudaFreeAsync(scratch, s), "scratch");
}

bool attnres_can_defer(int64_t N, int64_t d) {
  if (N < 2 || d <= 0 || d % 4) return false;
  const int Nc = int(std::min<int64_t>(N, kRegMaxSources));
  return reg_plan(N, d, 4, bwd_norm_max_elems(Nc), bwd_max_vpt(4), kNormMaxThreads).vpt != 0;
}

void attnres_flush(const float* const* v, int64_t C, int64_t T, int64_t d, const AttnResDeferred* reads, int64_t R,
                   float* const* dv, void* stream) {
  if (C < 1 || C > kMaxSources) check.fail("attnres_flush: need 1 <= C <= 32 closed sources, got " + std::to_string(C));
  if (R < 0 || R > kMaxReads)
    check.fail("attnres_flush: need 0 <= R <= " + std::to_string(kMaxReads) + " reads, got " + std::to_string(R));
  if (T < 0 || d <= 0 || d > (int64_t(1) << 30)) check.fail("attnres_flush: need T >= 0 and 0 < d < 2^30");
  if (!v || !dv || (R && !reads)) check.fail("attnres_flush: source, gradient and read arrays are required");
  Srcs src{};
  DSrcs dsrc{};
  FlushReads fr{};
  bool vec = d % 4 == 0;
  for (int64_t j = 0; j < C; ++j) {
    if (!v[j]) check.fail("attnres_flush: source " + std::to_string(j) + " is null");
    src.p[j] = v[j], dsrc.p[j] = dv[j];
    vec = vec && aligned16(v[j]) && aligned16(dv[j]);
  }
  for (int64_t r = 0; r < R; ++r) {
    const AttnResDeferred& a = reads[r];
    if (a.closed != C)
      check.fail("attnres_flush: read " + std::to_string(r) + " deferred " + std::to_string(a.closed) + " sources, not " +
           std::to_string(C));
    if (!a.delta || !a.coef || !a.q) check.fail("attnres_flush: read " + std::to_string(r) + " lacks delta, coef or q");
    fr.delta[r] = static_cast<const __nv_bfloat16*>(a.delta), fr.coef[r] = reinterpret_cast<const float4*>(a.coef);
    fr.q[r] = a.q;
    vec = vec && aligned8(a.delta) && aligned16(a.q);
  }
  if (T == 0 || R == 0) return;
  auto s = lm::cu::stream(stream);
  cudaError_t err = cudaSuccess;
  with_vec(vec, [&](auto vv) {
    constexpr int V = decltype(vv)::value;
    auto* kern = flush_kernel<V>;
    const int64_t work = T * (d / V);
    const int64_t grid = std::min((work + kFlushThreads - 1) / kFlushThreads, resident_blocks(kern, kFlushThreads, 0));
    kern<<<unsigned(grid), kFlushThreads, 0, s>>>(src, dsrc, int(C), int(R), T, int(d), fr);
    err = cudaGetLastError();
  });
  check(err, "flush launch");
}

}  // namespace lm::ops::cuda

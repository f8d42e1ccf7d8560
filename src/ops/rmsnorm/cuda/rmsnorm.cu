// RMSNorm on the GPU (ops/rmsnorm/cuda/rmsnorm_cuda.hpp): plain forward/backward with dtype and stride
// options, and the gated per-head KDA output form. The formulas of ops/rmsnorm/rmsnorm.cpp, in fp32.
//
// Legend: rows independent vectors, D normalised width, ld* row strides in elements, TPR threads per row,
//         R rows per block at a time (one per TPR-thread group), V elements per vector access (4 when D, the
//         strides and every pointer allow it, else 1), VPT vectors per thread and row (register path), nb
//         fixed row blocks of the backward (<= kMaxBlocks), s = sigmoid(gate).
// Forward: one row per TPR-thread group (TPR a power of two in [32, 256], about D / 8, R = 256 / TPR); pass 1
//   sums x², pass 2 re-reads x (from L1/L2) and writes y.
// Backward: nb blocks, each a contiguous row range; per row one group reduction of (Σx², Σ w·dy·x), then the
//   dx (and dgate) pass. The dw partials Σ dy·n stay per thread (each owns its columns, so no atomics), are
//   summed over the R groups in order into scratch [nb, D], and a second kernel adds Σ_b in a fixed order (in
//   double) to dw. nb depends on rows and D only, so dw is reproducible. Two kernels:
//   register path (D <= 2048·V): lane l of a group owns columns (k·TPR + l)·V, k < VPT (TPR a multiple of 32
//     covering D / (V·VPT), VPT <= 4); x and dy (and the old dx, or the gate) are read once into registers
//     before the reduction, so each row costs one memory round trip and is never re-read; dw partials live in
//     registers.
//   loop path (wider D): TPR a power of two as in the forward; pass 2 re-reads x and dy from L1/L2 and the dw
//     partials accumulate in shared memory [R, D].
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/pdl.cuh"
#include "core/cuda/stream.hpp"
#include "core/cuda/reduce.cuh"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using cu::column_sum;  // core/cuda/reduce.cuh: deterministic warp and column reductions
using cu::warp_sum;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;  // about one wave of 256-thread blocks on an H200 (132 SMs x 8)
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr int kRegMaxThreads = 512;  // register path: TPR <= 512, so ptxas may use up to 128 registers
constexpr int kRedCols = 8, kRedSlices = 64;  // dw reduction block: 8 columns (one 32-byte sector) x 64 slices

constexpr cu::Checker check{"rmsnorm cuda"};

// ---- device helpers ---------------------------------------------------------------------------------

// V consecutive elements at p[i] as float; `bf` picks bf16 or fp32 storage (uniform over a launch, so the
// branch costs nothing next to the memory traffic and spares a template axis per tensor).
template <int V>
__device__ __forceinline__ void load(const void* p, bool bf, int64_t i, float (&v)[V]) {
  if constexpr (V == 4) {
    if (bf) {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(p) + i);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    }
  } else {
    static_assert(V == 1, "V is 1 or 4");
    v[0] = bf ? __bfloat162float(static_cast<const bf16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
}

template <int V>
__device__ __forceinline__ void store(void* p, bool bf, int64_t i, const float (&v)[V]) {
  if constexpr (V == 4) {
    if (bf) {
      uint2 u;
      *reinterpret_cast<__nv_bfloat162*>(&u.x) = __floats2bfloat162_rn(v[0], v[1]);
      *reinterpret_cast<__nv_bfloat162*>(&u.y) = __floats2bfloat162_rn(v[2], v[3]);
      *reinterpret_cast<uint2*>(static_cast<bf16*>(p) + i) = u;
    } else {
      *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
  } else {
    if (bf)
      static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v[0]);
    else
      static_cast<float*>(p)[i] = v[0];
  }
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// Sum of (a, b) over the TPR threads of a row group, returned to all of them. Every thread of the block must
// call it (it may synchronise the block). Fixed butterfly and warp order: deterministic.
template <int TPR>
__device__ __forceinline__ float2 group_sum(float2 v, float2* red) {
  v = warp_sum(v);
  if constexpr (TPR > 32) {
    constexpr int W = TPR / 32;
    const int warp = threadIdx.x >> 5, first = warp / W * W;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    float2 s = red[first];
#pragma unroll
    for (int i = 1; i < W; ++i) s.x += red[first + i].x, s.y += red[first + i].y;
    __syncthreads();  // red is reused by the next call
    return s;
  } else {
    return v;
  }
}

// ---- kernels ----------------------------------------------------------------------------------------

// y = bf16((x·rstd)·w), or the gated out = bf16(((x·rstd)·w)·s) (x bf16 then).
template <int TPR, int V, bool GATED>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const void* x, bool xbf, const bf16* gate, const float* w,
                                                       bf16* y, float* rstd, int64_t rows, int D, int64_t ldx,
                                                       int64_t ldy, float eps) {
  lm::cu::pdl_launch_dependents();  // the next projection may start streaming its weights (core/cuda/pdl.cuh)
  __shared__ float2 red[kThreads / 32];
  constexpr int R = kThreads / TPR;
  const int lane = threadIdx.x % TPR;
  const int64_t r = int64_t(blockIdx.x) * R + threadIdx.x / TPR;
  const bool ok = r < rows;
  float ss = 0.f;
  if (ok)
    for (int c = lane * V; c < D; c += TPR * V) {
      float xv[V];
      load<V>(x, xbf, r * ldx + c, xv);
#pragma unroll
      for (int k = 0; k < V; ++k) ss += xv[k] * xv[k];
    }
  ss = group_sum<TPR>(make_float2(ss, 0.f), red).x;
  if (!ok) return;
  const float rs = 1.f / sqrtf(ss / float(D) + eps);
  if (rstd && lane == 0) rstd[r] = rs;
  for (int c = lane * V; c < D; c += TPR * V) {
    float xv[V], wv[V], o[V];
    load<V>(x, xbf, r * ldx + c, xv);
    load<V>(w, false, c, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = (xv[k] * rs) * wv[k];  // the reference's order: n first, then · w
    if constexpr (GATED) {
      float gv[V];
      load<V>(gate, true, r * ldx + c, gv);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] *= sigmoid(gv[k]);
    }
    store<V>(y, true, r * ldy + c, o);
  }
}

struct BwdArgs {
  const void* x;
  const float* w;
  const float* rstd;   // nullable: recomputed from x
  const void* dy;      // plain: dy (ldy); gated: dout, fp32 [rows, D]
  const bf16* gate;    // gated only
  void* dx;
  bf16* dgate;         // gated only
  float* part;         // [nb, D] dw partials, or null
  int64_t rows, ldx, ldy, lddx;
  int D;
  float eps;
  bool xbf, dybf, dxbf, acc;
};

// Plain: dy as given. Gated: dy = dout·s, and dgate = dout·(n·w)·s·(1-s). Then
// dx = rstd·(w·dy − n·c) with c = rstd·Σ(w·dy·x) / D, and the block's dw partial += dy·n.
template <int TPR, int V, bool GATED>
__global__ void __launch_bounds__(kThreads) bwd_kernel(BwdArgs a) {
  extern __shared__ float4 smem_dw[];  // [R, D] dw partials of this block (when a.part)
  __shared__ float2 red[kThreads / 32];
  constexpr int R = kThreads / TPR;
  const int g = threadIdx.x / TPR, lane = threadIdx.x % TPR, D = a.D;
  float* mine = reinterpret_cast<float*>(smem_dw) + int64_t(g) * D;
  if (a.part)
    for (int c = lane * V; c < D; c += TPR * V)
#pragma unroll
      for (int k = 0; k < V; ++k) mine[c + k] = 0.f;
  const int64_t b = blockIdx.x, nb = gridDim.x;
  const int64_t r_begin = b * a.rows / nb, r_end = (b + 1) * a.rows / nb;
  // Same trip count for every group of the block (group_sum synchronises it).
  for (int64_t r0 = r_begin; r0 < r_end; r0 += R) {
    const int64_t r = r0 + g;
    const bool ok = r < r_end;
    float ss = 0.f, gx = 0.f;
    if (ok)
      for (int c = lane * V; c < D; c += TPR * V) {
        float xv[V], dyv[V], wv[V];
        load<V>(a.x, a.xbf, r * a.ldx + c, xv);
        load<V>(a.dy, a.dybf, r * a.ldy + c, dyv);
        load<V>(a.w, false, c, wv);
        if constexpr (GATED) {
          float gv[V];
          load<V>(a.gate, true, r * a.ldx + c, gv);
#pragma unroll
          for (int k = 0; k < V; ++k) dyv[k] *= sigmoid(gv[k]);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) ss += xv[k] * xv[k], gx += wv[k] * dyv[k] * xv[k];
      }
    const float2 s = group_sum<TPR>(make_float2(ss, gx), red);
    if (!ok) continue;
    const float rs = a.rstd ? a.rstd[r] : 1.f / sqrtf(s.x / float(D) + a.eps);
    const float cc = s.y * rs / float(D);
    // Every element is read before it is written by the same thread: dx may alias dy (or y alias x).
    for (int c = lane * V; c < D; c += TPR * V) {
      float xv[V], dyv[V], wv[V], dxv[V];
      load<V>(a.x, a.xbf, r * a.ldx + c, xv);
      load<V>(a.dy, a.dybf, r * a.ldy + c, dyv);
      load<V>(a.w, false, c, wv);
      if constexpr (GATED) {
        float gv[V], dg[V];
        load<V>(a.gate, true, r * a.ldx + c, gv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float sg = sigmoid(gv[k]), n = xv[k] * rs;
          dg[k] = dyv[k] * (n * wv[k]) * sg * (1.f - sg);
          dyv[k] *= sg;
        }
        store<V>(a.dgate, true, r * a.ldx + c, dg);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float n = xv[k] * rs;
        dxv[k] = rs * (wv[k] * dyv[k] - n * cc);
        if (a.part) mine[c + k] += dyv[k] * n;
      }
      if (a.acc) {
        float old[V];
        load<V>(a.dx, false, r * a.lddx + c, old);
#pragma unroll
        for (int k = 0; k < V; ++k) dxv[k] += old[k];
      }
      store<V>(a.dx, a.dxbf, r * a.lddx + c, dxv);
    }
  }
  if (!a.part) return;
  __syncthreads();
  const float* all = reinterpret_cast<const float*>(smem_dw);
  for (int j = threadIdx.x; j < D; j += kThreads) {
    float s = all[j];
    for (int i = 1; i < R; ++i) s += all[int64_t(i) * D + j];
    a.part[b * D + j] = s;
  }
}

// Backward, register path (formulas as bwd_kernel; GATED: the gate row is read with x and held as s). Every
// element is read before the same thread writes it, so dx may alias dy. The group reduction goes through shared
// memory only when a row spans several warps; red is double-buffered by iteration parity, so one barrier per row
// suffices. The dw partials stay in
// registers (a thread's columns are the same for every row of its group).
template <int V, int VPT, bool ACC, bool GATED = false>
__global__ void __launch_bounds__(kRegMaxThreads) bwd_reg_kernel(BwdArgs a, int tpr) {
  extern __shared__ float4 smem_w[];  // w [D], then the running dw sum over groups [D] (when R > 1 and a.part)
  __shared__ float2 red[2][kRegMaxThreads / 32];
  const int D = a.D, tid = threadIdx.x, R = blockDim.x / tpr, g = tid / tpr, lt = tid - g * tpr;
  const int warp = tid >> 5, W = tpr >> 5, first = g * W;
  float* ws = reinterpret_cast<float*>(smem_w);
  float* wsum = ws + D;
  for (int c = tid; c < D; c += blockDim.x) ws[c] = a.w[c];
  int col[VPT];
  bool ok[VPT];
  float dw[VPT][V];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    col[k] = (k * tpr + lt) * V, ok[k] = col[k] < D;
#pragma unroll
    for (int e = 0; e < V; ++e) dw[k][e] = 0.f;
  }
  __syncthreads();
  const int64_t b = blockIdx.x, nb = gridDim.x;
  const int64_t r_begin = b * a.rows / nb, r_end = (b + 1) * a.rows / nb;
  int par = 0;
  // Same trip count for every group of the block (the barrier below).
  for (int64_t r0 = r_begin; r0 < r_end; r0 += R, par ^= 1) {
    const int64_t r = r0 + g;
    const bool okr = r < r_end;
    float xv[VPT][V], dyv[VPT][V], old[VPT][V], sg[GATED ? VPT : 1][V];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xv[k][e] = dyv[k][e] = old[k][e] = 0.f;
        if constexpr (GATED) sg[k][e] = 0.f;
      }
      if (okr && ok[k]) {
        load<V>(a.x, a.xbf, r * a.ldx + col[k], xv[k]);
        load<V>(a.dy, a.dybf, r * a.ldy + col[k], dyv[k]);
        if constexpr (ACC) load<V>(a.dx, false, r * a.lddx + col[k], old[k]);
        if constexpr (GATED) load<V>(a.gate, true, r * a.ldx + col[k], sg[k]);
      }
      if constexpr (GATED)
#pragma unroll
        for (int e = 0; e < V; ++e) sg[k][e] = sigmoid(sg[k][e]);  // (rows past the end: σ(0))
    }
    const float rs_in = okr && a.rstd ? a.rstd[r] : 0.f;
    float ss = 0.f, gx = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float wv[V];
      load<V>(ws, false, ok[k] ? col[k] : 0, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float dye = GATED ? dyv[k][e] * sg[k][e] : dyv[k][e];
        ss += xv[k][e] * xv[k][e], gx += wv[e] * dye * xv[k][e];
      }
    }
    const float2 t = warp_sum(make_float2(ss, gx));
    ss = t.x, gx = t.y;
    if (W > 1) {  // block-uniform
      if ((tid & 31) == 0) red[par][warp] = make_float2(ss, gx);
      __syncthreads();
      float2 s = red[par][first];
      for (int i = 1; i < W; ++i) s.x += red[par][first + i].x, s.y += red[par][first + i].y;
      ss = s.x, gx = s.y;
    }
    if (!okr) continue;
    const float rs = a.rstd ? rs_in : 1.f / sqrtf(ss / float(D) + a.eps);
    const float cc = gx * rs / float(D);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (!ok[k]) continue;
      float wv[V], dxv[V], dg[V];
      load<V>(ws, false, col[k], wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float n = xv[k][e] * rs;
        float dye = dyv[k][e];
        if constexpr (GATED) {
          const float s1 = sg[k][e];
          dg[e] = dye * (n * wv[e]) * s1 * (1.f - s1);
          dye *= s1;
        }
        dxv[e] = rs * (wv[e] * dye - n * cc);
        if constexpr (ACC) dxv[e] += old[k][e];
        dw[k][e] += dye * n;
      }
      if constexpr (GATED) store<V>(a.dgate, true, r * a.ldx + col[k], dg);
      store<V>(a.dx, a.dxbf, r * a.lddx + col[k], dxv);
    }
  }
  if (!a.part) return;
  // Groups add their partials in order 0..R-1; the last one writes the block's row of part.
  for (int i = 0; i < R; ++i) {
    if (g == i)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        if (!ok[k]) continue;
        float s[V];
#pragma unroll
        for (int e = 0; e < V; ++e) s[e] = i == 0 ? dw[k][e] : wsum[col[k] + e] + dw[k][e];
        if (i == R - 1)
          store<V>(a.part, false, b * D + col[k], s);
        else
          store<V>(wsum, false, col[k], s);
      }
    if (i + 1 < R) __syncthreads();
  }
}

// dw[j] += Σ_b part[b, j] (core/cuda/reduce.cuh's column_sum, in a fixed order).
__global__ void __launch_bounds__(kRedCols* kRedSlices) dw_reduce_kernel(const float* part, int64_t nb, int D,
                                                                         float* dw) {
  __shared__ double acc[kRedSlices][kRedCols];
  const int cx = threadIdx.x % kRedCols, s = threadIdx.x / kRedCols;
  const int j = blockIdx.x * kRedCols + cx;
  column_sum(acc, part, nb, D, j, j < D, s, cx);
  if (s == 0 && j < D) dw[j] += float(acc[0][cx]);
}

// ---- host side --------------------------------------------------------------------------------------

int pick_tpr(int64_t D) {
  int t = 32;
  while (t < kThreads && int64_t(t) * 8 < D) t *= 2;
  return t;
}

template <class Fn>
void with_tpr(int tpr, Fn&& fn) {
  switch (tpr) {
    case 32: fn(std::integral_constant<int, 32>{}); break;
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    default: fn(std::integral_constant<int, 256>{}); break;
  }
}
template <class Fn>
void with_vec(bool vec, Fn&& fn) {
  if (vec)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, 1>{});
}

bool is_bf16(DType t, const char* what) {
  if (t != DType::F32 && t != DType::BF16) check.fail(std::string(what) + " must be F32 or BF16");
  return t == DType::BF16;
}
bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
// 4-element vector access of a row-strided tensor: every row start on a vector boundary.
bool vec_ok(const void* p, bool bf, int64_t ld) { return !p || (aligned(p, bf ? 8 : 16) && ld % 4 == 0); }

void check_args(const char* who, int64_t rows, int64_t D, int64_t ldx, int64_t ldy, float eps) {
  if (rows < 0 || D <= 0 || D > (int64_t(1) << 30))
    check.fail(std::string(who) + ": need rows >= 0 and 0 < D < 2^30, got rows=" + std::to_string(rows) +
         " D=" + std::to_string(D));
  if (ldx < D || ldy < D)
    check.fail(std::string(who) + ": row strides ldx=" + std::to_string(ldx) + " ldy=" + std::to_string(ldy) +
         " must be >= D=" + std::to_string(D));
  if (!(eps >= 0.f) || !std::isfinite(eps)) check.fail(std::string(who) + ": eps must be finite and >= 0");
}

template <bool GATED>
void launch_forward(const void* x, bool xbf, const bf16* gate, const float* w, bf16* y, float* rstd, int64_t rows,
                    int64_t D, int64_t ldx, int64_t ldy, float eps, bool vec, cudaStream_t s) {
  const int tpr = pick_tpr(D);
  const int64_t blocks = (rows + kThreads / tpr - 1) / (kThreads / tpr);
  if (blocks >= (int64_t(1) << 31)) check.fail("too many rows");
  with_vec(vec, [&](auto v) {
    with_tpr(tpr, [&](auto t) {
      fwd_kernel<decltype(t)::value, decltype(v)::value, GATED>
          <<<unsigned(blocks), kThreads, 0, s>>>(x, xbf, gate, w, y, rstd, rows, int(D), ldx, ldy, eps);
    });
  });
  check(cudaGetLastError(), "forward launch");
}

// Register-path geometry of the plain backward: VPT (0: the loop path), TPR and R. VPT is what one warp
// per row needs, up to 4 (more loads in flight per thread, fewer threads per row); TPR then covers D / V in
// multiples of 32, and R rows share a block of up to 256 threads.
struct RegPlan {
  int vpt = 0, tpr = 0, rows = 0;
};
RegPlan reg_plan(int64_t D, int V) {
  const int64_t n = D / V;  // vector columns (V = 4 only when D % 4 == 0)
  int vpt = int(std::clamp<int64_t>((n + 31) / 32, 1, 4));
  if (vpt == 3) vpt = 4;
  const int64_t tpr = ((n + vpt - 1) / vpt + 31) / 32 * 32;
  if (tpr > kRegMaxThreads) return {};
  return {vpt, int(tpr), int(std::max<int64_t>(1, kThreads / tpr))};
}
template <class Fn>
void with_vpt(int vpt, Fn&& fn) {
  switch (vpt) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}
template <class Fn>
void with_bool(bool b, Fn&& fn) {
  if (b)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

template <class K>
cudaError_t smem_opt_in(K* kern, size_t bytes) {
  if (bytes <= kDefaultSmem) return cudaSuccess;
  return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <bool GATED>
void launch_backward(BwdArgs a, float* dw, bool vec, cudaStream_t s) {
  const RegPlan plan = reg_plan(a.D, vec ? 4 : 1);
  const int tpr = plan.vpt ? plan.tpr : pick_tpr(a.D), R = plan.vpt ? plan.rows : kThreads / tpr;
  const int64_t nb = std::min<int64_t>((a.rows + R - 1) / R, kMaxBlocks);
  float* part = nullptr;
  if (dw) check(cu::malloc_async(&part, size_t(nb) * a.D * sizeof(float), s), "dw scratch");
  a.part = part;
  cudaError_t err = cudaSuccess;
  if (plan.vpt) {
    // w [D], and the running dw sum over groups [D] when R > 1.
    const size_t smem = size_t(dw && R > 1 ? 2 : 1) * size_t(a.D) * sizeof(float);
    with_vec(vec, [&](auto v) {
      with_vpt(plan.vpt, [&](auto vp) {
        with_bool(a.acc, [&](auto acc) {
          auto* kern = bwd_reg_kernel<decltype(v)::value, decltype(vp)::value, decltype(acc)::value, GATED>;
          err = smem_opt_in(kern, smem);
          if (err == cudaSuccess) {
            kern<<<unsigned(nb), R * tpr, smem, s>>>(a, tpr);
            err = cudaGetLastError();
          }
        });
      });
    });
  } else {
    const size_t smem = dw ? size_t(R) * size_t(a.D) * sizeof(float) : 0;
    with_vec(vec, [&](auto v) {
      with_tpr(tpr, [&](auto t) {
        auto* kern = bwd_kernel<decltype(t)::value, decltype(v)::value, GATED>;
        err = smem_opt_in(kern, smem);
        if (err == cudaSuccess) {
          kern<<<unsigned(nb), kThreads, smem, s>>>(a);
          err = cudaGetLastError();
        }
      });
    });
  }
  if (err == cudaSuccess && dw) {
    dw_reduce_kernel<<<unsigned((a.D + kRedCols - 1) / kRedCols), kRedCols * kRedSlices, 0, s>>>(part, nb, a.D, dw);
    err = cudaGetLastError();
  }
  if (part) {
    const cudaError_t e2 = cudaFreeAsync(part, s);
    if (err == cudaSuccess) err = e2;
  }
  check(err, "backward launch (D too large for the dw partials in shared memory?)");
}

}  // namespace

void rmsnorm_forward(const void* x, DType x_type, const float* w, void* y, float* rstd, int64_t rows, int64_t D,
                     float eps, int64_t ldx, int64_t ldy, void* stream) {
  if (ldx == 0) ldx = D;
  if (ldy == 0) ldy = D;
  check_args("rmsnorm_forward", rows, D, ldx, ldy, eps);
  const bool xbf = is_bf16(x_type, "rmsnorm_forward: x");
  if (rows == 0) return;
  if (!x || !w || !y) check.fail("rmsnorm_forward: x, w and y are required");
  const bool vec = D % 4 == 0 && vec_ok(x, xbf, ldx) && vec_ok(y, true, ldy) && aligned(w, 16);
  launch_forward<false>(x, xbf, nullptr, w, static_cast<bf16*>(y), rstd, rows, D, ldx, ldy, eps, vec,
                        lm::cu::stream(stream));
}

void rmsnorm_backward(const void* x, DType x_type, const float* w, const float* rstd, const void* dy, DType dy_type,
                      void* dx, DType dx_type, float* dw, int64_t rows, int64_t D, float eps, int64_t ldx,
                      int64_t ldy, bool accumulate_dx, int64_t lddx, void* stream) {
  if (ldx == 0) ldx = D;
  if (ldy == 0) ldy = D;
  if (lddx == 0) lddx = D;  // the header's convention (0: D), not ldx
  check_args("rmsnorm_backward", rows, D, ldx, ldy, eps);
  if (lddx < D) check.fail("rmsnorm_backward: row stride lddx=" + std::to_string(lddx) + " must be >= D=" + std::to_string(D));
  const bool xbf = is_bf16(x_type, "rmsnorm_backward: x"), dybf = is_bf16(dy_type, "rmsnorm_backward: dy"),
             dxbf = is_bf16(dx_type, "rmsnorm_backward: dx");
  if (accumulate_dx && dxbf) check.fail("rmsnorm_backward: accumulate_dx needs an F32 dx");
  if (rows == 0) return;
  if (!x || !w || !dy || !dx) check.fail("rmsnorm_backward: x, w, dy and dx are required");
  const bool vec = D % 4 == 0 && vec_ok(x, xbf, ldx) && vec_ok(dy, dybf, ldy) && vec_ok(dx, dxbf, lddx) &&
                   aligned(w, 16);
  BwdArgs a{x, w, rstd, dy, nullptr, dx, nullptr, nullptr, rows, ldx, ldy, lddx, int(D), eps, xbf, dybf, dxbf,
            accumulate_dx};
  launch_backward<false>(a, dw, vec, lm::cu::stream(stream));
}

void rmsnorm_gated_forward(const void* x, const void* gate, const float* w, void* out, float* rstd, int64_t rows,
                           int64_t D, float eps, void* stream) {
  check_args("rmsnorm_gated_forward", rows, D, D, D, eps);
  if (rows == 0) return;
  if (!x || !gate || !w || !out) check.fail("rmsnorm_gated_forward: x, gate, w and out are required");
  const bool vec = D % 4 == 0 && aligned(x, 8) && aligned(gate, 8) && aligned(out, 8) && aligned(w, 16);
  launch_forward<true>(x, true, static_cast<const bf16*>(gate), w, static_cast<bf16*>(out), rstd, rows, D, D, D, eps,
                       vec, lm::cu::stream(stream));
}

void rmsnorm_gated_backward(const void* x, const void* gate, const float* w, const float* rstd, const float* dout,
                            void* dx, void* dgate, float* dw, int64_t rows, int64_t D, float eps, void* stream) {
  check_args("rmsnorm_gated_backward", rows, D, D, D, eps);
  if (rows == 0) return;
  if (!x || !gate || !w || !dout || !dx || !dgate)
    check.fail("rmsnorm_gated_backward: x, gate, w, dout, dx and dgate are required");
  const bool vec = D % 4 == 0 && aligned(x, 8) && aligned(gate, 8) && aligned(dx, 8) && aligned(dgate, 8) &&
                   aligned(dout, 16) && aligned(w, 16);
  BwdArgs a{x, w, rstd, dout, static_cast<const bf16*>(gate), dx, static_cast<bf16*>(dgate), nullptr, rows, D, D, D,
            int(D), eps, true, false, true, false};
  launch_backward<true>(a, dw, vec, lm::cu::stream(stream));
}

}  // namespace lm::ops::cuda

// Block Attention Residuals read on the GPU (ops/attnres/cuda/attnres_cuda.hpp), fp32: the formulas of
// ops/attnres/attnres.cpp (one-shot forward and backward).
//
// Legend: N sources (<= 32), T tokens, d hidden, q = gamma ⊙ w, NT threads per token (blockDim, a power of
//         two in [32, 256], about d / 8), V floats per vector access (4 when d % 4 == 0 and every pointer is
//         16-byte aligned, else 1), nb fixed token blocks of the backward (<= kMaxBlocks).
// One block per token at a time. Per source, one pass over its row leaves per-warp partials of (Σv², q·v)
// [and δ·v in the backward] in shared memory; warp 0 then finishes the N scores and the softmax with lane j
// holding source j; a last column pass writes h (forward) or dv and the dq partials (backward). Sources
// are re-read from L1/L2 in that pass.
// Backward: nb blocks, each a contiguous token range; dq = Σ_t Σ_j dz_j v_j / r_j accumulates per block in
// shared memory (each thread owns its columns), is written to scratch [nb, d], and a second kernel sums it in
// block order (double), adding dq ⊙ gamma to dw and dq ⊙ w to dgamma: reproducible for given T and d.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "ops/attnres/cuda/attnres_cuda.hpp"
#include "ops/kda/cuda/cuda_error.hpp"

namespace lm::ops::cuda {

namespace {

constexpr int kMaxSources = 32;  // one warp lane per source in the softmax
constexpr int kMaxWarps = 8;     // NT <= 256
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kMaxGrid = 1024;  // forward: blocks loop over tokens, so q is built once per block
constexpr size_t kDefaultSmem = 48 * 1024;

[[noreturn]] void fail(const std::string& m) { throw Error("attnres cuda: " + m); }
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

// Source pointers travel by value in the kernel arguments (the host holds the array).
struct Srcs {
  const float* p[kMaxSources];
};
struct DSrcs {
  float* p[kMaxSources];  // null: that source's gradient is skipped
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

// Butterfly reductions: every lane ends with the same bits (a + b == b + a), in a fixed order.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// q = gamma ⊙ w into shared memory, once per block.
__device__ __forceinline__ void load_query(float* q, const float* w, const float* gamma, int d) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) q[c] = gamma[c] * w[c];
}

// ---- kernels ----------------------------------------------------------------------------------------

template <int V>
__global__ void __launch_bounds__(256) fwd_kernel(Srcs v, int N, int64_t T, int d, const float* w,
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

// Per token, with δ = dh: a = softmax(z), dz_j = a_j (δ·v_j − δ·h) where δ·h = Σ_j a_j δ·v_j, and
//   dv_j += a_j δ + (dz_j / r_j) q − (dz_j z_j / (r_j² d)) v_j,   dq += Σ_j (dz_j / r_j) v_j.
template <int V>
__global__ void __launch_bounds__(256) bwd_kernel(Srcs v, DSrcs dv, int N, int64_t T, int d, const float* w,
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

// dq[c] = Σ_b part[b, c] in block order; dw += dq ⊙ gamma, dgamma += dq ⊙ w.
__global__ void dq_reduce_kernel(const float* part, int64_t nb, int d, const float* w, const float* gamma, float* dw,
                                 float* dgamma) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  double s = 0;
  for (int64_t b = 0; b < nb; ++b) s += part[b * d + c];
  const float dq = float(s);
  if (dw) dw[c] += dq * gamma[c];
  if (dgamma) dgamma[c] += dq * w[c];
}

// ---- host side --------------------------------------------------------------------------------------

int pick_threads(int64_t d) {
  int t = 32;
  while (t < 32 * kMaxWarps && int64_t(t) * 8 < d) t *= 2;
  return t;
}
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_args(const char* who, const float* const* v, int64_t N, int64_t T, int64_t d, const float* w,
                const float* gamma, float eps) {
  if (N < 1 || N > kMaxSources) fail(std::string(who) + ": need 1 <= N <= 32 sources, got " + std::to_string(N));
  if (T < 0 || d <= 0 || d > (int64_t(1) << 30))
    fail(std::string(who) + ": need T >= 0 and 0 < d < 2^30, got T=" + std::to_string(T) + " d=" + std::to_string(d));
  if (!(eps >= 0.f) || !std::isfinite(eps)) fail(std::string(who) + ": eps must be finite and >= 0");
  if (!v) fail(std::string(who) + ": source array is null");
  for (int64_t j = 0; j < N; ++j)
    if (!v[j]) fail(std::string(who) + ": source " + std::to_string(j) + " is null");
  if (!w || !gamma) fail(std::string(who) + ": w and gamma are required");
}

// Opts the kernel in to more than the default dynamic shared memory when d needs it.
template <class K>
void smem_opt_in(K* kern, size_t bytes) {
  if (bytes > kDefaultSmem)
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
          "shared memory opt-in (d too large?)");
}

}  // namespace

void attnres_forward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                     float eps, float* h, void* stream) {
  check_args("attnres_forward", v, N, T, d, w, gamma, eps);
  if (T == 0) return;
  if (!h) fail("attnres_forward: h is required");
  Srcs src{};
  bool vec = d % 4 == 0 && aligned16(w) && aligned16(gamma) && aligned16(h);
  for (int64_t j = 0; j < N; ++j) src.p[j] = v[j], vec = vec && aligned16(v[j]);
  const int nt = pick_threads(d);
  const unsigned grid = unsigned(std::min<int64_t>(T, kMaxGrid));
  const size_t smem = size_t(d) * sizeof(float);
  auto s = static_cast<cudaStream_t>(stream);
  if (vec) {
    smem_opt_in(fwd_kernel<4>, smem);
    fwd_kernel<4><<<grid, nt, smem, s>>>(src, int(N), T, int(d), w, gamma, eps, h);
  } else {
    smem_opt_in(fwd_kernel<1>, smem);
    fwd_kernel<1><<<grid, nt, smem, s>>>(src, int(N), T, int(d), w, gamma, eps, h);
  }
  check(cudaGetLastError(), "forward launch");
}

void attnres_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                      float eps, const float* dh, float* const* dv, float* dw, float* dgamma, void* stream) {
  check_args("attnres_backward", v, N, T, d, w, gamma, eps);
  if (T == 0) return;
  if (!dh) fail("attnres_backward: dh is required");
  Srcs src{};
  DSrcs dsrc{};
  bool vec = d % 4 == 0 && aligned16(w) && aligned16(gamma) && aligned16(dh);
  for (int64_t j = 0; j < N; ++j) {
    src.p[j] = v[j];
    dsrc.p[j] = dv ? dv[j] : nullptr;
    vec = vec && aligned16(src.p[j]) && aligned16(dsrc.p[j]);
  }
  const bool want_dq = dw || dgamma;
  const int nt = pick_threads(d);
  const int64_t nb = std::min<int64_t>(T, kMaxBlocks);
  const size_t smem = size_t(want_dq ? 2 : 1) * size_t(d) * sizeof(float);
  auto s = static_cast<cudaStream_t>(stream);
  float* part = nullptr;
  if (want_dq) check(cudaMallocAsync(reinterpret_cast<void**>(&part), size_t(nb) * d * sizeof(float), s), "dq scratch");
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto* kern) {
    if (smem > kDefaultSmem) err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err == cudaSuccess) {
      kern<<<unsigned(nb), nt, smem, s>>>(src, dsrc, int(N), T, int(d), w, gamma, eps, dh, part);
      err = cudaGetLastError();
    }
  };
  if (vec)
    launch(bwd_kernel<4>);
  else
    launch(bwd_kernel<1>);
  if (err == cudaSuccess && want_dq) {
    dq_reduce_kernel<<<unsigned((d + 255) / 256), 256, 0, s>>>(part, nb, int(d), w, gamma, dw, dgamma);
    err = cudaGetLastError();
  }
  if (part) {
    const cudaError_t e2 = cudaFreeAsync(part, s);
    if (err == cudaSuccess) err = e2;
  }
  check(err, "backward launch");
}

}  // namespace lm::ops::cuda

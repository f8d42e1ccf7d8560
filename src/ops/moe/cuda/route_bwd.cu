// Backward of the MoE routing on the GPU: combine, gather and the sigmoid router (ops/moe/permute.cpp and
// router.cpp define them on the CPU; the forwards live in route.cu).
//
// Legend: m tokens, n experts, k experts per token, M = m·k permuted rows, d row width,
//         a = i·k + t the assignment of token i's slot t, pos[a] its permuted row (int32).
// Combine backward: one warp per assignment; d_eo[pos[a]] = topk_w[a] · dy[i] and the fp32 dot
//   <eo[pos[a]], dy[i]> from per-lane partials (fixed column split) and a fixed shuffle tree: deterministic.
// Gather backward: one thread per (token, 8 columns), the k slots summed in slot order in fp32.
// Router backward: one warp per token; the row of d_logits is zeroed, then the k selected entries written.
// No atomics anywhere: every output element has a single writer.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/cuda/reduce.cuh"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using cu::warp_sum;  // core/cuda/reduce.cuh
using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"moe cuda"};

__device__ __forceinline__ void load8(const bf16* p, float* f) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 v = __bfloat1622float2(h[q]);
    f[2 * q] = v.x, f[2 * q + 1] = v.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float* f) {
  const float4 x = reinterpret_cast<const float4*>(p)[0], y = reinterpret_cast<const float4*>(p)[1];
  f[0] = x.x, f[1] = x.y, f[2] = x.z, f[3] = x.w, f[4] = y.x, f[5] = y.y, f[6] = y.z, f[7] = y.w;
}
__device__ __forceinline__ void store8(bf16* p, const float* f) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void store1(float* p, float v) { *p = v; }
__device__ __forceinline__ void store1(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

constexpr int kThreads = 256;

template <class G>
__global__ void combine_bwd_kernel(const bf16* eo, const float* w, const int* pos, const G* dy, bf16* d_eo, float* d_w,
                                   int64_t M, int k, int d) {
  const int lane = threadIdx.x & 31;
  for (int64_t a = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; a < M;
       a += (int64_t(gridDim.x) * blockDim.x) >> 5) {
    const int64_t i = a / k, r = pos[a];
    const float p = w[a];
    const G* g = dy + i * d;
    const bf16* e = eo + r * d;
    bf16* de = d_eo + r * d;
    float dot = 0.f;
    for (int c = lane * 8; c < d; c += 256) {
      float fg[8], fe[8], o[8];
      load8(g + c, fg);
      load8(e + c, fe);
#pragma unroll
      for (int q = 0; q < 8; ++q) o[q] = p * fg[q], dot = fmaf(fe[q], fg[q], dot);
      store8(de + c, o);
    }
    dot = warp_sum(dot);
    if (d_w && lane == 0) d_w[a] = dot;
  }
}

template <class O>
__global__ void gather_bwd_kernel(const bf16* dxs, const int* pos, O* dx, int64_t m, int k, int d, int64_t lddx,
                                  int accumulate) {
  const int v8 = d / 8;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < m * v8;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / v8;
    const int c = int(idx - i * v8) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (accumulate) load8(reinterpret_cast<const float*>(dx) + i * lddx + c, acc);  // F32 only (host checks)
    for (int t = 0; t < k; ++t) {
      float f[8];
      load8(dxs + int64_t(pos[i * k + t]) * d + c, f);
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += f[q];
    }
    store8(dx + i * lddx + c, acc);
  }
}

__device__ __forceinline__ float sigmoid_acc(float x) { return 1.f / (1.f + expf(-x)); }

// One warp per token; slots t = lane, lane + 32, ... (k < 32 in practice: one slot per lane).
template <class O>
__global__ void router_bwd_kernel(const float* logits, const int* idx, const float* dp, O* dl, int64_t m, int n, int k,
                                  int renorm, float scaling, int64_t ldl) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; i < m;
       i += (int64_t(gridDim.x) * blockDim.x) >> 5) {
    O* row = dl + i * ldl;
    for (int e = lane; e < n; e += 32) store1(row + e, 0.f);
    const int* ti = idx + i * k;
    const float* dpi = dp + i * k;
    float S = 0.f, gs = 0.f;  // Σ s and Σ dp·s over the selected experts
    if (renorm) {
      for (int t = lane; t < k; t += 32) {
        const int e = ti[t];
        const float s = (e >= 0 && e < n) ? sigmoid_acc(logits[i * n + e]) : 0.f;
        S += s;
        gs = fmaf(dpi[t], s, gs);
      }
      S = warp_sum(S);
      gs = warp_sum(gs);
    }
    const float denom = S + 1e-20f;
    const float g = gs / denom, c = scaling / denom;
    __syncwarp();  // the zeros above land before the selected entries below (same addresses, other lanes)
    for (int t = lane; t < k; t += 32) {
      const int e = ti[t];
      if (e < 0 || e >= n) continue;  // invalid index: nothing sensible to write (the CPU op throws)
      const float s = sigmoid_acc(logits[i * n + e]);
      const float ds = renorm ? c * (dpi[t] - g) : scaling * dpi[t];
      store1(row + e, ds * s * (1.f - s));
    }
  }
}

int grid_for(int64_t work, int threads) {
  return int(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 132 * 32)));
}

}  // namespace

void moe_combine_backward(const void* eo, const float* topk_w, const int32_t* pos, const void* dy, bool dy_bf16,
                          void* d_eo, float* d_topk_w, int64_t m, int64_t k, int64_t d, void* stream) {
  if (m < 0 || k < 1 || d < 0) check.fail("combine backward: bad sizes");
  if (d % 8) check.fail("combine backward: d must be a multiple of 8");
  if (m == 0) return;
  if (!eo || !topk_w || !pos || !dy || !d_eo) check.fail("combine backward: null argument");
  if (m * k >= (int64_t(1) << 31)) check.fail("combine backward: m·k must fit int32");
  const int64_t M = m * k;
  const auto s = lm::cu::stream(stream);
  const int blocks = grid_for(M * 32, kThreads);
  if (dy_bf16)
    combine_bwd_kernel<bf16><<<blocks, kThreads, 0, s>>>(static_cast<const bf16*>(eo), topk_w, pos,
                                                         static_cast<const bf16*>(dy), static_cast<bf16*>(d_eo),
                                                         d_topk_w, M, int(k), int(d));
  else
    combine_bwd_kernel<float><<<blocks, kThreads, 0, s>>>(static_cast<const bf16*>(eo), topk_w, pos,
                                                          static_cast<const float*>(dy), static_cast<bf16*>(d_eo),
                                                          d_topk_w, M, int(k), int(d));
  check(cudaGetLastError(), "combine backward launch");
}

void moe_gather_backward(const void* dxs, const int32_t* pos, void* dx, bool dx_bf16, int64_t m, int64_t k, int64_t d,
                         bool accumulate, void* stream, int64_t lddx) {
  if (m < 0 || k < 1 || d < 0) check.fail("gather backward: bad sizes");
  if (!lddx) lddx = d;
  if (lddx < d || lddx % 8) check.fail("gather backward: lddx must be a multiple of 8, at least d");
  if (d % 8) check.fail("gather backward: d must be a multiple of 8");
  if (accumulate && dx_bf16) check.fail("gather backward: accumulate needs an F32 dx");
  if (m == 0 || d == 0) return;
  if (!dxs || !pos || !dx) check.fail("gather backward: null argument");
  const auto s = lm::cu::stream(stream);
  const int blocks = grid_for(m * d / 8, kThreads);
  if (dx_bf16)
    gather_bwd_kernel<bf16><<<blocks, kThreads, 0, s>>>(static_cast<const bf16*>(dxs), pos, static_cast<bf16*>(dx), m,
                                                        int(k), int(d), lddx, 0);
  else
    gather_bwd_kernel<float><<<blocks, kThreads, 0, s>>>(static_cast<const bf16*>(dxs), pos, static_cast<float*>(dx),
                                                         m, int(k), int(d), lddx, accumulate ? 1 : 0);
  check(cudaGetLastError(), "gather backward launch");
}

void router_backward(const float* logits, const int32_t* topk_idx, const float* d_topk_w, void* d_logits,
                     bool out_bf16, int64_t m, int64_t n, int64_t k, bool renormalize, float scaling, void* stream,
                     int64_t ld) {
  if (m < 0 || n < 1 || n >= (int64_t(1) << 31) || k < 1 || k > n) check.fail("router backward: need 1 <= k <= n");
  if (!ld) ld = n;
  if (ld < n) check.fail("router backward: ld must be at least n");
  if (m == 0) return;
  if (!logits || !topk_idx || !d_topk_w || !d_logits) check.fail("router backward: null argument");
  const auto s = lm::cu::stream(stream);
  const int blocks = grid_for(m * 32, kThreads);
  if (out_bf16)
    router_bwd_kernel<bf16><<<blocks, kThreads, 0, s>>>(logits, topk_idx, d_topk_w, static_cast<bf16*>(d_logits), m,
                                                        int(n), int(k), renormalize, scaling, ld);
  else
    router_bwd_kernel<float><<<blocks, kThreads, 0, s>>>(logits, topk_idx, d_topk_w, static_cast<float*>(d_logits), m,
                                                         int(n), int(k), renormalize, scaling, ld);
  check(cudaGetLastError(), "router backward launch");
}

}  // namespace lm::ops::cuda

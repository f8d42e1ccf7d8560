// MoE routing on the GPU (SPEC §5): sigmoid router with biased top-k, the permutation by expert, gather and
// combine. Same definitions and orders as ops/moe/router.cpp and permute.cpp.
//
// Legend: m tokens, n experts, k experts per token, M = m·k assignments / permuted rows, d row width,
//         a = i·k + t assignment of token i's slot t.
// Router: one warp per token; each lane keeps the experts lane + 32j in registers; k + 1 rounds of a warp
//         arg-max (larger value first, lower index on ties) give the selection and QB's cutoff.
// Permutation: a stable radix sort of the assignments by expert (CUB), so rows keep (token, slot) order
//         inside an expert and the result is deterministic; offsets from the sorted keys. Up to 1,024
//         assignments, one block gives the same order (no sort launches: a decode step's few rows).
// Combine: per token, the k expert rows in slot order, summed in fp32 (no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/pdl.cuh"
#include "core/cuda/stream.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"moe cuda"};

struct Best {
  float v, s;
  int e;
};
__device__ __forceinline__ bool better(float v, int e, float bv, int be) { return v > bv || (v == bv && e < be); }

template <int NPL>
__global__ void router_kernel(const float* logits, const float* bias, int m, int n, int k, int renorm, float scaling,
                              RouterOut out) {
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (i >= m) return;
  float s[NPL], v[NPL];
  uint32_t taken = 0;  // bit j: expert lane + 32j selected (or absent)
#pragma unroll
  for (int j = 0; j < NPL; ++j) {
    const int e = lane + 32 * j;
    if (e < n) {
      const float x = logits[int64_t(i) * n + e];
      s[j] = 1.f / (1.f + expf(-x));
      v[j] = s[j] + (bias ? bias[e] : 0.f);
      if (out.scores) out.scores[int64_t(i) * n + e] = s[j];
    } else {
      s[j] = v[j] = 0.f;
      taken |= 1u << j;
    }
  }
  int my_e = 0x7fffffff;
  float my_s = 0.f, vk = 0.f, vk1 = -INFINITY;
  const int rounds = min(k + 1, n);
  for (int r = 0; r < rounds; ++r) {
    Best b{-INFINITY, 0.f, 0x7fffffff};
    int bj = -1;
#pragma unroll
    for (int j = 0; j < NPL; ++j)
      if (!(taken >> j & 1u) && (bj < 0 || better(v[j], lane + 32 * j, b.v, b.e))) b = {v[j], s[j], lane + 32 * j}, bj = j;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, b.v, off), os = __shfl_xor_sync(0xffffffffu, b.s, off);
      const int oe = __shfl_xor_sync(0xffffffffu, b.e, off);
      if (better(ov, oe, b.v, b.e)) b = {ov, os, oe};
    }
    if (r == k) {
      vk1 = b.v;
      break;
    }
    if (bj >= 0 && b.e == lane + 32 * bj) taken |= 1u << bj;
    if (lane == r) my_e = b.e, my_s = b.s;
    if (r == k - 1) vk = b.v;
  }
  // Ascending expert order within the row; renormalise in that order (as the CPU router does).
  __shared__ float buf[8][32];
  float* sb = buf[(threadIdx.x >> 5) & 7];
  int rank = 0;
  for (int q = 0; q < k; ++q) rank += __shfl_sync(0xffffffffu, my_e, q) < my_e;
  if (lane < k) sb[rank] = my_s;
  __syncwarp();
  float sum = 0.f;
  for (int q = 0; q < k; ++q) sum += sb[q];
  if (lane < k) {
    const float inv = scaling / (sum + 1e-20f);
    out.topk_idx[int64_t(i) * k + rank] = my_e;
    out.topk_w[int64_t(i) * k + rank] = renorm ? my_s * inv : my_s * scaling;
  }
  if (lane == 0) {
    if (out.margin) out.margin[i] = k < n ? vk - vk1 : INFINITY;
    if (out.alpha) out.alpha[i] = k < n ? vk1 : -INFINITY;
  }
}

__global__ void iota_kernel(int* p, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = i;
}
// rows = sorted assignments; pos[rows[r]] = r; offsets[j] = first r with key >= j.
__global__ void perm_finish_kernel(const int* keys, const int* rows, int* pos, int* offsets, int M, int n) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r <= M; r += gridDim.x * blockDim.x) {
    if (r < M) pos[rows[r]] = r;
    const int prev = r > 0 ? keys[r - 1] : -1, cur = r < M ? keys[r] : n;
    for (int j = prev + 1; j <= cur && j <= n; ++j) offsets[j] = r;
  }
}

// A small permutation (decode steps, short pieces: M <= kSmallPermute) in one block, the same stable order without
// the sort's launches and scratch: counts per expert, their exclusive scan (warp 0, a contiguous run of experts
// per lane), then row = offset of the expert + the earlier assignments with the same expert (M² / threads
// compares in shared memory).
constexpr int kSmallPermute = 1024, kSmallThreads = 1024, kSmallExperts = 8192;
__global__ void __launch_bounds__(kSmallThreads) permute_small_kernel(const int* topk_idx, int M, int n, int* offsets,
                                                                      int* rows, int* pos) {
  extern __shared__ int sh[];
  int* start = sh;         // [n + 1]: counts, then each expert's first row
  int* key = sh + n + 1;   // [M]
  const int tid = threadIdx.x;
  for (int j = tid; j <= n; j += blockDim.x) start[j] = 0;
  for (int a = tid; a < M; a += blockDim.x) key[a] = topk_idx[a];
  __syncthreads();
  for (int a = tid; a < M; a += blockDim.x) atomicAdd(&start[key[a]], 1);
  __syncthreads();
  if (tid < 32) {
    const int per = (n + 31) / 32, j0 = min(n, tid * per), j1 = min(n, j0 + per);
    int run = 0;
    for (int j = j0; j < j1; ++j) run += start[j];
    int incl = run;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, off);
      if (tid >= off) incl += v;
    }
    int acc = incl - run;
    for (int j = j0; j < j1; ++j) {
      const int c = start[j];
      start[j] = acc, offsets[j] = acc, acc += c;
    }
    if (tid == 31) start[n] = incl, offsets[n] = incl;
  }
  __syncthreads();
  for (int a = tid; a < M; a += blockDim.x) {
    const int e = key[a];
    int rank = 0;
    for (int b = 0; b < a; ++b) rank += key[b] == e;
    const int r = start[e] + rank;
    rows[r] = a, pos[a] = r;
  }
}

__global__ void gather_kernel(const bf16* x, const int* rows, bf16* xs, int64_t M, int k, int d, int64_t ldx) {
  const int v8 = d / 8;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < M * v8; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx / v8;
    const int c = int(idx % v8) * 8;
    *reinterpret_cast<uint4*>(xs + r * d + c) = *reinterpret_cast<const uint4*>(x + int64_t(rows[r] / k) * ldx + c);
  }
}

__global__ void combine_kernel(const bf16* eo, const float* w, const int* pos, bf16* y, int64_t m, int k, int d) {
  lm::cu::pdl_launch_dependents();  // the next projection may start streaming its weights (core/cuda/pdl.cuh)
  const int v8 = d / 8;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < m * v8; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / v8;
    const int c = int(idx % v8) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int t = 0; t < k; ++t) {
      const float wt = w[i * k + t];
      const uint4 u = *reinterpret_cast<const uint4*>(eo + int64_t(pos[i * k + t]) * d + c);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(h[q]);
        acc[2 * q] += wt * f.x, acc[2 * q + 1] += wt * f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) oh[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    *reinterpret_cast<uint4*>(y + i * d + c) = o;
  }
}

int grid_for(int64_t work, int threads) { return int(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 132 * 32))); }

}  // namespace

void router_forward(const float* logits, const float* bias, int64_t m, int64_t n, int64_t k, bool renormalize,
                    float scaling, const RouterOut& out, void* stream) {
  if (n < 1 || n > 1024 || k < 1 || k > n || k >= 32 || m < 0) check.fail("router: need 1 <= k < 32, k <= n <= 1024");
  if (!out.topk_idx || !out.topk_w) check.fail("router: topk_idx and topk_w are required");
  if (m == 0) return;
  auto s = lm::cu::stream(stream);
  const int blocks = int((m + 7) / 8);
  const int npl = int((n + 31) / 32);
#define LM_ROUTER(NPL) router_kernel<NPL><<<blocks, 256, 0, s>>>(logits, bias, int(m), int(n), int(k), renormalize, scaling, out)
  if (npl <= 1) LM_ROUTER(1);
  else if (npl <= 2) LM_ROUTER(2);
  else if (npl <= 4) LM_ROUTER(4);
  else if (npl <= 8) LM_ROUTER(8);
  else if (npl <= 16) LM_ROUTER(16);
  else LM_ROUTER(32);
#undef LM_ROUTER
  check(cudaGetLastError(), "router launch");
}

void moe_permute(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int32_t* offsets, int32_t* rows,
                 int32_t* pos, void* stream) {
  const int64_t M = m * k;
  if (M >= (int64_t(1) << 31) || n < 1) check.fail("permute: bad sizes");
  auto s = lm::cu::stream(stream);
  if (M <= kSmallPermute && n <= kSmallExperts) {
    permute_small_kernel<<<1, kSmallThreads, size_t(n + 1 + M) * 4, s>>>(topk_idx, int(M), int(n), offsets, rows, pos);
    return check(cudaGetLastError(), "permute launch");
  }
  int end_bit = 1;
  while ((int64_t(1) << end_bit) <= n) ++end_bit;
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const int*>(nullptr), static_cast<int*>(nullptr),
                                  static_cast<const int*>(nullptr), static_cast<int*>(nullptr), int(M), 0, end_bit, s);
  void* base = nullptr;
  const size_t ints = size_t(2 * M + 64);
  check(cu::malloc_async(&base, ints * 4 + temp, s), "permute scratch");
  int* keys_out = static_cast<int*>(base);
  int* vals_in = keys_out + M + 32;
  void* tmp = vals_in + M + 32;
  if (M > 0) {
    iota_kernel<<<grid_for(M, 256), 256, 0, s>>>(vals_in, int(M));
    check(cub::DeviceRadixSort::SortPairs(tmp, temp, topk_idx, keys_out, vals_in, rows, int(M), 0, end_bit, s),
          "permute sort");
  }
  perm_finish_kernel<<<grid_for(M + 1, 256), 256, 0, s>>>(keys_out, rows, pos, offsets, int(M), int(n));
  check(cudaGetLastError(), "permute launch");
  check(cudaFreeAsync(base, s), "permute scratch free");
}

void moe_gather(const void* x, const int32_t* rows, void* xs, int64_t m, int64_t k, int64_t d, void* stream,
                int64_t ldx) {
  if (d % 8) check.fail("gather: d must be a multiple of 8");
  if (!ldx) ldx = d;
  if (ldx < d || ldx % 8) check.fail("gather: ldx must be a multiple of 8, at least d");
  const int64_t M = m * k;
  if (M == 0) return;
  gather_kernel<<<grid_for(M * d / 8, 256), 256, 0, lm::cu::stream(stream)>>>(
      static_cast<const bf16*>(x), rows, static_cast<bf16*>(xs), M, int(k), int(d), ldx);
  check(cudaGetLastError(), "gather launch");
}

void moe_combine(const void* eo, const float* topk_w, const int32_t* pos, void* y, int64_t m, int64_t k, int64_t d,
                 void* stream) {
  if (d % 8) check.fail("combine: d must be a multiple of 8");
  if (m == 0) return;
  combine_kernel<<<grid_for(m * d / 8, 256), 256, 0, lm::cu::stream(stream)>>>(
      static_cast<const bf16*>(eo), topk_w, pos, static_cast<bf16*>(y), m, int(k), int(d));
  check(cudaGetLastError(), "combine launch");
}

}  // namespace lm::ops::cuda

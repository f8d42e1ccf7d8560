// Dense products of a few rows (decode steps): y = alpha · x · Wᵀ + beta · base, nn.Linear's layout. At one to
// eight rows the product reads each weight once and does almost no arithmetic, so its time is the weight stream;
// cuBLAS's small-M kernels reached 1.75 TB/s on the 48B model's projections (ncu, H100, copy 3.03 TB/s), mostly
// in each launch's ramp-up and tail. Here every warp streams WR weight rows from global memory into registers
// and applies them to all rows of x (CUDA cores, fp32 accumulation); the block first asks L2 for its whole
// weight slice (one bulk prefetch per row), then waits for the kernel before it (programmatic dependent launch,
// core/cuda/pdl.cuh), so the weights of the next projection stream in while the previous kernel ends.
// Measured (H100, `bench decode`, 48B shape, 8K): batch 1 683 tokens/s against cuBLAS's 651; at 4 and 8 rows the
// CUDA-core arithmetic falls behind cuBLAS's tensor cores (-10%, -19%), so gemm_bf16 sends it one row by default
// (LONGMOE_GEMM_FEW_ROWS). Under ncu (each kernel alone, caches flushed) it streams the LM head at 3.09 TB/s but
// the 19-57 MB projections at only 1.4-2.0 TB/s: the grid's last wave runs part full, and the small ones (~1 MB)
// take ~4.5 us whatever their size. Next: tensor-core tiles (mma over 16 weight rows × 8 rows of x), a grid sized to
// the resident blocks.
//
// Legend: M rows of x (≤ kMaxRows), N output features = weight rows, K reduction dim (a multiple of 8);
//         x [M, ldx] bf16, W [N, ldw] bf16, y and base [M, ldy] (bf16 or fp32, the same type);
//         WR = 4 weight rows per warp, kWarps = 4 warps per block in G = kWarps / S row groups of S warps, which
//         split K (S = 1, 2 or 4: more splits where N alone gives too few blocks to fill the device);
//         a warp step covers 256 k (each lane 8 consecutive k: one 16-byte load per weight row), U steps loaded
//         before any is used; R = the rows' capacity (1, 2, 4 or 8).
// A row's result does not depend on the other rows or on M (fixed per-lane order of k, fixed butterfly, splits
// added in order): a sequence decoded alone or beside others gets the same bits.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/mma.cuh"
#include "core/cuda/pdl.cuh"
#include "core/cuda/reduce.cuh"
#include "core/cuda/stream.hpp"
#include "core/env.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"

namespace lm::ops::cuda {
namespace {

constexpr lm::cu::Checker check{"gemm cuda (few rows)"};
using bf16 = __nv_bfloat16;
constexpr int kWarps = 4, kThreads = 32 * kWarps, WR = 4, kStep = 256, U = 4;

struct Params {
  const bf16* x;
  const bf16* w;
  void* y;
  const void* base;  // the beta term's source (y itself when accumulating); unread when beta = 0
  int64_t ldx, ldw, ldy;
  int M, N, K, S;
  float alpha, beta;
  bool f32;  // y and base are fp32 (else bf16)
};

// y[r, n] = alpha · acc + beta · base[r, n].
__device__ __forceinline__ void store(const Params& p, int r, int n, float acc) {
  const int64_t at = r * p.ldy + n;
  float v = p.alpha * acc;
  if (p.f32) {
    if (p.beta != 0.f) v += p.beta * static_cast<const float*>(p.base)[at];
    static_cast<float*>(p.y)[at] = v;
  } else {
    if (p.beta != 0.f) v += p.beta * __bfloat162float(static_cast<const bf16*>(p.base)[at]);
    static_cast<bf16*>(p.y)[at] = __float2bfloat16(v);
  }
}

template <int R>
__global__ void __launch_bounds__(kThreads) few_rows_kernel(const Params p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = kWarps / p.S, g = warp / p.S, s = warp % p.S;
  const int n0 = (blockIdx.x * G + g) * WR;
  const int steps = (p.K + kStep - 1) / kStep, st0 = s * steps / p.S, st1 = (s + 1) * steps / p.S;
  const bool active = n0 < p.N;
  const bf16* wr[WR];  // (a row past N repeats the last one and is not stored)
#pragma unroll
  for (int i = 0; i < WR; ++i) wr[i] = p.w + int64_t(min(n0 + i, p.N - 1)) * p.ldw;
  if (active && lane < WR && n0 + lane < p.N) {
    const int kb = st0 * kStep, ke = min(st1 * kStep, p.K);
    if (ke > kb) lm::cu::prefetch_l2(p.w + int64_t(n0 + lane) * p.ldw + kb, uint32_t(ke - kb) * 2u);
  }
  lm::cu::pdl_launch_dependents();
  lm::cu::pdl_wait();  // x (and base) come from the kernels before this one

  float acc[R][WR];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < WR; ++i) acc[r][i] = 0.f;
  if (active) {
    const bf16* xr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) xr[r] = p.x + int64_t(min(r, p.M - 1)) * p.ldx;
    for (int st = st0; st < st1; st += U) {
      uint4 wv[U][WR];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        // (past the split's end or K: a valid address, read and zeroed, so that no load waits behind a branch)
        const bool in = st + u < st1 && (st + u) * kStep + lane * 8 < p.K;
        const int k = in ? (st + u) * kStep + lane * 8 : 0;
#pragma unroll
        for (int i = 0; i < WR; ++i) wv[u][i] = lm::cu::ld_stream16(wr[i] + k);
        if (!in)
#pragma unroll
          for (int i = 0; i < WR; ++i) wv[u][i] = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();  // a fence to the compiler's scheduler too: every load above is issued before the first use
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = (st + u) * kStep + lane * 8;
        if (st + u >= st1 || k >= p.K) break;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r >= p.M) break;
          const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr[r] + k));
          float2 xf[4];
          lm::cu::unpack8_bf16(xv, xf);
#pragma unroll
          for (int i = 0; i < WR; ++i) lm::cu::fma8_bf16(acc[r][i], wv[u][i], xf);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < WR; ++i)
      acc[r][i] = lm::cu::warp_sum(acc[r][i]);
  if (p.S > 1) {  // the K splits' sums, added in split order by the group's first warp
    __shared__ float part[kWarps][R][WR];
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < WR; ++i) part[warp][r][i] = acc[r][i];
    __syncthreads();
    if (s != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < WR; ++i) {
        float v = part[warp][r][i];
        for (int q = 1; q < p.S; ++q) v += part[warp + q][r][i];
        acc[r][i] = v;
      }
  }
  if (!active) return;
  // Lane r·WR + i writes row r, output column n0 + i.
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < WR; ++i)
      if (lane == r * WR + i && r < p.M && n0 + i < p.N) store(p, r, n0 + i, acc[r][i]);
}

// The same product on tensor cores (LONGMOE_GEMM_FEW_ROWS_MMA=1): a warp owns 16 weight rows; per 32 k, lane
// (g = lane / 4, t = lane % 4) loads k 8t..8t+7 of weight rows g and g + 8 and of x row g (16 bytes each) and two
// m16n8k16 MMAs take them whole. The MMA reads A and B at the same k positions for each of its 16 "logical" k, so
// any fixed assignment of physical k to them gives the same sum: logical k {2t, 2t+1, 2t+8, 2t+9} are physical
// 8t..8t+3 in the first MMA and 8t+4..8t+7 in the second. x's rows are the MMA's 8 columns (rows past M repeat
// the last and are not stored); an output column depends on its x row alone, so rows keep their bits whatever M.
// C fragment: lane (g, t) holds weight rows g, g + 8 × x rows 2t, 2t + 1.
constexpr int kMmaRows = 16, kMmaChunks = 8;  // weight rows per warp; 32-k chunks loaded before any is used

__global__ void __launch_bounds__(kThreads) few_rows_mma_kernel(const Params p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int G = kWarps / p.S, grp = warp / p.S, s = warp % p.S;
  const int n0 = (blockIdx.x * G + grp) * kMmaRows;
  const int chunks = (p.K + 31) / 32, c0 = s * chunks / p.S, c1 = (s + 1) * chunks / p.S;
  const bool active = n0 < p.N;
  const bf16* wa = p.w + int64_t(min(n0 + g, p.N - 1)) * p.ldw + 8 * t;
  const bf16* wb = p.w + int64_t(min(n0 + g + 8, p.N - 1)) * p.ldw + 8 * t;
  if (active && lane < kMmaRows && n0 + lane < p.N) {
    const int kb = c0 * 32, ke = min(c1 * 32, p.K);
    if (ke > kb) lm::cu::prefetch_l2(p.w + int64_t(n0 + lane) * p.ldw + kb, uint32_t(ke - kb) * 2u);
  }
  lm::cu::pdl_launch_dependents();
  lm::cu::pdl_wait();  // x (and base) come from the kernels before this one

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (active) {
    const bf16* xr = p.x + int64_t(min(g, p.M - 1)) * p.ldx + 8 * t;
    for (int c = c0; c < c1; c += kMmaChunks) {
      uint4 va[kMmaChunks], vb[kMmaChunks], vx[kMmaChunks];
#pragma unroll
      for (int u = 0; u < kMmaChunks; ++u) {
        // (past the split's end or K: a valid address, read and zeroed, so that no load waits behind a branch)
        const bool in = c + u < c1 && (c + u) * 32 + 8 * t < p.K;
        const int k = in ? (c + u) * 32 : -8 * t;  // (the rows' first 8 k otherwise)
        va[u] = lm::cu::ld_stream16(wa + k), vb[u] = lm::cu::ld_stream16(wb + k);
        vx[u] = __ldg(reinterpret_cast<const uint4*>(xr + k));
        if (!in) va[u] = vb[u] = vx[u] = make_uint4(0, 0, 0, 0);
      }
      __syncwarp();  // a fence to the compiler's scheduler too: every load above is issued before the first MMA
#pragma unroll
      for (int u = 0; u < kMmaChunks; ++u) {
        const uint32_t a0[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y}, a1[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
        lm::cu::mma_bf16(acc, a0, vx[u].x, vx[u].y);
        lm::cu::mma_bf16(acc, a1, vx[u].z, vx[u].w);
      }
    }
  }
  if (p.S > 1) {  // the K splits' sums, added in split order by the group's first warp
    __shared__ float part[kWarps][32][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) part[warp][lane][j] = acc[j];
    __syncthreads();
    if (s != 0) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = part[warp][lane][j];
      for (int q = 1; q < p.S; ++q) v += part[warp + q][lane][j];
      acc[j] = v;
    }
  }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), r = 2 * t + (j & 1);
    if (r < p.M && n < p.N) store(p, r, n, acc[j]);
  }
}

bool aligned16(const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; }

}  // namespace

bool gemm_bf16_few_rows(int64_t M, int64_t N, int64_t K, float alpha, const void* x, int64_t ldx, const void* W,
                        int64_t ldw, float beta, void* y, int64_t ldy, DType y_type, void* stream,
                        const void* base) {
  if (M < 1 || M > kFewRowsMax || N < 1 || K < 8 || K % 8 || ldx % 8 || ldw % 8 || ldx < K || ldw < K || ldy < N ||
      !aligned16(x) || !aligned16(W) || N >= (int64_t(1) << 31) || K >= (int64_t(1) << 30) ||
      (y_type != DType::F32 && y_type != DType::BF16))
    return false;
  const bool mma = env::gemm_few_rows_mma();
  const int64_t rows_per_warp = mma ? kMmaRows : WR;
  const int64_t per_split = (N + rows_per_warp - 1) / rows_per_warp;  // warps' tasks when one warp takes all of K
  const int64_t want = 2 * lm::cu::sm_count();
  int S = 1;
  while (S < kWarps && per_split * S / kWarps < want) S *= 2;
  const int64_t G = kWarps / S;
  Params p{static_cast<const bf16*>(x), static_cast<const bf16*>(W), y, base ? base : y, ldx, ldw, ldy,
           int(M), int(N), int(K), S, alpha, beta, y_type == DType::F32};
  const dim3 grid(unsigned((N + G * rows_per_warp - 1) / (G * rows_per_warp)));
  const cudaStream_t st = lm::cu::stream(stream);
  cudaError_t e;
  if (mma) e = lm::cu::launch_pdl(few_rows_mma_kernel, grid, dim3(kThreads), 0, st, p);
  else if (M == 1) e = lm::cu::launch_pdl(few_rows_kernel<1>, grid, dim3(kThreads), 0, st, p);
  else if (M == 2) e = lm::cu::launch_pdl(few_rows_kernel<2>, grid, dim3(kThreads), 0, st, p);
  else if (M <= 4) e = lm::cu::launch_pdl(few_rows_kernel<4>, grid, dim3(kThreads), 0, st, p);
  else e = lm::cu::launch_pdl(few_rows_kernel<8>, grid, dim3(kThreads), 0, st, p);
  check(e, "few-row product launch");
  return true;
}

}  // namespace lm::ops::cuda

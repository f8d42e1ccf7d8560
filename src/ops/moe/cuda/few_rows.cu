// Grouped expert GEMMs for a few rows per expert (decode steps: one to a few tokens per selected expert). There
// the wgmma kernel (gemm.cu) pads every expert to a 128-row tile and keeps only as many blocks busy as there are
// (expert, 256-column) tiles, so the weight stream — the whole cost at this size — runs below the device's
// bandwidth. Here every block streams a slice of one selected expert's weight rows exactly once, straight from
// global memory into registers, and applies it to all of that expert's rows (CUDA cores, fp32 accumulation).
//
// Legend: E experts, M permuted rows (expert e owns rows offsets[e] .. offsets[e+1]−1), K reduction dim,
//         N output columns (GLU: I, with 2I weight rows per expert: gate rows 0..I−1, up rows I..2I−1),
//         S = min(M, E) expert slots (block row s serves the s-th expert that has rows, or exits),
//         WR = 4 weight rows per warp (GLU: two output columns' gate and up rows), kWarps warps per block,
//         R = 4 rows of the expert at a time in registers (an expert with more rows takes more passes).
// Each lane reads 8 consecutive k (one 16-byte load per weight row) every 256 k. A row's result is the same
// whatever the other rows are (fixed per-lane order of k, fixed butterfly), so this product gives a token the
// same bits whatever else its batch holds.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/check.hpp"
#include "core/cuda/mma.cuh"
#include "core/cuda/pdl.cuh"
#include "core/cuda/reduce.cuh"
#include "core/cuda/stream.hpp"
#include "ops/moe/cuda/glu_epilogue.cuh"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda::detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kWarps = 8, kThreads = 32 * kWarps, WR = 4, R = 4;

struct FewRowsParams {
  const int32_t* offsets;
  const int32_t* rows;  // nullable: row r of the product reads x row rows[r] / k (the gather, fused)
  int k;
  int64_t ldx;          // x's row stride (0: K)
  bf16* y;              // [M, N] (GLU: h [M, I])
  bf16* ab;             // GLU only, nullable: the pre-activations [M, 2I], a then b columns
  int E, N, K, Nw;      // Nw weight rows per expert (N, or 2I for GLU)
  GluConsts glu;
  bool early;           // plain product only: launched for programmatic dependent launch, offsets ready
};

// The s-th expert (in expert order) that has rows, or −1: a block-wide count over the offsets, 256 experts at a
// time. Every thread returns the same value.
__device__ int slot_expert(const int32_t* offsets, int E, int s) {
  __shared__ int warp_count[kWarps];
  __shared__ int found;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) found = -1;
  int base = 0;  // experts with rows before this chunk
  for (int e0 = 0; e0 < E; e0 += kThreads) {
    const int e = e0 + tid;
    const bool has = e < E && offsets[e + 1] > offsets[e];
    const unsigned ballot = __ballot_sync(0xffffffffu, has);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = base + __popc(ballot & ((1u << lane) - 1u)), total = base;
    for (int w = 0; w < kWarps; ++w) before += w < warp ? warp_count[w] : 0, total += warp_count[w];
    if (has && before == s) found = e;
    __syncthreads();
    base = total;
    if (found >= 0 || base > s) break;  // (uniform: every thread read the same counts)
  }
  return found;
}

template <bool GLU>
__global__ void __launch_bounds__(kThreads, 2) few_rows_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                                const FewRowsParams p) {
  if (GLU) lm::cu::pdl_launch_dependents();  // the down product may start (below)
  // With offsets_ready the plain product (the down projection, right after the GLU one) starts while the kernel
  // before it runs: the offsets were complete before that kernel started, so it reads them and asks L2 for its
  // weight rows at once, and waits only for x.
  const int e = slot_expert(p.offsets, p.E, blockIdx.y);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kCols = GLU ? WR / 2 : WR;  // output columns per warp
  const int col0 = (blockIdx.x * kWarps + warp) * kCols;
  if (!GLU && e >= 0 && col0 < p.N && lane < WR)
    lm::cu::prefetch_l2(w + (int64_t(e) * p.Nw + col0 + lane) * p.K, uint32_t(p.K) * 2u);
  if (!GLU) lm::cu::pdl_wait();  // (every thread, before any exit; a no-op when launched plainly)
  if (e < 0) return;
  if (col0 >= p.N) return;  // (N is a multiple of 8, so a warp's columns are all inside or all outside)
  const bf16* wr[WR];
#pragma unroll
  for (int i = 0; i < WR; ++i) {
    const int64_t row = GLU ? (i < 2 ? col0 + i : p.N + col0 + i - 2) : col0 + i;
    wr[i] = w + (int64_t(e) * p.Nw + row) * p.K;
  }
  const int r_end = p.offsets[e + 1];
  for (int rb = p.offsets[e]; rb < r_end; rb += R) {
    const int nr = min(R, r_end - rb);
    const bf16* xr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(rb + r, r_end - 1);
      xr[r] = x + (p.rows ? int64_t(p.rows[row] / p.k) : int64_t(row)) * p.ldx;
    }
    float acc[R][WR];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < WR; ++i) acc[r][i] = 0.f;
#pragma unroll 4
    for (int k = lane * 8; k < p.K; k += 256) {
      uint4 wv[WR];
#pragma unroll
      for (int i = 0; i < WR; ++i) wv[i] = lm::cu::ld_stream16(wr[i] + k);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= nr) break;
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr[r] + k));
        float2 xf[4];
        lm::cu::unpack8_bf16(xv, xf);
#pragma unroll
        for (int i = 0; i < WR; ++i) lm::cu::fma8_bf16(acc[r][i], wv[i], xf);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < WR; ++i)
        acc[r][i] = lm::cu::warp_sum(acc[r][i]);
    // Lane r·WR + i writes row rb + r, weight row i (GLU: lanes i < 2, output column col0 + i).
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < WR; ++i) {
        if (lane != r * WR + i || r >= nr) continue;
        const int64_t row = rb + r;
        if (GLU) {
          if (i >= 2) continue;
          const float a = acc[r][i], b = acc[r][i + 2];
          p.y[row * p.N + col0 + i] = __float2bfloat16(glu_epilogue(a, b, p.glu));
          if (p.ab) {
            p.ab[row * 2 * p.N + col0 + i] = __float2bfloat16(a);
            p.ab[row * 2 * p.N + p.N + col0 + i] = __float2bfloat16(b);
          }
        } else {
          p.y[row * p.N + col0 + i] = __float2bfloat16(acc[r][i]);
        }
      }
  }
}

constexpr lm::cu::Checker check{"moe cuda (few rows)"};

void launch(const void* x, const void* w, FewRowsParams p, int64_t M, bool glu, void* stream) {
  if (M < 0 || p.N < 8 || p.K < 8 || p.E < 1 || p.N % 8 || p.K % 8)
    check.fail("few-row grouped gemm: bad shape (N and K multiples of 8)");
  if (p.ldx == 0) p.ldx = p.K;
  if (p.ldx < p.K || p.ldx % 8) check.fail("few-row grouped gemm: x's row stride must be >= K and a multiple of 8");
  if (M >= (int64_t(1) << 31) || int64_t(p.E) * p.Nw * p.K >= (int64_t(1) << 40))
    check.fail("few-row grouped gemm too large");
  if (M == 0) return;
  const int cols_per_block = kWarps * (glu ? WR / 2 : WR);
  const dim3 grid(unsigned((p.N + cols_per_block - 1) / cols_per_block), unsigned(std::min<int64_t>(M, p.E)));
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  const cudaStream_t s = lm::cu::stream(stream);
  if (glu) few_rows_kernel<true><<<grid, kThreads, 0, s>>>(xb, wb, p);
  else if (p.early) check(lm::cu::launch_pdl(few_rows_kernel<false>, grid, dim3(kThreads), 0, s, xb, wb, p), "launch");
  else few_rows_kernel<false><<<grid, kThreads, 0, s>>>(xb, wb, p);
  check(cudaGetLastError(), "few-row grouped gemm launch");
}

}  // namespace
}  // namespace lm::ops::cuda::detail

namespace lm::ops::cuda {

void grouped_gemm_few_rows(const void* x, const void* w, void* y, const int32_t* offsets, int64_t M, int64_t N,
                           int64_t K, int64_t E, void* stream, bool offsets_ready) {
  detail::FewRowsParams p{offsets, nullptr, 1, 0, static_cast<__nv_bfloat16*>(y), nullptr, int(E), int(N), int(K),
                          int(N), {}, offsets_ready};
  detail::launch(x, w, p, M, false, stream);
}

void grouped_gemm_glu_few_rows(const void* x, const void* w13, void* h, void* ab, const int32_t* offsets, int64_t M,
                               int64_t I, int64_t K, int64_t E, const GluArgs& g, void* stream, const int32_t* rows,
                               int64_t k, int64_t ldx) {
  if (rows && k < 1) detail::check.fail("few-row grouped gemm: k must be positive");
  detail::FewRowsParams p{offsets, rows, int(rows ? k : 1), ldx, static_cast<__nv_bfloat16*>(h),
                          static_cast<__nv_bfloat16*>(ab), int(E), int(I), int(K), int(2 * I),
                          detail::glu_consts(g.swiglu, g.beta1, g.beta2), false};
  detail::launch(x, w13, p, M, true, stream);
}

}  // namespace lm::ops::cuda

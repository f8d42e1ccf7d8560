// Expert weight gradients on Hopper, the backward of grouped_gemm: dw[e] (+)= dy_eᵀ · x_e, one persistent launch.
//
// Legend: E experts (expert e owns rows offsets[e] .. offsets[e+1]−1 of the M permuted rows), dy [M, N] and
//         x [M, K] bf16, dw [E, N, K] fp32. Tile Bm × Bn = 128 rows of dw (N) × BN (128 | 192) columns (K); the
//         reduction runs over the expert's rows in steps of Bk = 64, S pipeline stages.
// Both operands arrive row-major in the reduction dimension, so the stage holds dy rows as the M-major A
// ([64 rows][64 n] atoms) and x rows as the N-major B ([64 rows][64 k] atoms), each written by TMA with the
// 128-byte swizzle; wgmma reads them transposed (no copy, no transposed weights).
// Warp roles (384 threads): warpgroup 0's first thread issues the TMA loads into the ring; warpgroups 1 and 2
// own 64 dw rows each and issue m64nBNk16 MMAs. The last step of an expert usually runs past its rows: each
// consumer zeroes those rows of its own A atom (the B rows it meets there belong to the next expert, finite,
// or are TMA's zero fill past M), so they add nothing. The fp32 dw tile leaves through shared memory as bulk
// copies with an add in L2 (cp.reduce.async.bulk), so no thread waits for the old values and the next tile's
// MMAs start at once.
// Tiles run heaviest expert first (every block sorts the experts by row count), so the static round-robin of
// the persistent grid ends with the light tiles; with `accumulate` the experts without rows are skipped.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/tensor_map.hpp"
#include "core/cuda/wgmma.cuh"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda {

namespace detail {
namespace {

using namespace lm::cu;  // core/cuda: mbarriers, TMA, wgmma, tensor maps, sm_count

constexpr int kBm = 128, kBk = 64, kThreads = 384, kAtom = 64 * 128;  // bytes of a [64][64] atom
constexpr int kMaxSortE = 256;  // more experts: tiles in expert order

struct WgradParams {
  const int32_t* offsets;
  float* dw;
  int E, N, K, accumulate;
};

// Stages, then the epilogue staging (per consumer warp 16 rows of BN fp32, rows LDS floats apart: the +8 keeps
// each half-warp's 8-byte stores on distinct banks), barriers, the expert order.
template <int BN>
struct WgSmem {
  static constexpr int S = BN == 192 ? 3 : 4, LDS = BN + 8;
  static constexpr int A = kBm * kBk * 2, B = BN * kBk * 2, stage = A + B;
  static constexpr int oStg = S * stage, oBar = oStg + 8 * 16 * LDS * 4, oOrder = oBar + 2 * S * 8,
                       bytes = oOrder + 4 * kMaxSortE;
};

template <int BN>
__device__ __forceinline__ void mma_step(float (&acc)[BN / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (BN == 192) wgmma_m64n192k16_ss_ta_tb(acc, da, db, scale_d);
  else wgmma_m64n128k16_ss_ta_tb(acc, da, db, scale_d);
}

template <int BN>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgrad_kernel(const __grid_constant__ CUtensorMap tmDy, const __grid_constant__ CUtensorMap tmX,
                         const WgradParams p) {
  using L = WgSmem<BN>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  constexpr int kStages = L::S;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::oBar);
  uint64_t* empty = full + kStages;
  int* order = reinterpret_cast<int*>(smem + L::oOrder);  // [kMaxSortE] experts, most rows first
  const int tid = threadIdx.x, wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 256);
    fence_barrier_init();
  }
  const bool sorted = p.E <= kMaxSortE;
  if (sorted) {
    // rank of e = experts with more rows (ties: lower index first); every block computes the same order
    for (int e = tid; e < p.E; e += kThreads) {
      const int me = p.offsets[e + 1] - p.offsets[e];
      int rank = 0;
      for (int f = 0; f < p.E; ++f) {
        const int mf = p.offsets[f + 1] - p.offsets[f];
        rank += (mf > me) || (mf == me && f < e);
      }
      order[rank] = e;
    }
  }
  __syncthreads();
  int nexp = p.E;
  if (sorted && p.accumulate) {  // count the experts with rows (the order puts them first)
    nexp = 0;
    for (int e = 0; e < p.E; ++e) nexp += p.offsets[e + 1] > p.offsets[e];
  }
  auto expert = [&](int r) { return sorted ? order[r] : r; };
  const int NTm = (p.N + kBm - 1) / kBm, NTn = (p.K + BN - 1) / BN, per = NTm * NTn, total = nexp * per;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      int it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const int e = expert(tile / per), r = tile % per, n0 = (r / NTn) * kBm, k0 = (r % NTn) * BN;
        const int row0 = p.offsets[e], me = p.offsets[e + 1] - row0, KT = (me + kBk - 1) / kBk;
        for (int kt = 0; kt < KT; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          unsigned char* st = smem + s * L::stage;
          mbar_expect_tx(&full[s], L::stage);
          const int row = row0 + kt * kBk;
          for (int a = 0; a < kBm / 64; ++a) tma_load_2d(st + a * kAtom, &tmDy, &full[s], n0 + 64 * a, row);
          for (int a = 0; a < BN / 64; ++a) tma_load_2d(st + L::A + a * kAtom, &tmX, &full[s], k0 + 64 * a, row);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int c = wg - 1, ltid = tid - 128 * wg, warp = ltid >> 5, lane = ltid & 31, g = lane >> 2, t = lane & 3;
  int it = 0;
  float acc[BN / 2];
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const int e = expert(tile / per), r = tile % per, n0 = (r / NTn) * kBm, k0 = (r % NTn) * BN;
    const int row0 = p.offsets[e], me = p.offsets[e + 1] - row0, KT = (me + kBk - 1) / kBk;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;  // an expert without rows stores zeros
    int prev = -1;
    for (int kt = 0; kt < KT; ++kt, ++it) {
      const int s = it % kStages;
      mbar_wait(&full[s], (it / kStages) & 1);
      unsigned char* sA = smem + s * L::stage + c * kAtom;  // this warpgroup's 64 dw rows
      const unsigned char* sB = smem + s * L::stage + L::A;
      const int valid = me - kt * kBk;
      if (valid < kBk) {  // rows past the expert: zero them in this warpgroup's A atom (whole 128-byte rows)
        for (int i = ltid; i < (kBk - valid) * 8; i += 128)
          *reinterpret_cast<uint4*>(sA + (valid + (i >> 3)) * 128 + (i & 7) * 16) = make_uint4(0, 0, 0, 0);
        fence_proxy_async();
        named_bar_sync<128>(1 + c);
      }
      wg_consume_stage(acc, [&] {
#pragma unroll
        for (int k16 = 0; k16 < kBk / 16; ++k16)
          mma_step<BN>(acc, wg_desc_mn(sA + k16 * 16 * 128, kAtom), wg_desc_mn(sB + k16 * 16 * 128, kAtom),
                       (kt > 0 || k16 > 0) ? 1 : 0);
      }, empty, prev, s);
    }
    wg_drain(acc, empty, prev);
    if (me == 0 && p.accumulate) continue;  // (only without the sorted order: nothing to add)

    // Epilogue: the accumulator (rows 16·warp + g (+8) of this warpgroup's 64, columns 8j + 2t (+1)) goes to this
    // warp's staging rows, and lanes 0..15 hand one dw row each to the bulk copy engine (an fp32 add in L2, or a
    // store), which runs on while the warp starts its next tile. The staging is reused once the engine has read it.
    float* stg = reinterpret_cast<float*>(smem + L::oStg) + (c * 4 + warp) * 16 * L::LDS;
    if (lane < 16) bulk_wait_read();
    __syncwarp();
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<float2*>(stg + (g + 8 * hr) * L::LDS + 8 * j + 2 * t) =
            make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
    fence_proxy_async();
    __syncwarp();
    const int row = n0 + 64 * c + 16 * warp + lane;
    if (lane < 16 && row < p.N) {
      const uint32_t src = smem_u32(stg + lane * L::LDS), bytes = uint32_t(min(BN, p.K - k0)) * 4;
      float* dst = p.dw + (int64_t(e) * p.N + row) * p.K + k0;
      if (p.accumulate) bulk_reduce_add_f32(dst, src, bytes);
      else bulk_store(dst, src, bytes);
    }
    if (lane < 16) bulk_commit();
  }
  if (lane < 16) bulk_wait();  // every dw row written
}

constexpr cu::Checker check{"moe cuda"};

template <int BN>
void launch(const void* dy, const void* x, const WgradParams& p, int64_t M, cudaStream_t s) {
  constexpr int smem = WgSmem<BN>::bytes + 1024;
  static bool attr = [] {
    return cudaFuncSetAttribute(grouped_wgrad_kernel<BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) ==
           cudaSuccess;
  }();
  (void)attr;
  const CUtensorMap tdy = bf16_row_map(dy, M, p.N, kBk), tx = bf16_row_map(x, M, p.K, kBk);
  const int64_t tiles = int64_t(p.E) * ((p.N + kBm - 1) / kBm) * ((p.K + BN - 1) / BN);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(sm_count(), tiles)));
  grouped_wgrad_kernel<BN><<<grid, kThreads, smem, s>>>(tdy, tx, p);
  check(cudaGetLastError(), "grouped wgrad launch");
}

}  // namespace
}  // namespace detail

void grouped_gemm_wgrad(const void* dy, const void* x, float* dw, const int32_t* offsets, int64_t M, int64_t N,
                        int64_t K, int64_t E, bool accumulate, void* stream) {
  if (M < 0 || N < 8 || K < 8 || E < 1 || N % 8 || K % 8) detail::check.fail("bad grouped wgrad shape");
  if (M >= (int64_t(1) << 31) || E * N * K >= (int64_t(1) << 40) || E * ((N + 127) / 128) * ((K + 127) / 128) >= (1 << 30))
    detail::check.fail("grouped wgrad too large");
  auto s = lm::cu::stream(stream);
  if (M == 0) {  // no rows at all: dw stays, or becomes zeros
    if (!accumulate && cudaMemsetAsync(dw, 0, size_t(E * N * K) * 4, s) != cudaSuccess)
      detail::check.fail("grouped wgrad memset");
    return;
  }
  detail::WgradParams p{offsets, dw, int(E), int(N), int(K), accumulate ? 1 : 0};
  // Column tile: the one that pads K less (192 on ties: fewer, larger tiles).
  const int64_t pad192 = (K + 191) / 192 * 192, pad128 = (K + 127) / 128 * 128;
  if (pad192 <= pad128) detail::launch<192>(dy, x, p, M, s);
  else detail::launch<128>(dy, x, p, M, s);
}

}  // namespace lm::ops::cuda

// Grouped expert GEMMs on Hopper: TMA loads, wgmma (m64n256k16, bf16 in, fp32 accumulate), one persistent
// launch over every (expert, m tile, n tile), optionally with SiTU/SwiGLU fused into the epilogue.
//
// Legend: E experts, M permuted rows (expert e owns rows offsets[e] .. offsets[e+1]−1), K reduction dim,
//         N output columns (GLU: I, with 2I weight rows per expert), Bm × Bn × Bk = 128 × 256 (or 192) × 64 tiles,
//         S pipeline stages.
// Warp roles (384 threads): warpgroup 0 is the producer (one thread issues the TMA loads of A = x rows and
// B = weight rows into an S-stage ring guarded by full/empty mbarriers); warpgroups 1 and 2 each own 64 rows
// of the tile and issue wgmma from shared memory. The producer runs ahead into the next tile while the
// consumers store the previous one (the grid is persistent: tile = blockIdx.x + i·gridDim.x).
// Tiles are numbered m-tile-major with the n tiles inner, so blocks running together share A rows and one
// expert's weights in L2. An m tile may run past its expert's last row: those rows (the next expert's, or
// TMA's zero fill past M) are computed and never stored.
// GLU: the B tile stacks 128 gate rows over the matching 128 up rows, so the accumulator holds a and b of the
// same output column in the same thread (n8 blocks j and j + 16).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/tensor_map.hpp"
#include "core/cuda/wgmma.cuh"
#include "core/env.hpp"
#include "ops/moe/cuda/glu_epilogue.cuh"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda {

namespace detail {
namespace {

using namespace lm::cu;  // core/cuda: mbarriers, TMA, wgmma, tensor maps, sm_count

using bf16 = __nv_bfloat16;
constexpr int kBm = 128, kBn = 256, kBk = 64, kStages = 4, kThreads = 384;
constexpr int kABytes = kBm * kBk * 2;  // A tile; the B tile is BN · kBk · 2 (BN: the kernel's template argument)
constexpr int kMaxE = 4096;
constexpr int kDefaultOrder = 1, kDefaultEpi = 1;  // measured best or tied on every benchmark shape
constexpr int kStagingBytes = 8 * 2048;

struct GemmParams {
  const int32_t* offsets;
  bf16* y;   // [M, N] (GLU: h [M, I])
  bf16* ab;  // GLU only, nullable: [M, 2I]
  int E, N, K, Nw;  // Nw weight rows per expert (N, or 2I for GLU)
  GluConsts glu;
  int order;  // tile order, see decode_tile
  int epi;    // epilogue: 0 stores from the accumulators, 1 through shared memory in 16-byte rows
};

// Tile -> (expert e, m tile inside the expert, n tile), from the m-tile prefix pre[0..E] (pre[e] = m tiles
// before expert e). order 0: m tiles outer, n tiles inner (blocks running together share A rows); order 1:
// per expert, n tiles outer and m tiles inner (blocks running together share weight tiles).
struct TileId {
  int e, mt, nt;
};
__device__ __forceinline__ TileId decode_tile(const int* pre, int E, int NT, int order, int tile) {
  const int x = order == 0 ? tile / NT : tile;
  const int mul = order == 0 ? 1 : NT;
  int lo = 0, hi = E;  // pre[lo]·mul <= x < pre[hi]·mul
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (pre[mid] * mul <= x) lo = mid;
    else hi = mid;
  }
  if (order == 0) return {lo, x - pre[lo], tile % NT};
  const int local = tile - pre[lo] * NT, me = pre[lo + 1] - pre[lo];
  return {lo, local % me, local / me};
}

// BN: the tile's weight rows, 256 or (plain products whose N is a multiple of 192 but not of 256, such as the
// dh product at I = 384) 192, so no third of a tile is computed for nothing.
template <bool GLU, int BN = kBn>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const GemmParams p) {
  static_assert(BN == 256 || (BN == 192 && !GLU), "tiles of 256 weight rows, or 192 without the GLU");
  constexpr int kBBytes = BN * kBk * 2, kStageBytes = kABytes + kBBytes;
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte alignment for the swizzled tiles (the launch asks for 1 KB of slack).
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* staging = smem + kStages * kStageBytes;  // 8 consumer warps × 2 KB (epilogue)
  uint64_t* full = reinterpret_cast<uint64_t*>(staging + kStagingBytes);
  uint64_t* empty = full + kStages;
  int* pre = reinterpret_cast<int*>(empty + kStages);

  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 256);
    fence_barrier_init();
  }
  if (tid < 32) {  // m-tile prefix over experts (warp scan in chunks of 32)
    int run = 0;
    if (tid == 0) pre[0] = 0;
    for (int e0 = 0; e0 < p.E; e0 += 32) {
      const int e = e0 + tid;
      int c = e < p.E ? (p.offsets[e + 1] - p.offsets[e] + kBm - 1) / kBm : 0;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, c, off);
        if (tid >= off) c += v;
      }
      if (e < p.E) pre[e + 1] = run + c;
      run += __shfl_sync(0xffffffffu, c, 31);
    }
  }
  __syncthreads();
  constexpr int BNo = GLU ? BN / 2 : BN;  // output columns per tile
  const int NT = (p.N + BNo - 1) / BNo, total = pre[p.E] * NT, KT = (p.K + kBk - 1) / kBk;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      int it = 0;
      for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        const TileId id = decode_tile(pre, p.E, NT, p.order, tile);
        const int row0 = p.offsets[id.e] + id.mt * kBm;
        const int wrow = id.e * p.Nw + id.nt * BNo;
        for (int kt = 0; kt < KT; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty[s], ((it / kStages) & 1) ^ 1);
          unsigned char* st = smem + s * kStageBytes;
          mbar_expect_tx(&full[s], kStageBytes);
          tma_load_2d(st, &tmA, &full[s], kt * kBk, row0);
          if (GLU) {
            tma_load_2d(st + kABytes, &tmB, &full[s], kt * kBk, wrow);
            tma_load_2d(st + kABytes + kBBytes / 2, &tmB, &full[s], kt * kBk, wrow + p.N);
          } else {
            tma_load_2d(st + kABytes, &tmB, &full[s], kt * kBk, wrow);
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, ltid = tid - 128 * wg, warp = ltid >> 5, lane = ltid & 31, g = lane >> 2, t = lane & 3;
    int it = 0;
    float acc[BN / 2];
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
      const TileId id = decode_tile(pre, p.E, NT, p.order, tile);
      const int row0 = p.offsets[id.e] + id.mt * kBm, row_end = p.offsets[id.e + 1], nt = id.nt;
      int prev = -1;
      for (int kt = 0; kt < KT; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(&full[s], (it / kStages) & 1);
        const unsigned char* st = smem + s * kStageBytes;
        wg_consume_stage(acc, [&] {
#pragma unroll
          for (int k16 = 0; k16 < kBk / 16; ++k16)
            if constexpr (BN == 256)
              wgmma_m64n256k16(acc, wg_desc(st + c * (kABytes / 2) + k16 * 32), wg_desc(st + kABytes + k16 * 32),
                               (kt > 0 || k16 > 0) ? 1 : 0);
            else
              wgmma_m64n192k16(acc, wg_desc(st + c * (kABytes / 2) + k16 * 32), wg_desc(st + kABytes + k16 * 32),
                               (kt > 0 || k16 > 0) ? 1 : 0);
        }, empty, prev, s);
      }
      wg_drain(acc, empty, prev);

      // Epilogue. The accumulator holds rows g and g + 8 (of this warp's 16), columns 8j + 2t (+1).
      const int rl = row0 + c * 64 + warp * 16;
      auto value = [&](int hr, int j) -> uint32_t {  // bf16 pair of row g + 8·hr, output n8 block j
        if (GLU) {
          const float a0 = acc[4 * j + 2 * hr], a1 = acc[4 * j + 2 * hr + 1];
          const float b0 = acc[4 * (j + 16) + 2 * hr], b1 = acc[4 * (j + 16) + 2 * hr + 1];
          return pack_bf16(glu_epilogue(a0, b0, p.glu), glu_epilogue(a1, b1, p.glu));
        }
        return pack_bf16(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
      };
      constexpr int NB8 = BNo / 8;  // output n8 blocks per tile
      if (p.epi == 1) {
        // Per warp, 64-column chunks: registers -> shared memory (16-byte chunks swizzled by row, no bank
        // conflicts) -> 16-byte coalesced global stores, 4 rows of 128 bytes per warp instruction. Chunk ch of
        // `out` (row stride ld, valid columns < lim) takes the n8 blocks j0 + 8·ch .. +7 of val.
        unsigned char* stg = staging + (c * 4 + warp) * 2048;
        auto store_chunks = [&](bf16* out, int64_t ld, int lim, int nchunks, int j0, auto&& val) {
#pragma unroll
          for (int ch = 0; ch < nchunks; ++ch) {
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)
#pragma unroll
              for (int hr = 0; hr < 2; ++hr) {
                const int r = g + 8 * hr;
                *reinterpret_cast<uint32_t*>(stg + r * 128 + ((nb ^ (r & 7)) << 4) + 4 * t) = val(hr, j0 + ch * 8 + nb);
              }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int idx = lane + 32 * i, r = idx >> 3, cc = idx & 7;
              const int row = rl + r, col = nt * BNo + ch * 64 + cc * 8;
              const uint4 v = *reinterpret_cast<const uint4*>(stg + r * 128 + ((cc ^ (r & 7)) << 4));
              if (row < row_end && col < lim) *reinterpret_cast<uint4*>(out + int64_t(row) * ld + col) = v;
            }
            __syncwarp();
          }
        };
        store_chunks(p.y, p.N, p.N, NB8 / 8, 0, value);
        if (GLU && p.ab) {  // pre-activations for the backward: a then b columns of the [M, 2I] rows
          auto raw = [&](int hr, int j) { return pack_bf16(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]); };
          store_chunks(p.ab, 2 * int64_t(p.N), p.N, 2, 0, raw);
          store_chunks(p.ab + p.N, 2 * int64_t(p.N), p.N, 2, 16, raw);
        }
      } else {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = rl + g + hr * 8;
          if (row >= row_end) continue;
#pragma unroll
          for (int j = 0; j < NB8; ++j) {
            const int col = nt * BNo + j * 8 + 2 * t;
            if (col < p.N) *reinterpret_cast<uint32_t*>(p.y + int64_t(row) * p.N + col) = value(hr, j);
          }
        }
      }
      if (GLU && p.ab && p.epi != 1) {  // pre-activations for the backward (epi 1 stored them above)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = rl + g + hr * 8;
          if (row >= row_end) continue;
          bf16* abrow = p.ab + int64_t(row) * 2 * p.N;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int col = nt * BNo + j * 8 + 2 * t;
            if (col >= p.N) continue;
            *reinterpret_cast<uint32_t*>(abrow + col) = pack_bf16(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
            *reinterpret_cast<uint32_t*>(abrow + p.N + col) = pack_bf16(acc[4 * (j + 16) + 2 * hr], acc[4 * (j + 16) + 2 * hr + 1]);
          }
        }
      }
    }
  }
}

// ---- host: tensor maps and launch ------------------------------------------------------------------
constexpr cu::Checker check{"moe cuda"};

template <bool GLU, int BN = kBn>
void launch(const void* x, const void* w, const GemmParams& p, int64_t M, cudaStream_t s) {
  constexpr int kStageBytes = kABytes + BN * kBk * 2;
  const int smem = kStages * kStageBytes + kStagingBytes + 2 * kStages * 8 + (p.E + 1) * 4 + 1024;
  static bool attr = [] {
    return cudaFuncSetAttribute(grouped_gemm_kernel<GLU, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kStages * kStageBytes + kStagingBytes + 2 * kStages * 8 + (kMaxE + 1) * 4 + 1024) ==
                                   cudaSuccess;
  }();
  (void)attr;
  GemmParams q = p;
  q.order = env::gg_order(kDefaultOrder);  // tile order override (benchmarks)
  q.epi = env::gg_epi(kDefaultEpi);        // epilogue override (benchmarks, tests)
  const CUtensorMap ta = bf16_row_map(x, M, p.K, kBm);
  const CUtensorMap tb = bf16_row_map(w, int64_t(p.E) * p.Nw, p.K, GLU ? BN / 2 : BN);
  const int BNo = GLU ? BN / 2 : BN;
  const int64_t ub = ((M + kBm - 1) / kBm + p.E) * ((p.N + BNo - 1) / BNo);  // tiles, upper bound
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(sm_count(), ub)));
  grouped_gemm_kernel<GLU, BN><<<grid, kThreads, smem, s>>>(ta, tb, q);
  check(cudaGetLastError(), "grouped gemm launch");
}

void check_args(int64_t M, int64_t N, int64_t K, int64_t E) {
  if (M < 0 || N < 8 || K < 8 || E < 1) check.fail("bad grouped gemm shape");
  if (N % 8 || K % 8) check.fail("grouped gemm needs N and K multiples of 8");
  if (E > kMaxE) check.fail("at most 4096 experts per launch");
  if (M >= (int64_t(1) << 31) || int64_t(E) * N * 2 >= (int64_t(1) << 31)) check.fail("grouped gemm too large");
}

}  // namespace
}  // namespace detail

void grouped_gemm(const void* x, const void* w, void* y, const int32_t* offsets, int64_t M, int64_t N, int64_t K,
                  int64_t E, void* stream) {
  detail::check_args(M, N, K, E);
  if (M == 0) return;
  detail::GemmParams p{};
  p.offsets = offsets, p.y = static_cast<detail::bf16*>(y), p.ab = nullptr;
  p.E = int(E), p.N = int(N), p.K = int(K), p.Nw = int(N);
  // 192-row weight tiles where they pad N less than 256-row ones (LONGMOE_GG_BN=256 keeps 256, benchmarks)
  const int64_t pad256 = (N + 255) / 256 * 256, pad192 = (N + 191) / 192 * 192;
  if (pad192 < pad256 && !env::gg_bn256())
    detail::launch<false, 192>(x, w, p, M, lm::cu::stream(stream));
  else
    detail::launch<false>(x, w, p, M, lm::cu::stream(stream));
}

void grouped_gemm_glu(const void* x, const void* w13, void* h, void* ab, const int32_t* offsets, int64_t M, int64_t I,
                      int64_t K, int64_t E, const GluArgs& g, void* stream) {
  detail::check_args(M, 2 * I, K, E);
  if (M == 0) return;
  detail::GemmParams p{};
  p.offsets = offsets, p.y = static_cast<detail::bf16*>(h), p.ab = static_cast<detail::bf16*>(ab);
  p.E = int(E), p.N = int(I), p.K = int(K), p.Nw = int(2 * I);
  p.glu = detail::glu_consts(g.swiglu, g.beta1, g.beta2);
  detail::launch<true>(x, w13, p, M, lm::cu::stream(stream));
}

void moe_expert_ffn(const void* xs, const void* w13, const void* w2, void* eo, const int32_t* offsets, int64_t M,
                    int64_t d, int64_t I, int64_t E, const GluArgs& g, void* h, void* stream) {
  if (M == 0) return;
  auto s = lm::cu::stream(stream);
  void* hbuf = h;
  if (!hbuf) detail::check(cu::malloc_async(&hbuf, size_t(M) * I * 2, s), "expert ffn scratch");
  grouped_gemm_glu(xs, w13, hbuf, nullptr, offsets, M, I, d, E, g, stream);
  grouped_gemm(hbuf, w2, eo, offsets, M, d, I, E, stream);
  if (!h) detail::check(cudaFreeAsync(hbuf, s), "expert ffn scratch free");
}

}  // namespace lm::ops::cuda

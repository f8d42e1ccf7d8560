#pragma once
// Register-state helpers shared by the chunk recurrences (recur.cu, recur_wgmma.cu).
//
// Legend: KP = K, V padded to 64|128; a warp holds Sᵀ for 16 value columns e (ew..ew+15) × KP keys d as
//         mma accumulators st[KP/8][4] (element x of n8 tile nt: e = ew + g + 8(x>>1), d = 8nt + 2t + (x&1)).
#include "ops/kda/cuda/common.cuh"

namespace lm::kda::cuda::detail {

// Accumulator tile (rows e = value column, cols c) to the per-warp staging [c][e] bf16 (transposed).
template <int NTILES, int LDS>
__device__ __forceinline__ void stage_t(bf16* stg, const float (*acc)[4], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NTILES; ++nt) {
    const int c0 = 8 * nt + 2 * t;
    stg[c0 * LDS + g] = __float2bfloat16_rn(acc[nt][0]);
    stg[(c0 + 1) * LDS + g] = __float2bfloat16_rn(acc[nt][1]);
    stg[c0 * LDS + g + 8] = __float2bfloat16_rn(acc[nt][2]);
    stg[(c0 + 1) * LDS + g + 8] = __float2bfloat16_rn(acc[nt][3]);
  }
}
// Staging rows [0, R) x 16 columns to dst (row stride ld elements), 16 bytes per lane and step.
template <int R, int LDS>
__device__ __forceinline__ void copy_out(bf16* dst, int64_t ld, const bf16* stg, int lane) {
#pragma unroll 4
  for (int idx = lane; idx < 2 * R; idx += 32) {
    const int r = idx >> 1, hv = (idx & 1) * 8;
    *reinterpret_cast<uint4*>(dst + r * ld + hv) = *reinterpret_cast<const uint4*>(stg + r * LDS + hv);
  }
}

// State (Sᵀ fragments of value columns ew.., all KP keys) from / to a [K][V] f32 matrix.
template <int KP>
__device__ __forceinline__ void load_state(float (*st)[4], const float* src, int K, int V, int ew, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int d = 8 * nt + 2 * t + (x & 1), e = ew + g + (x >> 1) * 8;
      st[nt][x] = (src && d < K && e < V) ? src[int64_t(d) * V + e] : 0.f;
    }
}
template <int KP>
__device__ __forceinline__ void store_state(const float (*st)[4], float* dst, int K, int V, int ew, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int d = 8 * nt + 2 * t + (x & 1), e = ew + g + (x >> 1) * 8;
      if (d < K && e < V) dst[int64_t(d) * V + e] = st[nt][x];
    }
}

}  // namespace lm::kda::cuda::detail

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

// State (Sᵀ fragments of value columns ew.., all KP keys) from / to a [K][V] f32 matrix: f(nt, x, d, e) for each
// fragment element (nt, x) of the lane, which holds key d and value column e.
template <int KP, class F>
__device__ __forceinline__ void for_state(int ew, int lane, F&& f) {
#pragma unroll
  for (int nt = 0; nt < KP / 8; ++nt)
#pragma unroll
    for (int x = 0; x < 4; ++x) f(nt, x, 8 * nt + 2 * (lane & 3) + (x & 1), ew + (lane >> 2) + (x >> 1) * 8);
}
template <int KP>
__device__ __forceinline__ void load_state(float (*st)[4], const float* src, int K, int V, int ew, int lane) {
  for_state<KP>(ew, lane, [&](int nt, int x, int d, int e) {
    st[nt][x] = (src && d < K && e < V) ? src[int64_t(d) * V + e] : 0.f;
  });
}
template <int KP>
__device__ __forceinline__ void store_state(const float (*st)[4], float* dst, int K, int V, int ew, int lane) {
  for_state<KP>(ew, lane, [&](int nt, int x, int d, int e) {
    if (d < K && e < V) dst[int64_t(d) * V + e] = st[nt][x];
  });
}

// Eᵀ = Uᵀ - ae in place (ae: this warp's -Sᵀ Wᵀ, 16 value columns × 64 chunk rows; U [64][LDU] in shared memory,
// fp16 or bf16, the warp's columns at `col`), and Eᵀ as A fragments over the chunk rows.
template <bool F16, int LDU>
__device__ __forceinline__ void e_from_u(uint32_t (&ea)[4][4], float (&ae)[8][4], const bf16* sU, int col, int lane) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t u[4];
    ldsm4t(u, sU + 16 * kk * LDU + col + at_off(lane, LDU));
    const float2 u0 = unpack2<F16>(u[0]), u1 = unpack2<F16>(u[1]), u2 = unpack2<F16>(u[2]), u3 = unpack2<F16>(u[3]);
    float* e0 = ae[2 * kk];
    float* e1 = ae[2 * kk + 1];
    e0[0] = u0.x - e0[0], e0[1] = u0.y - e0[1], e0[2] = u1.x - e0[2], e0[3] = u1.y - e0[3];
    e1[0] = u2.x - e1[0], e1[1] = u2.y - e1[1], e1[2] = u3.x - e1[2], e1[3] = u3.y - e1[3];
    c_to_a<F16>(ea[kk], ae[2 * kk], ae[2 * kk + 1]);
  }
}
// A warp's accumulator tile (16 columns × R rows) to dst [R][ld] bf16 through its staging buffer.
template <int R, int LDS>
__device__ __forceinline__ void store_tile_t(bf16* dst, int64_t ld, bf16* stg, const float (*acc)[4], int lane) {
  stage_t<R / 8, LDS>(stg, acc, lane);
  __syncwarp();
  copy_out<R, LDS>(dst, ld, stg, lane);
  __syncwarp();
}

}  // namespace lm::kda::cuda::detail

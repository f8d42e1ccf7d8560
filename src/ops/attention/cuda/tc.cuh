#pragma once
// Device helpers of the attention kernels on top of core/cuda (mma.cuh: mma.sync, ldmatrix, cp.async; hopper.cuh
// and wgmma.cuh for the warpgroup kernels, whose names this header also brings into the kernels' namespace):
// tile loads with zero-filled rows, and the fast exp2.
//
// Fragment names follow the PTX ISA: g = lane / 4 (row in an 8-row group), t = lane % 4 (column pair).
// An m16n8 fp32 accumulator c[4] holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/mma.cuh"

namespace lm::ops::cuda::detail {

using namespace lm::cu;  // core/cuda: packing, ldmatrix, mma.sync, cp.async (and wgmma, TMA where included)
using bf16 = __nv_bfloat16;

// R x COLS bf16 tile from rows of stride gstride (elements) into shared memory of row stride LD, rows >= nr
// zero-filled (their source address is clamped to row 0, which is always valid).
template <int R, int COLS, int LD, int NT>
__device__ __forceinline__ void load_rows(bf16* s, const bf16* g, int64_t gstride, int nr, int tid) {
  constexpr int VPR = COLS / 8;
#pragma unroll
  for (int idx = tid; idx < R * VPR; idx += NT) {
    const int r = idx / VPR, c = (idx % VPR) * 8;
    const bool ok = r < nr;
    cp_async16(s + r * LD + c, g + (ok ? static_cast<int64_t>(r) * gstride : 0) + c, ok);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace lm::ops::cuda::detail

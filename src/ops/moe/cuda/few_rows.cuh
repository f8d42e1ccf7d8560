#pragma once
// The few-rows-per-expert grouped GEMM (few_rows.cu): what grouped_gemm / grouped_gemm_glu (gemm.cu) launch when
// M is at most moe_few_rows_max() (decode). Same shapes and layouts as those (moe_cuda.hpp).
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/moe/cuda/glu_epilogue.cuh"

namespace lm::ops::cuda::detail {

// Rows (M) up to which the few-row kernel runs: LONGMOE_MOE_FEW_ROWS (0: never, benchmarks), else 64. The wgmma
// kernel overtakes it once the experts average several rows each (measured: bench moe --device cuda).
constexpr int64_t kFewRowsMax = 64;

struct FewRowsParams {
  const int32_t* offsets;
  __nv_bfloat16* y;   // [M, N] (GLU: h [M, I])
  __nv_bfloat16* ab;  // GLU only, nullable: the pre-activations [M, 2I], a then b columns
  int E, N, K, Nw;    // Nw weight rows per expert (N, or 2I for GLU)
  GluConsts glu;
};

void launch_few_rows(const void* x, const void* w, const FewRowsParams& p, int64_t M, bool glu, void* stream);

}  // namespace lm::ops::cuda::detail

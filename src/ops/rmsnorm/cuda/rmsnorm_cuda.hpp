#pragma once
// RMSNorm on the GPU (the CPU definitions in ops/rmsnorm/rmsnorm.hpp): plain and the gated per-head KDA form.
// Plain C++ (no CUDA types); device pointers; stream is a cudaStream_t (null: default stream).
//
// Legend: rows independent vectors, D normalised width, ld* row strides in elements (0: D).
// dtypes: x, dx, dy, gate, dgate, dout are F32 or BF16 as stated per argument (DType tells); y, out bf16
//         (every norm output feeds a GEMM); w fp32 [D]; dw fp32 [D] accumulated; rstd fp32 [rows].
//   n = x · rstd (fp32), y = bf16(n) · w as the CPU path (the cast before the weight multiply is skipped:
//   y = bf16(n · w), computed in fp32 and rounded once).
//   backward: g = w · dy, dx = rstd · (g − n · mean(g · n)), dw += Σ_rows dy · n (deterministic: fixed row
//   blocks, partial sums reduced in a fixed order).
#include <cstdint>

#include "core/dtype.hpp"

namespace lm::ops::cuda {

void rmsnorm_forward(const void* x, DType x_type, const float* w, void* y, float* rstd, int64_t rows, int64_t D,
                     float eps, int64_t ldx = 0, int64_t ldy = 0, void* stream = nullptr);

// dx (F32 or BF16, stride ldx) written, or added to when accumulate_dx (then F32 only). dw nullable.
void rmsnorm_backward(const void* x, DType x_type, const float* w, const float* rstd, const void* dy, DType dy_type,
                      void* dx, DType dx_type, float* dw, int64_t rows, int64_t D, float eps, int64_t ldx = 0,
                      int64_t ldy = 0, bool accumulate_dx = false, int64_t lddx = 0, void* stream = nullptr);

// Gated (KDA output, SPEC §2): out = bf16((w · x · rstd) · sigmoid(gate)); x bf16 [rows, D] (rows = T·H,
// D = V), gate bf16 [rows, D], out bf16, rstd fp32 [rows].
void rmsnorm_gated_forward(const void* x, const void* gate, const float* w, void* out, float* rstd, int64_t rows,
                           int64_t D, float eps, void* stream = nullptr);
// dout F32 [rows, D]; dx bf16, dgate bf16 written; dw fp32 accumulated (nullable).
void rmsnorm_gated_backward(const void* x, const void* gate, const float* w, const float* rstd, const float* dout,
                            void* dx, void* dgate, float* dw, int64_t rows, int64_t D, float eps,
                            void* stream = nullptr);

}  // namespace lm::ops::cuda

#pragma once
// Gated linear units on the GPU (ops/glu/glu.hpp; the forward is also fused into the grouped expert GEMM,
// ops/moe/cuda). Plain C++ (no CUDA types).
//
// Legend: rows, I intermediate width. ab bf16 [rows, 2I] = [a | b]; h bf16 [rows, I]; dh F32 or BF16
//         [rows, I]; dab bf16 [rows, 2I]. Math in fp32.
#include <cstdint>

#include "core/dtype.hpp"
#include "ops/glu/glu.hpp"

namespace lm::ops::cuda {

// ldab, lddab: row strides of ab and dab in elements (0: 2I; dab may sit in a wider gradient buffer).
void glu_forward(const void* ab, void* h, int64_t rows, int64_t I, const GluParams& p, void* stream = nullptr,
                 int64_t ldab = 0);
void glu_backward(const void* ab, const void* dh, DType dh_type, void* dab, int64_t rows, int64_t I,
                  const GluParams& p, void* stream = nullptr, int64_t ldab = 0, int64_t lddab = 0);

}  // namespace lm::ops::cuda

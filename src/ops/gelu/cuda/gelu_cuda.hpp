#pragma once
// GELU on the GPU (the CPU definitions and formulas in ops/gelu/gelu.hpp), elementwise: the vision tower's MLP
// (Tanh) and the projector (Erf). Plain C++ (no CUDA types); device pointers; stream is a cudaStream_t (null:
// default stream).
//
// Legend: n elements (any shape, contiguous).
// dtypes: a fp32 [n] (the pre-activation, kept fp32 for the backward); g bf16 [n] (it feeds a GEMM);
//         dg F32 or BF16 [n] (dg_type tells); da bf16 [n]. Math in fp32 (tanhf / erff / expf).
//   forward:  g  = bf16(gelu(a))
//   backward: da = bf16(dg · gelu'(a));  da may alias dg when dg is bf16 (each element is read before written).
#include <cstdint>

#include "core/dtype.hpp"
#include "ops/gelu/gelu.hpp"

namespace lm::ops::cuda {

void gelu_forward(const float* a, void* g, int64_t n, GeluKind kind, void* stream = nullptr);
void gelu_backward(const float* a, const void* dg, DType dg_type, void* da, int64_t n, GeluKind kind,
                   void* stream = nullptr);

}  // namespace lm::ops::cuda

#pragma once
// 2-D RoPE of the vision tower on the GPU (the CPU definition, math and table layout in ops/rope2d/rope2d.hpp),
// in place on q or k. Plain C++ (no CUDA types); device pointers; stream is a cudaStream_t (null: default
// stream).
//
// Legend: rows tokens, H heads, Dh head dim (a multiple of 4), J = Dh/4, ld row stride of x in elements
//         (>= H·Dh; head h at columns h·Dh ..).
// dtypes: x bf16 [rows, ld], turned in place (math fp32, one bf16 rounding per element; columns past H·Dh
//         untouched); cs fp32 [rows, Dh] = [rows, J, 2, 2] on the DEVICE, exactly ops::rope2d_table<float>'s
//         layout (the caller builds it on the host and uploads it).
//   inverse: the turn by −φ (the backward: the transpose of a rotation).
#include <cstdint>

namespace lm::ops::cuda {

void rope2d_apply(void* x, int64_t rows, int64_t H, int64_t Dh, int64_t ld, const float* cs, bool inverse = false,
                  void* stream = nullptr);

}  // namespace lm::ops::cuda

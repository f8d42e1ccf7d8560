#pragma once
// Bilinear resize of a channels-last grid on the GPU (the CPU definition and the tap formula in
// ops/bilinear/bilinear.hpp; PyTorch's align_corners=False): the vision tower's position table resized to an
// image's patch grid. Plain C++ (no CUDA types); device pointers; stream is a cudaStream_t (null: default
// stream).
//
// Legend: Hi×Wi input grid, Ho×Wo output grid, C channels.
// dtypes: fp32 throughout. src, dsrc [Hi, Wi, C]; dst, ddst [Ho, Wo, C].
// The taps are recomputed in the kernels in double, rounded as ops::bilinear_taps (no contraction), so the
// weights match the CPU's; equal sizes are the identity (a copy forward, an add backward).
//   forward:  dst written.
//   backward: dsrc += the transpose of the forward applied to ddst. Deterministic: each source cell gathers the
//             output cells whose taps name it, in the CPU's order (outputs row-major, taps (i0,j0) (i0,j1)
//             (i1,j0) (i1,j1)); no atomics.
#include <cstdint>

namespace lm::ops::cuda {

void bilinear_resize_forward(const float* src, int64_t Hi, int64_t Wi, int64_t C, float* dst, int64_t Ho, int64_t Wo,
                             void* stream = nullptr);
void bilinear_resize_backward(const float* ddst, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho, int64_t Wo, float* dsrc,
                              void* stream = nullptr);

}  // namespace lm::ops::cuda

#pragma once
// Block Attention Residuals read on the GPU (the CPU definitions in ops/attnres/attnres.hpp), fp32 throughout
// (the residual stream and its block sums stay fp32 on the GPU). Plain C++ (no CUDA types).
//
// Legend: N sources (N <= 32), T tokens, d hidden. v: HOST array of N device pointers, each [T, d] fp32;
//         w, gamma [d] fp32; h [T, d] fp32.
//   r_j = sqrt(mean_d(v_j²) + eps), z_j = (gamma ⊙ w) · v_j / r_j, a = softmax_j(z), h = Σ_j a_j v_j.
#include <cstdint>

namespace lm::ops::cuda {

void attnres_forward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                     float eps, float* h, void* stream = nullptr);

// dv: HOST array of N device pointers, each accumulated (+=; null entry: skipped). dw, dgamma [d] accumulated
// (nullable), reduced deterministically (fixed token blocks, fixed order). Recomputes the forward from v.
void attnres_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                      float eps, const float* dh, float* const* dv, float* dw, float* dgamma, void* stream = nullptr);

}  // namespace lm::ops::cuda

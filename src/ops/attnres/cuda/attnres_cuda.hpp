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

// A read followed by the RMSNorm that consumes it (the decoder's input / post-attention norms, the final norm),
// fused so h does not go through memory: y [T, d] bf16 = bf16(h · rstd · gn), rstd [T] = 1/sqrt(mean_d(h²) +
// eps_n) (the plain RMSNorm of ops/rmsnorm/cuda with x = h). h [T, d] fp32 is written too when not null.
void attnres_norm_forward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w, const float* gamma,
                          float eps, const float* gn, float eps_n, void* y, float* rstd, float* h = nullptr,
                          void* stream = nullptr);

// The pair's backward from dy [T, d] fp32 (the gradient of y) and the forward's rstd: dv, dw, dgamma as
// attnres_backward with dh the norm's input gradient (never stored); dgn [d] += Σ_t dy ⊙ h · rstd (nullable,
// deterministic). dlast [T, d] bf16 (nullable; needs dv[N−1]): the updated dv[N−1] rounded to bf16, for the
// GEMMs of the layer part that produced the last source.
void attnres_norm_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w,
                           const float* gamma, float eps, const float* gn, float eps_n, const float* rstd,
                           const float* dy, float* const* dv, float* dw, float* dgamma, float* dgn, void* dlast,
                           void* stream = nullptr);

}  // namespace lm::ops::cuda

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

// Deferred gradients of closed sources (the model's closed blocks, shared by all reads of a block group): a
// read that defers its first C sources leaves their dv[j] alone and stores its δ (the read's input gradient,
// bf16), the per-token coefficients and q; attnres_flush later adds every such read at once (SPEC §6's dv_j):
//   dv_j += Σ_r (a_rj δ_r + c_rj q_r − e_rj v_j),   c = dz_j / r_j, e = dz_j z_j / (r_j² d).
// Each closed block's gradient is then read and written once per group instead of once per read. Buffers are
// the caller's: delta [T, d] bf16, coef [T, C] × (a, c, e, 0) fp32, q [d] fp32.
struct AttnResDeferred {
  int64_t closed = 0;  // C >= 1
  void* delta = nullptr;
  float* coef = nullptr;
  float* q = nullptr;
};

// The pair's backward from dy [T, d] fp32 (the gradient of y) and the forward's rstd: dv, dw, dgamma as
// attnres_backward with dh the norm's input gradient (never stored); dgn [d] += Σ_t dy ⊙ h · rstd (nullable,
// deterministic). dlast [T, d] bf16 (nullable; needs dv[N−1]): the updated dv[N−1] rounded to bf16, for the
// GEMMs of the layer part that produced the last source. defer (nullable, C < N): dv[j] for j < C is ignored
// and the read is stored for attnres_flush instead (only where attnres_can_defer(N, d)).
void attnres_norm_backward(const float* const* v, int64_t N, int64_t T, int64_t d, const float* w,
                           const float* gamma, float eps, const float* gn, float eps_n, const float* rstd,
                           const float* dy, float* const* dv, float* dw, float* dgamma, float* dgn, void* dlast,
                           void* stream = nullptr, const AttnResDeferred* defer = nullptr);

// Whether attnres_norm_backward can defer at N sources and width d (its fused register path applies).
bool attnres_can_defer(int64_t N, int64_t d);

// Adds R deferred reads (all with closed == C) to the gradients dv [C] (HOST array of device pointers [T, d],
// a null entry is skipped) of the closed sources v [C]. R <= kAttnResMaxFlushReads.
constexpr int64_t kAttnResMaxFlushReads = 64;
void attnres_flush(const float* const* v, int64_t C, int64_t T, int64_t d, const AttnResDeferred* reads, int64_t R,
                   float* const* dv, void* stream = nullptr);

}  // namespace lm::ops::cuda

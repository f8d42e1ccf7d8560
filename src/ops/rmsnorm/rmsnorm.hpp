#pragma once
// RMSNorm (SPEC notation): y = x * rsqrt(mean(x^2) + eps) * w over the last dim D, rows independent.
//
// Legend: rows = independent vectors (T tokens, or T*H heads for the per-head form), D normalised
//         width (d hidden, V head dim, or a LoRA rank), ld* row strides in elements (>= D).
// Layouts (row-major): x, y, dx, dy [rows, ld]; w, dw [D]; rstd [rows]; gate, dgate, out, dout [rows, D].
//
// Uses:
//   input/post-attention/final norms, MoE latent norm, AttnRes is NOT this (see ops/attnres)
//   MLA q_a / kv_a norms (eps 1e-6): kv_a's row is [c ; k_r] with only c normed, hence the strides
//   KDA o_norm: per head over V with one shared w [V] -> rows = T*H, D = V (memory of [T, H*V])
//   KDA output: out = RMSNorm_head(o) * sigmoid(gate)  (rmsnorm_gated_*)
// The reference (KimiRMSNorm) computes in fp32 and returns `w * x_normed.to(input_dtype)`: the cast
// to the input dtype happens before the weight multiply. Here the input dtype is F itself (float or
// double), so the cast is the identity; a bf16 caller must round x_normed to bf16 before the w multiply
// to match the reference bit for bit. We keep the same operation order: (x * rstd) then * w.
//
// Gradients: with n = x * rstd, g = w * dy,
//   dx = rstd * (g - n * mean(g * n)),   dw += sum_rows dy * n.
// dw is reduced over fixed row blocks (independent of the thread count) in double, then added to dw:
// results are deterministic and do not depend on OMP_NUM_THREADS.
#include <cstdint>

namespace lm::ops {

// y may alias x (in place) when ldy == ldx. rstd [rows] is written when non-null (keep it for backward).
// ldx/ldy = 0 means D.
template <class F>
void rmsnorm_forward(const F* x, const F* w, F* y, F* rstd, int64_t rows, int64_t D, F eps, int64_t ldx = 0,
                     int64_t ldy = 0);

// dx [rows, ldx] written (may alias dy when ldx == ldy); dw [D] accumulated (nullable: skipped).
// rstd from the forward, or null to recompute it from x. x-shaped buffers (x, dx) use ldx, y-shaped ones
// (dy) use ldy.
template <class F>
void rmsnorm_backward(const F* x, const F* w, const F* rstd, const F* dy, F* dx, F* dw, int64_t rows, int64_t D, F eps,
                      int64_t ldx = 0, int64_t ldy = 0);

// Gated per-head form of the KDA output (SPEC §2): out = (w * x * rstd) * sigmoid(gate).
// float evaluates the sigmoid with lm::exp_approx (core/simd_math.hpp, ~2 ulp) so the loop vectorises.
// x (the core output o), gate, out [rows, D] contiguous with rows = T*H, D = V.
template <class F>
void rmsnorm_gated_forward(const F* x, const F* gate, const F* w, F* out, F* rstd, int64_t rows, int64_t D, F eps);

// dx, dgate [rows, D] written; dw [D] accumulated (nullable). rstd nullable (recomputed).
template <class F>
void rmsnorm_gated_backward(const F* x, const F* gate, const F* w, const F* rstd, const F* dout, F* dx, F* dgate, F* dw,
                            int64_t rows, int64_t D, F eps);

}  // namespace lm::ops

#pragma once
// Fused LM head + cross-entropy, computed in tiles of (token block) x (vocabulary chunk) so the
// [T, vocab] logits are never materialised (SPEC §1: logits = lm_head(h), untied W [vocab, d]).
//
// Legend: T tokens, d hidden, V vocabulary, Vc vocabulary chunk (rows of W per tile), Bt token block.
// Layouts (row-major): h, dh [T, d]; W, dW [V, d]; targets [T] int32 (< 0, e.g. -100: ignored);
//                      lse, token_loss [T]; logits tile [Bt, Vc] (internal scratch only).
//
//   logits_t = W h_t,  lse_t = log sum_v exp(logits_tv),  loss_t = lse_t - logits_t[target_t]
// Forward: an online log-sum-exp over the vocabulary chunks (running max m, running sum s rescaled
// by exp(m_old - m_new)); only lse [T] is kept for the backward.
// Backward: the tile logits are recomputed, G = scale * (softmax - onehot(target)) in place, then
//   dh_tb = sum_c G W_c  and  dW_c += G^T h_tb.
// FLOPs: forward 2 T V d; backward 6 T V d (recompute + 2 GEMMs), or 8 T V d in TokenBlocks mode
// (one more recompute); cross_entropy_forward_backward 8 T V d in both modes.
// Softmax exps in float use lm::exp_approx (core/simd_math.hpp, ~2 ulp, vectorised); double uses std::exp.
//
// Parallel modes:
//   Blas        tiles in sequence, each GEMM threaded by OpenBLAS; softmax rows by parallel_for.
//   TokenBlocks token blocks in parallel (single-threaded GEMMs inside); dW then needs a second sweep
//               parallel over vocabulary chunks (recomputing the logits) to stay race-free.
//   Auto        (default) TokenBlocks for the forward and for cross_entropy_forward_backward (fused
//               forward + dh sweep, then the dW sweep: 4 GEMMs), Blas for the standalone backward
//               (3 GEMMs there against 4 for TokenBlocks).
// Measured on the 2-core dev box (T=4096, d=256, V=8192, fp32; CrossEntropy.DISABLED_Timing, CPU time of
// all threads with OMP_WAIT_POLICY=passive, since the box was shared): one logits GEMM ~0.2 s; forward
// ~1.1 GEMMs in both modes; forward_backward ~4.1 GEMMs in both (TokenBlocks 0-8% less); the standalone
// backward ~3.1 GEMMs (Blas) against ~4.0 (TokenBlocks). Wall times tracked the neighbours' load.
// Results are deterministic for fixed options and thread count; dW accumulates over token blocks in order.
#include <cstdint>

namespace lm::ops {

enum class CeParallel { Auto, Blas, TokenBlocks };

struct CeOptions {
  int64_t vocab_chunk = 4096;  // Vc: rows of W per tile (need not divide V)
  int64_t token_block = 0;     // Bt: 0 = the mode's default (Blas 1024, TokenBlocks 128)
  CeParallel parallel = CeParallel::Auto;
};

struct CeStats {
  double loss_sum = 0;  // sum of loss_t over non-ignored tokens (accumulated in double, in token order)
  int64_t n_valid = 0;  // number of non-ignored tokens
  double mean() const { return n_valid > 0 ? loss_sum / static_cast<double>(n_valid) : 0.0; }
};

// Throws lm::Error for a target >= V. lse [T] (needed by the backward) and token_loss [T] (loss_t, 0 for
// ignored tokens; e.g. per-token log-probabilities for eval/RL) are written when non-null.
template <class F>
CeStats cross_entropy_forward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d, int64_t V, F* lse,
                              F* token_loss = nullptr, const CeOptions& opt = {});

// Gradients of L = grad_scale * sum_t row_scale_t * loss_t (the mean loss: grad_scale = 1 / n_valid, no row_scale).
// dh [T, d] written (0 rows for ignored tokens); dW [V, d] accumulated (+=; nullable: skipped).
// lse from the forward with the same h, W. row_scale [T] (nullable: all 1) weighs each token, of either sign: the
// policy gradient of RL (rl/grpo.hpp) is a weighted sum of the targets' log-probabilities, loss_t = -logp_t.
template <class F>
void cross_entropy_backward(const F* h, const F* W, const int32_t* targets, const F* lse, int64_t T, int64_t d,
                            int64_t V, F grad_scale, F* dh, F* dW, const CeOptions& opt = {},
                            const F* row_scale = nullptr);

// Training: loss and gradients in one call (lse, token_loss nullable outputs as in the forward).
// Blas mode runs the forward sweep then the backward sweep. TokenBlocks mode fuses the forward into the
// dh sweep: dh accumulates exp(L - m_running) W_c, rescaled by exp(m_old - m_new) when the running max
// grows, and is normalised at the end; then the dW sweep. Either way 4 T V d multiply-adds.
template <class F>
CeStats cross_entropy_forward_backward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                                       F grad_scale, F* dh, F* dW, F* lse = nullptr, F* token_loss = nullptr,
                                       const CeOptions& opt = {});

// The mean loss over this call's non-ignored tokens (grad_scale = 1 / n_valid). For a data-parallel mean
// over all ranks, all-reduce cross_entropy_count_valid instead and call cross_entropy_forward_backward.
template <class F>
CeStats cross_entropy_mean_forward_backward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d,
                                            int64_t V, F* dh, F* dW, const CeOptions& opt = {});

// Number of targets >= 0; throws lm::Error for a target >= V (naming its position).
int64_t cross_entropy_count_valid(const int32_t* targets, int64_t T, int64_t V);

// Inference: logits [rows, V] = h [rows, d] W^T (a few rows: the last position of each sequence).
template <class F>
void lm_head_logits(const F* h, const F* W, int64_t rows, int64_t d, int64_t V, F* logits);

}  // namespace lm::ops

#pragma once
// Sigmoid MoE router (SPEC §5) on the CPU: scores, biased top-k selection, renormalised weights,
// and the backward to the router logits.
//
// Legend: m tokens, n experts, k experts per token.
// Layouts (row-major): logits, scores, d_logits [m, n]; bias [n]; topk_idx, topk_w, d_topk_w [m, k];
//                      margin, alpha [m].
//
//   s     = sigmoid(logits)                         (in F: float = the reference's fp32 router)
//   sel_i = top-k over v_i = s_i + b                 (b = e_score_correction_bias; selection only)
//   p_ij  = s_ij / (Σ_{l∈sel_i} s_il + 1e-20) · routed_scaling_factor      (renormalize)
//   p_ij  = s_ij · routed_scaling_factor                                  (!renormalize)
//
// Ranking and ties: v is ranked by value, larger first; equal values rank by the lower expert index
// first (so of two tied experts the lower index is selected). Deterministic, thread-count
// independent, and the same order QB's α_i uses.
// Output order: each row of topk_idx is sorted by ascending expert index (as the golden files
// store it), topk_w aligned with it. This makes the row a set, independent of score order.
// Extras: margin_i = v_(k) − v_(k+1) (≥ 0; 0 on a tie; +inf when k == n), the distance to the
// nearest routing flip; alpha_i = v_(k+1), the (k+1)-th largest biased score (QB's admission
// cutoff; −inf when k == n).
#include <cstdint>

namespace lm::ops {

struct RouterConfig {
  int64_t k = 1;                        // experts per token, 1 <= k <= n
  bool renormalize = true;              // moe_renormalize
  double routed_scaling_factor = 1.0;
};

template <class F>
struct RouterOutputs {
  int32_t* topk_idx = nullptr;  // [m, k] required
  F* topk_w = nullptr;          // [m, k] required
  F* scores = nullptr;          // [m, n] optional: s (QB and the aux loss read it)
  F* margin = nullptr;          // [m] optional
  F* alpha = nullptr;           // [m] optional
};

// bias may be null (zero). Throws lm::Error on bad sizes or a NaN logit/bias.
template <class F>
void router_forward(const F* logits, const F* bias, int64_t m, int64_t n, const RouterConfig& cfg,
                    const RouterOutputs<F>& out);

// d_logits [m, n] from d_topk_w [m, k] with the selection topk_idx held fixed. Only the unbiased
// scores of the selected experts carry gradient (the bias and the top-k choice have none):
//   renormalize: ds_l = c/(S + 1e-20) · (dp_l − Σ_j dp_j s_j/(S + 1e-20)),  S = Σ_sel s, c = factor
//   otherwise:   ds_l = c · dp_l
//   d_logit_l = ds_l · s_l (1 − s_l);  non-selected entries get 0.
// accumulate: add into d_logits instead of overwriting it.
template <class F>
void router_backward(const F* logits, const int32_t* topk_idx, const F* d_topk_w, F* d_logits, int64_t m,
                     int64_t n, const RouterConfig& cfg, bool accumulate = false);

}  // namespace lm::ops

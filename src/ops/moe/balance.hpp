#pragma once
// Expert load balancing (SPEC §5): Quantile Balancing (QB), its baselines (DeepSeek's sign update
// and a Switch-style auxiliary loss) and the balance metric.
//
// Legend: m tokens, n experts, k experts per token, q = m·k/n the target load per expert.
// Layouts (row-major): s [m, n] the unbiased sigmoid scores; b, b_new, beta [n] the bias
//                      (e_score_correction_bias); alpha [m]; topk_idx [m, k]; loads [n];
//                      histogram counts [n, slots] (slots from qb_hist_slots).
//
// ---- Quantile Balancing --------------------------------------------------------------------
//   α_i  = (k+1)-th largest of s_i + b  (the same ranking as the router; router_forward's alpha)
//   r_ij = s_ij − α_i                   (how far token i is from admitting expert j at zero bias)
//   β_j  = the (q+1)-th largest of r_·j over the tokens, i.e. the (1 − k/n) quantile
//   b_new = −β + mean(β)                (mean zero; installed for the next step)
// Why: with bias −β_j, token i admits j roughly iff r_ij > β_j, which is true for q tokens.
//
// Quantile definition (exact estimator). Sort r_·j descending, r_(1) >= ... >= r_(m), and write
// q = Q + f with Q = floor(q), 0 <= f < 1. Then
//   β_j = (1 − f)·r_(Q+1) + f·r_(Q+2)          (r_(m+1) := r_(m))
// which is the SPEC's (q+1)-th largest when q is an integer and moves linearly between
// neighbouring order statistics otherwise (continuous in q). Equivalently, reading sample r_(t)
// as sitting at "mass above" t − 1/2, β_j is the point with q + 1/2 samples above it; the
// histogram estimator uses that same target, so both agree as bins shrink.
// Properties: adding a constant to all scores, or to all of b, leaves b_new unchanged (up to
// rounding).
//
// Histogram estimator (for distributed runs). Per expert, counts of the biased margin
// x_ij = s_ij + b_j − α_i = r_ij + b_j, i.e. of r_ij with expert j's bin edges shifted by −b_j:
// x is > 0 for the experts the token selected (barring ties at the cutoff), exactly 0 for the
// expert that set α_i (the (k+1)-th: an atom of about m/n tokens per expert), and its (q+1)-th
// largest is near 0 when loads are near balance, so one bin layout centred on 0 serves every
// expert. Counts are int64 and add across micro-batches and processes (sum them with one
// all-reduce; the layout must be the same everywhere).
// β_j = (the point with q + 1/2 counts above it) − b_j, q = M·k/n with M the expert's total count
// (the global token count); within a bin the counts are taken as spread evenly, and x == 0 has a
// zero-width slot of its own, so the atom is resolved exactly (near balance the exact β_j often
// lies in it, leaving b_j unchanged).
// Slots, in increasing x: the negative bins, the x == 0 slot, the positive bins, mirror images;
// `bins` (even) counts the regular bins of both sides together.
//   Uniform:  bins of width 2·range/bins on [−range, range], plus an underflow and an overflow
//             slot (slots = bins + 3); a quantile in an outer slot is clamped to ∓range.
//             qb_hist_cover gives the range that holds every possible x: 1 + max b − min b.
//   Rational: bins equal in φ = x / (|x| + scale) ∈ (−1, 1) (slots = bins + 1): covers all of ℝ,
//             bins ≈ 2·scale/bins wide near 0 and widening as (|x| + scale)²/scale away from it:
//             fine where the quantile lives near balance, coarse only far from it. The two outer
//             bins are unbounded; a quantile there is clamped to their finite edge.
#include <cstdint>

namespace lm::ops {

// α_i for every token (the router gives it too, as RouterOutputs::alpha). Requires k < n.
template <class F>
void qb_admission_cutoff(const F* s, const F* b, F* alpha, int64_t m, int64_t n, int64_t k);

// Exact β (one process): per expert, the order statistics by a bucket pass that locates them and
// nth_element over the few values of their bucket; two streaming passes over s, no m·n buffer.
// alpha may be null (computed from s, b, k).
template <class F>
void qb_beta_exact(const F* s, const F* b, const F* alpha, F* beta, int64_t m, int64_t n, int64_t k);

// b_new = −β + mean(β); b_new may alias beta.
template <class F>
void qb_bias_from_beta(const F* beta, F* b_new, int64_t n);

// The whole exact update: b_new from the step's scores s and the bias b it was routed with.
// alpha may be null; b_new may alias b.
template <class F>
void qb_update_exact(const F* s, const F* b, const F* alpha, F* b_new, int64_t m, int64_t n, int64_t k);

enum class QbHistLayout { Uniform, Rational };

// Default: 256 rational bins (n·257 int64 counts, 1.8 MB at n = 896). In simulated training
// (skewed random routers; m = 65536, n = 64, k = 8 and m = 16384, n = 896, k = 16) 64..1024 bins
// balanced about as well as the exact estimator: the bins mainly need to resolve the quantile
// near 0, where it sits once balanced.
struct QbHistogram {
  QbHistLayout layout = QbHistLayout::Rational;
  int64_t bins = 256;   // regular bins, both sides together (even)
  double range = 1.5;   // Uniform only: bins cover [−range, range]
  double scale = 0.02;  // Rational only: |x| at which bins are 4x as wide as at 0
};
int64_t qb_hist_slots(const QbHistogram& h);  // counts per expert
void qb_hist_check(const QbHistogram& h);     // throws lm::Error on a bad layout
// A Uniform layout whose range holds every possible biased margin given the bias b (s ∈ [0, 1]).
template <class F>
QbHistogram qb_hist_cover(const F* b, int64_t n, int64_t bins);

// counts [n, slots] += the histogram of this batch's biased margins (does not zero counts first,
// so micro-batches accumulate). alpha may be null. Deterministic (integer counts).
template <class F>
void qb_hist_accumulate(const F* s, const F* b, const F* alpha, int64_t m, int64_t n, int64_t k,
                        const QbHistogram& h, int64_t* counts);

// β [n] from (summed) counts; b is the bias the counted batches were routed with.
template <class F>
void qb_beta_from_hist(const int64_t* counts, const F* b, F* beta, int64_t n, int64_t k, const QbHistogram& h);

// Single-process convenience: accumulate, β, b_new. b_new may alias b.
template <class F>
void qb_update_hist(const F* s, const F* b, const F* alpha, F* b_new, int64_t m, int64_t n, int64_t k,
                    const QbHistogram& h);

// ---- baselines and metrics ------------------------------------------------------------------
// loads[j] = number of (token, slot) entries of topk_idx equal to j (written, not accumulated).
void expert_loads(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int64_t* loads);

// MaxVio = max_j load_j / mean load − 1 (0 when every load is 0).
double max_violation(const int64_t* loads, int64_t n);

// DeepSeek's auxiliary-loss-free update: b_j += γ · sign(mean load − load_j), sign(0) = 0.
template <class F>
void bias_sign_update(const int64_t* loads, F* b, int64_t n, F gamma = F(1e-3));

// Switch-style auxiliary balance loss for a sigmoid router (over this batch):
//   L = coef · n · Σ_j f_j · P_j
//   f_j = load_j / (m·k)             fraction of the batch's assignments going to j (no gradient)
//   P_j = (1/m) Σ_i s_ij / Σ_l s_il  mean router probability; for a sigmoid router the scores of a
//                                    token are normalised to sum to 1 to play softmax's part
// L = coef when both f and P are uniform (the Switch / DeepSeek normalisation, for any k).
template <class F>
double aux_loss_forward(const F* logits, const int32_t* topk_idx, int64_t m, int64_t n, int64_t k, double coef);
// d_logits = dL/dlogits (f held fixed): with ŝ = s/S, g_j = coef·n·f_j/m,
//   dL/ds_il = (g_l − Σ_j g_j ŝ_ij) / S_i,   dL/dlogit = dL/ds · s(1 − s).
// accumulate: add into d_logits (e.g. on top of router_backward).
template <class F>
void aux_loss_backward(const F* logits, const int32_t* topk_idx, F* d_logits, int64_t m, int64_t n, int64_t k,
                       double coef, bool accumulate = false);

}  // namespace lm::ops

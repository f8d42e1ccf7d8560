#pragma once
// Block Attention Residuals read (SPEC §6): a softmax over depth sources per token.
//
// Legend: N sources (embedding, closed block sums, partial block sum), T tokens, d hidden,
//         Q reads sharing the same closed sources (decode phase 1), M sources merged in phase 2.
// Layouts (row-major): each source v[j] [T, d] (an array of N pointers, so sources can live in separate
//         buffers); w (pseudo-query), gamma (norm gain) [d]; h [T, d]; probs [T, N].
//
//   r_j   = sqrt(mean_d(v_j^2) + eps)           q = gamma * w
//   z_j   = q . v_j / r_j                        (no 1/sqrt(d))
//   a     = softmax_j(z)                          (in F: fp32 for float)
//   h     = sum_j a_j v_j                         (raw, un-normalised sources)
// Backward with upstream delta = dh, k_j = v_j / r_j:
//   dz_j  = a_j (delta . v_j - delta . h)
//   dq    = sum_{t,j} dz_j k_j  ->  dw += dq * gamma,  dgamma += dq * w
//   dv_j += a_j delta + dz_j (q - z_j k_j / d) / r_j
// gamma enters only the score (the reference's RMSNorm weight), never h.
#include <cstdint>

namespace lm::ops {

// One-shot read. probs [T, N] written when non-null.
template <class F>
void attnres_forward(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, F eps, F* h,
                     F* probs = nullptr);

// dv[j] [T, d] accumulated (+=; a null entry skips that source); dw, dgamma [d] accumulated (nullable).
// Recomputes the forward from v (cheap: O(N d) per token). dw/dgamma are reduced over fixed token blocks,
// so results do not depend on the thread count.
template <class F>
void attnres_backward(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, F eps,
                      const F* dh, F* const* dv, F* dw, F* dgamma);

// ---- two-phase form for decode (SPEC §6) --------------------------------------------------------
// Phase 1: Q reads (pseudo-queries w[i], gains gamma[i], i < Q; both [Q, d]) over the N closed sources,
// which stay fixed for every read of the current block. Writes the online-softmax state per read and token:
//   m [Q, T]       max score,   l [Q, T] sum_j exp(z_j - m),   acc [Q, T, d] sum_j exp(z_j - m) v_j.
// N == 0 gives the empty state (m = -inf, l = 0, acc = 0).
template <class F>
void attnres_phase1(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, int64_t Q, F eps,
                    F* m, F* l, F* acc);

// Phase 2 for one read: merges M more sources (usually the partial block sum) into that read's state
// (m, l [T], acc [T, d]: one slice of phase 1's output) and writes h [T, d]. The state is not modified.
// Equals attnres_forward over the closed sources followed by the M new ones.
template <class F>
void attnres_phase2(const F* m, const F* l, const F* acc, const F* const* v, int64_t M, int64_t T, int64_t d,
                    const F* w, const F* gamma, F eps, F* h);

}  // namespace lm::ops

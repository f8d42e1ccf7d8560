#pragma once
// Context parallelism for the KDA core (SPEC §2): a sequence split into contiguous segments, one per rank of a
// communicator (rank r holds tokens [r·T, (r+1)·T) of every sequence of the batch, T = d.T tokens each), computed
// exactly by a scan over segment states. The recurrence S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ
// is affine in the state, so a segment maps its start state S to M S + B, where M [K, K] = Π_t (I − β k kᵀ) Diag(exp g)
// (the core run from the identity with v = 0 over K value channels) and B [K, V] is its zero-start final state.
// (Summing the segments' zero-start states, as LASP does for plain linear attention, drops M and is wrong for the
// delta rule.)
//   forward:  M_r and B_r; one all-gather of both; S_r = fold_{j<r}(S ← M_j S + B_j) from h0; the segment from S_r.
//   backward: the segment's backward with no final-state gradient gives g_r, the part of ∂L/∂S_r its own outputs
//             make; one all-gather of g; G_j = g_j + M_jᵀ G_{j+1} from the end (G_R = dht); the segment's backward
//             again with dht = G_{r+1} gives its input gradients, and G_0 is dh0.
// Cost per rank: three forward runs of its segment (one of them K values wide) and two backward runs; traffic:
// (K·K + K·V) + K·V values per head and sequence, whatever the segment length.
//
// Legend: as ops/kda/kda.hpp (B sequences, T tokens per rank, H heads, K, V); no varlen. h0, dht (nullable) and the
// results ht, dh0 are the whole sequence's, the same on every rank.
#include <vector>

#include "dist/comm.hpp"
#include "ops/kda/kda.hpp"

namespace lm::dist {

// What the backward needs from the forward: this segment's start state and every segment's transition.
template <class F>
struct KdaCpSaved {
  std::vector<F> S0;  // [B, H, K, V]
  std::vector<F> M;   // [R, B, H, K, K]
};

template <class F>
void kda_cp_forward(Comm& comm, const kda::CoreInputs<F>& in, const kda::Dims& d, F* o, F* ht, kda::DiagPath path,
                    kda::GateParams gate, KdaCpSaved<F>& saved);
template <class F>
void kda_cp_backward(Comm& comm, const kda::CoreInputs<F>& in, const kda::Dims& d, const F* do_, const F* dht,
                     const kda::CoreGrads<F>& gr, kda::DiagPath path, kda::GateParams gate, const KdaCpSaved<F>& saved);

}  // namespace lm::dist

#pragma once
// Context parallelism for gated MLA's attention (SPEC §3): a sequence split into contiguous segments, one per rank
// (as dist/kda_cp.hpp). The keys and values come from the 576-wide latent rows [RMSNorm(c) | k_r], which are small,
// so one all-gather gives every rank every earlier latent; each rank decompresses the latents up to its segment's
// end (k_nope, v = cn W_kvbᵀ split per head; k_r shared by the heads) and attends its own queries to them causally.
// The backward turns the keys' and values' gradients back into latent gradients (and W_kvb's) where they were used,
// and one all-reduce over the whole sequence's latent rows hands every rank the gradient of its own rows.
//
// This first form attends with the square causal kernel (ops::attention_forward) over positions [0, end) with the
// queries before this segment set to zero and their rows dropped: exact, but rank r computes end_r rows of
// attention, not its own T; a kernel with a query offset removes that.
//
// Legend: B = 1 sequence, T rows on this rank (R ranks, end = (rank + 1)·T), H heads, Dn, Dr, Dv head dims, Dq = Dn +
// Dr, Dkv = Dn + Dv, Rl kv_lora_rank, RD = Rl + Dr. latent [T, RD] (cn | k_r), q [T, H, Dq], o [T, H, Dv], W_kvb [H·Dkv,
// Rl] (per head its k_nope rows then its v rows).
#include <vector>

#include "dist/comm.hpp"

namespace lm::dist {

struct MlaCpDims {
  int64_t T = 0, H = 1, Dn = 0, Dr = 0, Dv = 0, Rl = 0;
};

template <class F>
struct MlaCpSaved {
  std::vector<F> lat;             // [end, RD] the gathered latents this rank used
  std::vector<F> q, k, v, o, lse;  // the padded attention's operands and results over [0, end)
};

// o [T, H, Dv] of this rank's queries; scale as the attention's (Dq^-1/2 by convention).
template <class F>
void mla_cp_forward(Comm& comm, const F* latent, const F* q, const F* W_kvb, F* o, const MlaCpDims& d, F scale,
                    MlaCpSaved<F>& saved);
// From do [T, H, Dv]: dq [T, H, Dq] and dlatent [T, RD] written; dW_kvb accumulated (this rank's share).
template <class F>
void mla_cp_backward(Comm& comm, const F* W_kvb, const F* do_, F* dq, F* dlatent, F* dW_kvb, const MlaCpDims& d,
                     F scale, const MlaCpSaved<F>& saved);

}  // namespace lm::dist

#pragma once
// Context parallelism for the KDA mixer's short causal convolution (SPEC §2): a sequence split into contiguous
// segments, one per rank (as dist/kda_cp.hpp), needs the W−1 inputs before its segment: the halo, the previous
// rank's last W−1 rows. One all-gather of every rank's last rows gives it; the backward sends the halo's gradient
// back the same way (the previous rank adds it to its last rows' input gradients).
//
// Legend: ops/kda/kda.hpp's ConvDims (B sequences of T rows on this rank, C channels, W taps; no varlen), x, y, dx
// [B·T, C], w, dw [C, W]; the halo and a sequence's initial cache [B, C, W−1] (oldest first). Needs T >= W − 1.
#include <vector>

#include "dist/comm.hpp"
#include "ops/kda/kda.hpp"

namespace lm::dist {

// y = silu?(conv(x)) over this rank's segment; `cache` (nullable: zeros) precedes the whole sequence (rank 0's
// halo). halo_out keeps the halo this rank used, for the backward.
template <class F>
void conv_cp_forward(Comm& comm, const F* x, const F* w, const F* cache, F* y, const kda::ConvDims& d, bool silu,
                     std::vector<F>& halo_out);
// dx written (the next rank's halo gradient included); dw accumulated (this rank's share: sum it over the ranks
// with the other gradients); dcache [B, C, W−1] (nullable) the gradient of the initial cache.
template <class F>
void conv_cp_backward(Comm& comm, const F* x, const F* w, const std::vector<F>& halo, const F* dy, F* dx, F* dw,
                      F* dcache, const kda::ConvDims& d, bool silu);

}  // namespace lm::dist

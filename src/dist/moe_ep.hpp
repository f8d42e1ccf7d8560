#pragma once
// Expert parallelism for the routed experts (SPEC §5) over fixed-capacity buffers (static shapes: the idea of
// Moonshot's MoonEP). The E experts split contiguously over the R ranks of a communicator, rank r holding experts
// [r·El, (r+1)·El), El = E / R; every rank keeps its own tokens and their routing, only the expert computation moves.
// Per layer and direction each rank sends every rank one message of a fixed size: a header of El row counts, then El
// blocks of C rows (C, the capacity, in rows per expert per source rank). The sizes never depend on the routing, so
// no exchange of counts (on a GPU, a host synchronisation) precedes the rows. A rank's assignments sorted by expert
// (ops::moe_permutation, token order within an expert) fill the blocks in order: an expert's first C rows travel,
// the rest are dropped (expert output 0, no gradient), deterministically, and counted.
//   dispatch: this rank's rows -> their experts' owners (the forward's latent rows; the backward's output gradients),
//             regrouped there by local expert, within an expert by source rank, then token order;
//   combine:  the reverse (the expert outputs; the input gradients), dropped rows 0.
// Per row the results are those of one process (a row's product does not depend on its neighbours); an expert's
// weight gradient sums the same rows in another order.
//
// Legend: R ranks, E experts, El = E / R local experts, C capacity, A = m·k this rank's assignments (rows in its
//         expert order), G the rows its local experts receive, w the row width (the latent width l, or d).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dist/comm.hpp"

namespace lm::dist {

struct ExpertDispatch {
  int R = 1, rank = 0;
  int64_t E = 0, El = 0, C = 0;
  std::vector<int64_t> offsets;        // [E + 1] this rank's rows of expert e: [offsets[e], offsets[e] + sent(e))
  int64_t dropped = 0;                 // this rank's assignments beyond the capacity
  std::vector<int64_t> recv;           // [R·El] rows from rank s for local expert e (the last dispatch's headers)
  std::vector<int64_t> local_offsets;  // [El + 1] grouped rows of local expert e
  std::vector<char> send_buf, recv_buf;  // the messages (kept: their sizes are fixed)
  int64_t sent(int64_t e) const { return std::min(offsets[size_t(e) + 1] - offsets[size_t(e)], C); }
  int64_t first_expert() const { return int64_t(rank) * El; }
  int64_t rows() const { return local_offsets.back(); }  // G
};

// Rows per (source rank, expert) for m tokens with k experts each: ceil(factor · m·k / E), at most m (a token picks
// an expert once) and at least 1; factor 0: m, so that nothing is ever dropped.
int64_t expert_capacity(int64_t m, int64_t k, int64_t E, double factor);

// The plan of one layer from this rank's expert offsets [E + 1] (ops::moe_permutation's); no communication. Every
// rank of `comm` must use the same capacity. lm::Error when R does not divide E.
void plan_dispatch(const Comm& comm, const int64_t* offsets, int64_t E, int64_t capacity, ExpertDispatch& x);

// rows [A, w] in this rank's expert order -> grouped [G, w] for the local experts (sets x.recv, x.local_offsets).
// Collective.
template <class F>
void dispatch(Comm& comm, ExpertDispatch& x, const F* rows, int64_t w, std::vector<F>& grouped);
// grouped [G, w] -> rows [A, w] in this rank's expert order (each row back where dispatch took it; dropped rows 0).
// Collective.
template <class F>
void combine(Comm& comm, ExpertDispatch& x, const F* grouped, int64_t w, F* rows);

}  // namespace lm::dist

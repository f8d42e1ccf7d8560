#pragma once
// Expert parallelism for the routed experts (SPEC §5): the E experts split contiguously over the R ranks of a
// communicator, rank r owning experts [r·El, (r+1)·El), El = E / R. Every rank keeps its own tokens and their routing;
// only the expert computation moves. A rank's assignments, sorted by expert (ops::moe_permutation), are already
// grouped by owner, so:
//   exchange:     one all-to-all of the per-expert row counts (El values to each rank) when the routing is known;
//   to_experts:   one all-to-all(v) sends each owner its rows (dispatch; in the backward, the output gradients),
//                 which arrive regrouped by local expert, and within an expert by source rank, then token order;
//   from_experts: the reverse (the expert outputs back for the combine; in the backward, the input gradients).
// The owner runs each local expert over its grouped rows, so an expert's rows from every rank meet in one GEMM. Per
// row the results are those of one process (a row's product does not depend on its neighbours); an expert's weight
// gradient sums the same rows in another order.
//
// Legend: R ranks, E experts, El = E / R local experts, A = m·k this rank's assignments (rows in its expert order),
//         G the rows its local experts receive, w the row width (the latent width l, or d).
#include <cstdint>
#include <vector>

#include "dist/comm.hpp"

namespace lm::dist {

struct ExpertExchange {
  int R = 1, rank = 0;
  int64_t E = 0, El = 0;
  std::vector<int64_t> send_rows;      // [R] of this rank's A rows, those for rank j (contiguous, in rank order)
  std::vector<int64_t> recv_rows;      // [R] rows arriving from rank s
  std::vector<int64_t> local_offsets;  // [El + 1] grouped rows of local expert e: [local_offsets[e], ...[e + 1])
  std::vector<int64_t> grouped;        // [G] arrival order -> grouped row
  int64_t first_expert() const { return int64_t(rank) * El; }
  int64_t rows() const { return local_offsets.back(); }  // G
};

// From this rank's expert offsets [E + 1] (ops::moe_permutation's); collective. lm::Error when R does not divide E.
ExpertExchange expert_exchange(Comm& comm, const int64_t* offsets, int64_t E);

// rows [A, w] in this rank's expert order -> grouped [G, w] for the local experts. Collective.
template <class F>
void to_experts(Comm& comm, const ExpertExchange& x, const F* rows, int64_t w, F* grouped);
// grouped [G, w] -> rows [A, w] in this rank's expert order (each row back where to_experts took it). Collective.
template <class F>
void from_experts(Comm& comm, const ExpertExchange& x, const F* grouped, int64_t w, F* rows);

}  // namespace lm::dist

#pragma once
// Token ↔ expert permutation for expert-by-expert GEMMs (SPEC §5: u = Σ_{j∈sel} p_j · E_j(z)).
//
// Legend: m tokens, n experts, k experts per token, d width of the permuted activation,
//         a = i·k + t the assignment of token i's slot t (t-th entry of its topk_idx row).
// Layouts (row-major): topk_idx, topk_w, d_topk_w [m, k]; offsets [n + 1]; rows, pos [m·k];
//                      x, dx, y, dy [m, d]; xs, dxs, eo (expert outputs), d_eo [m·k, d].
//
// Expert order: a stable counting sort of the assignments by expert, so expert j owns rows
// offsets[j] .. offsets[j+1]−1 of xs/eo, and within an expert the rows follow (token, slot) order.
// rows[r] = the assignment at row r; pos[a] = the row of assignment a (the inverse). The result is
// unique (a stable sort), so it is deterministic for any thread count.
// Every reduction (gather backward, combine) loops per token over its k slots in slot order:
// no atomics, no races, bit-identical results run to run.
#include <cstdint>
#include <vector>

namespace lm::ops {

void moe_build_permutation(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int64_t* offsets,
                           int64_t* rows, int64_t* pos);

// Owning convenience around moe_build_permutation.
struct MoePermutation {
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> offsets, rows, pos;
  int64_t expert_rows(int64_t j) const { return offsets[j + 1] - offsets[j]; }
};
MoePermutation moe_permutation(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n);

// xs[r] = x[rows[r] / k]: each token's row copied once per selected expert, in expert order.
template <class F>
void moe_gather(const F* x, const int64_t* rows, F* xs, int64_t m, int64_t k, int64_t d);
// dx[i] (+)= Σ_t dxs[pos[i·k + t]] (the scatter-add, done per token in slot order).
template <class F>
void moe_gather_backward(const F* dxs, const int64_t* pos, F* dx, int64_t m, int64_t k, int64_t d,
                         bool accumulate = false);

// y[i] (+)= Σ_t topk_w[i, t] · eo[pos[i·k + t]], accumulated in F (fp32 / f64) in slot order.
template <class F>
void moe_combine(const F* eo, const F* topk_w, const int64_t* pos, F* y, int64_t m, int64_t k, int64_t d,
                 bool accumulate = false);
// d_eo[pos[i·k + t]] = topk_w[i, t] · dy[i];  d_topk_w[i, t] = <eo[pos[i·k + t]], dy[i]>.
// Both are written (every row of d_eo belongs to exactly one assignment). d_topk_w may be null.
template <class F>
void moe_combine_backward(const F* eo, const F* topk_w, const int64_t* pos, const F* dy, F* d_eo, F* d_topk_w,
                          int64_t m, int64_t k, int64_t d);

}  // namespace lm::ops

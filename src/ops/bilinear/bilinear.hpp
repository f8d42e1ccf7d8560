#pragma once
// Bilinear resize of a channels-last grid, as PyTorch's F.interpolate(mode="bilinear", align_corners=False,
// antialias=False): the vision tower's position table resized to each image's patch grid (SPEC §9).
//
// Legend: Hi×Wi input grid, Ho×Wo output grid, C channels. Layouts: src, dsrc [Hi, Wi, C]; dst, ddst [Ho, Wo, C].
// Per axis (n_in -> n_out), output index o reads source coordinate
//   s = max((n_in / n_out)·(o + ½) − ½, 0),  i0 = ⌊s⌋ (≤ n_in − 1),  i1 = min(i0 + 1, n_in − 1),  λ = s − i0,
// with weights (1 − λ) on i0 and λ on i1; the 2-D weights are the products of the row and column weights.
// Equal sizes give the identity. The backward scatters ddst through the same weights (the transpose).
#include <cstdint>
#include <vector>

namespace lm::ops {

struct BilinearTaps {
  std::vector<int64_t> i0, i1;  // [n_out] source indices
  std::vector<double> l0, l1;   // [n_out] their weights (l0 + l1 = 1)
};
BilinearTaps bilinear_taps(int64_t n_in, int64_t n_out);

// dst [Ho, Wo, C] written.
template <class F>
void bilinear_resize_forward(const F* src, int64_t Hi, int64_t Wi, int64_t C, F* dst, int64_t Ho, int64_t Wo);

// dsrc [Hi, Wi, C] accumulated (+=) from ddst [Ho, Wo, C].
template <class F>
void bilinear_resize_backward(const F* ddst, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho, int64_t Wo, F* dsrc);

}  // namespace lm::ops

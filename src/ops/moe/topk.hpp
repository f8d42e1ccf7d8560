#pragma once
// Internal to src/ops/moe: the ranked selection shared by the router and Quantile Balancing.
//
// Legend: n experts, kk = how many of the best values are kept (k + 1 for the router: the k
// selected plus the first one left out, whose value is QB's admission cutoff α_i).
//
// Order ("rank"): larger value first; equal values rank by lower expert index first. So among
// tied experts the one with the lower index is selected, and every caller (router, α_i of QB, the
// tests' naive sort) sees the same ranking.
#include <cstdint>

namespace lm::ops::moe_detail {

// Keeps the kk best of v[j] = s[j] + b[j] (b nullable) in rank order in val/idx. One pass over n:
// a candidate enters only when it beats the current kk-th, which after the first few entries is
// rare, so the cost is ~n comparisons. Returns false if a value is NaN (the caller reports it).
template <class F>
inline bool top_ranked(const F* s, const F* b, int64_t n, int64_t kk, F* val, int32_t* idx) {
  int64_t cnt = 0;
  bool ok = true;
  for (int64_t j = 0; j < n; ++j) {
    const F v = b ? s[j] + b[j] : s[j];
    ok &= (v == v);
    if (cnt == kk && !(v > val[kk - 1])) continue;  // ties with the kk-th lose: it has a lower index
    int64_t p = cnt < kk ? cnt++ : kk - 1;
    while (p > 0 && val[p - 1] < v) {  // strict: an equal earlier entry stays ahead
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    val[p] = v;
    idx[p] = static_cast<int32_t>(j);
  }
  return ok;
}

}  // namespace lm::ops::moe_detail

// Sigmoid router: forward (scores, biased top-k, weights, margin, α) and backward.
// Legend: m tokens, n experts, k experts per token.
#include "ops/moe/router.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/moe/topk.hpp"

namespace lm::ops {
namespace {

// 1/(1+e^-x): for very negative x the exp overflows to inf and the result is an exact 0, no NaN.
template <class F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

constexpr int64_t kTokensPerTask = 64;  // amortises the per-task scratch allocation

void check_config(int64_t m, int64_t n, const RouterConfig& cfg) {
  LM_CHECK(m >= 0, "router: m = {} tokens must be >= 0", m);
  LM_CHECK(n >= 1 && n <= std::numeric_limits<int32_t>::max(), "router: n = {} experts out of range", n);
  LM_CHECK(cfg.k >= 1 && cfg.k <= n, "router: k = {} must be in [1, n = {}]", cfg.k, n);
  LM_CHECK(std::isfinite(cfg.routed_scaling_factor), "router: routed_scaling_factor is not finite");
}

}  // namespace

template <class F>
void router_forward(const F* logits, const F* bias, int64_t m, int64_t n, const RouterConfig& cfg,
                    const RouterOutputs<F>& out) {
  check_config(m, n, cfg);
  if (m == 0) return;
  LM_CHECK(logits && out.topk_idx && out.topk_w, "router_forward: logits, topk_idx and topk_w are required");
  if (bias)
    for (int64_t j = 0; j < n; ++j) LM_CHECK(!std::isnan(bias[j]), "router_forward: bias[{}] is NaN", j);
  const int64_t k = cfg.k;
  const int64_t kk = std::min(k + 1, n);  // the k selected and, when it exists, the first left out
  const F factor = static_cast<F>(cfg.routed_scaling_factor);
  const int64_t tasks = (m + kTokensPerTask - 1) / kTokensPerTask;
  parallel_for(tasks, [&](int64_t task) {
    std::vector<F> s_scratch(out.scores ? 0 : static_cast<size_t>(n));
    std::vector<F> val(static_cast<size_t>(kk));
    std::vector<int32_t> idx(static_cast<size_t>(kk));
    const int64_t i_end = std::min(m, (task + 1) * kTokensPerTask);
    for (int64_t i = task * kTokensPerTask; i < i_end; ++i) {
      const F* x = logits + i * n;
      F* s = out.scores ? out.scores + i * n : s_scratch.data();
      for (int64_t j = 0; j < n; ++j) s[j] = sigmoid(x[j]);
      LM_CHECK(moe_detail::top_ranked(s, bias, n, kk, val.data(), idx.data()),
               "router_forward: NaN router logit in token {}", i);
      if (out.margin)
        out.margin[i] = kk > k ? val[k - 1] - val[k] : std::numeric_limits<F>::infinity();
      if (out.alpha) out.alpha[i] = kk > k ? val[k] : -std::numeric_limits<F>::infinity();
      // Row as a set: ascending expert index.
      int32_t* ti = out.topk_idx + i * k;
      std::copy(idx.begin(), idx.begin() + k, ti);
      std::sort(ti, ti + k);
      F* tw = out.topk_w + i * k;
      if (cfg.renormalize) {
        F sum = 0;
        for (int64_t t = 0; t < k; ++t) sum += s[ti[t]];
        const F inv = factor / (sum + F(1e-20));
        for (int64_t t = 0; t < k; ++t) tw[t] = s[ti[t]] * inv;
      } else {
        for (int64_t t = 0; t < k; ++t) tw[t] = s[ti[t]] * factor;
      }
    }
  });
}

template <class F>
void router_backward(const F* logits, const int32_t* topk_idx, const F* d_topk_w, F* d_logits, int64_t m,
                     int64_t n, const RouterConfig& cfg, bool accumulate) {
  check_config(m, n, cfg);
  if (m == 0) return;
  LM_CHECK(logits && topk_idx && d_topk_w && d_logits, "router_backward: null argument");
  const int64_t k = cfg.k;
  const F factor = static_cast<F>(cfg.routed_scaling_factor);
  parallel_for(
      m,
      [&](int64_t i) {
        const int32_t* ti = topk_idx + i * k;
        const F* dp = d_topk_w + i * k;
        F* dl = d_logits + i * n;
        if (!accumulate) std::fill(dl, dl + n, F(0));
        for (int64_t t = 0; t < k; ++t)
          LM_CHECK(ti[t] >= 0 && ti[t] < n, "router_backward: topk_idx[{}, {}] = {} out of [0, {})", i, t, ti[t], n);
        // k is small; recomputing the k selected sigmoids is cheaper than keeping s [m, n].
        F s[64];
        std::vector<F> s_big(k > 64 ? static_cast<size_t>(k) : 0);
        F* sv = k > 64 ? s_big.data() : s;
        for (int64_t t = 0; t < k; ++t) sv[t] = sigmoid(logits[i * n + ti[t]]);
        if (cfg.renormalize) {
          F sum = 0;
          for (int64_t t = 0; t < k; ++t) sum += sv[t];
          const F denom = sum + F(1e-20);
          F g = 0;  // Σ_j dp_j s_j / denom: the part every selected score shares through the sum
          for (int64_t t = 0; t < k; ++t) g += dp[t] * sv[t];
          g /= denom;
          const F c = factor / denom;
          for (int64_t t = 0; t < k; ++t) dl[ti[t]] += c * (dp[t] - g) * sv[t] * (F(1) - sv[t]);
        } else {
          for (int64_t t = 0; t < k; ++t) dl[ti[t]] += factor * dp[t] * sv[t] * (F(1) - sv[t]);
        }
      },
      256);
}

template void router_forward<float>(const float*, const float*, int64_t, int64_t, const RouterConfig&,
                                    const RouterOutputs<float>&);
template void router_forward<double>(const double*, const double*, int64_t, int64_t, const RouterConfig&,
                                     const RouterOutputs<double>&);
template void router_backward<float>(const float*, const int32_t*, const float*, float*, int64_t, int64_t,
                                     const RouterConfig&, bool);
template void router_backward<double>(const double*, const int32_t*, const double*, double*, int64_t, int64_t,
                                      const RouterConfig&, bool);

}  // namespace lm::ops

// Token ↔ expert permutation: stable counting sort, gather/combine round trip, expert GEMMs on the
// permuted rows vs the per-token definition, adjoint / finite-difference checks of the backwards.
// Legend: m tokens, n experts, k experts per token, d width.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/moe/permute.hpp"
#include "ops/moe/router.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;

namespace {

std::vector<int32_t> random_routing(int64_t m, int64_t n, int64_t k, uint64_t seed, std::vector<double>* w = nullptr) {
  auto logits = lm::testing::randn<double>(m * n, seed);
  std::vector<int32_t> idx(m * k);
  std::vector<double> tw(m * k);
  router_forward<double>(logits.data(), nullptr, m, n, RouterConfig{k, true, 2.446}, {idx.data(), tw.data()});
  if (w) *w = tw;
  return idx;
}

}  // namespace

TEST(MoePermute, StableCountingSortAndInverse) {
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{5000, 37, 4}, {1, 8, 8}, {3, 64, 2}}) {
    const auto idx = random_routing(m, n, k, 200 + m);
    const auto p = moe_permutation(idx.data(), m, k, n);
    EXPECT_EQ(p.offsets[0], 0);
    EXPECT_EQ(p.offsets[n], m * k);
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(p.expert_rows(j), std::count(idx.begin(), idx.end(), static_cast<int32_t>(j)));
      for (int64_t r = p.offsets[j]; r < p.offsets[j + 1]; ++r) {
        EXPECT_EQ(idx[p.rows[r]], j);
        if (r > p.offsets[j]) {
          EXPECT_LT(p.rows[r - 1], p.rows[r]) << "stable: assignment order within an expert";
        }
      }
    }
    for (int64_t a = 0; a < m * k; ++a) EXPECT_EQ(p.rows[p.pos[a]], a);
  }
  // Empty batch.
  const auto e = moe_permutation(nullptr, 0, 2, 4);
  EXPECT_EQ(e.offsets, (std::vector<int64_t>{0, 0, 0, 0, 0}));
  const std::vector<int32_t> bad = {0, 9};
  EXPECT_THROW(moe_permutation(bad.data(), 1, 2, 4), Error);
}

TEST(MoePermute, RoundTripAndExpertGemmsMatchTheDefinition) {
  const int64_t m = 300, n = 12, k = 3, d = 10;
  std::vector<double> w;
  const auto idx = random_routing(m, n, k, 211, &w);
  const auto x = lm::testing::randn<double>(m * d, 212);
  const auto p = moe_permutation(idx.data(), m, k, n);
  std::vector<double> xs(m * k * d);
  moe_gather<double>(x.data(), p.rows.data(), xs.data(), m, k, d);
  // Round trip: gather then combine with unit weights gives k·x; with the router weights, (Σ p)·x.
  std::vector<double> ones(m * k, 1.0), y(m * d);
  moe_combine<double>(xs.data(), ones.data(), p.pos.data(), y.data(), m, k, d);
  for (int64_t t = 0; t < m * d; ++t) EXPECT_NEAR(y[t], k * x[t], 1e-12);
  // Expert j = a d×d linear map applied to its contiguous row block, then the weighted combine.
  const auto W = lm::testing::randn<double>(n * d * d, 213);
  std::vector<double> eo(m * k * d, 0.0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = p.offsets[j]; r < p.offsets[j + 1]; ++r)
      for (int64_t o = 0; o < d; ++o)
        for (int64_t c = 0; c < d; ++c) eo[r * d + o] += W[(j * d + o) * d + c] * xs[r * d + c];
  moe_combine<double>(eo.data(), w.data(), p.pos.data(), y.data(), m, k, d);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t o = 0; o < d; ++o) {
      double ref = 0;
      for (int64_t t = 0; t < k; ++t) {
        const int64_t j = idx[i * k + t];
        for (int64_t c = 0; c < d; ++c) ref += w[i * k + t] * W[(j * d + o) * d + c] * x[i * d + c];
      }
      EXPECT_NEAR(y[i * d + o], ref, 1e-12);
    }
  // accumulate adds on top.
  std::vector<double> y2(m * d, 1.0);
  moe_combine<double>(eo.data(), w.data(), p.pos.data(), y2.data(), m, k, d, true);
  for (int64_t t = 0; t < m * d; ++t) EXPECT_NEAR(y2[t], 1.0 + y[t], 1e-12);
}

TEST(MoePermute, BackwardsMatchFiniteDifferences) {
  const int64_t m = 30, n = 7, k = 3, d = 5;
  std::vector<double> w;
  const auto idx = random_routing(m, n, k, 221, &w);
  const auto p = moe_permutation(idx.data(), m, k, n);
  auto x = lm::testing::randn<double>(m * d, 222);
  auto eo = lm::testing::randn<double>(m * k * d, 223);
  const auto gxs = lm::testing::randn<double>(m * k * d, 224);
  const auto dy = lm::testing::randn<double>(m * d, 225);
  // gather: L = <xs(x), gxs>.
  std::vector<double> dx(m * d, 7.0);
  moe_gather_backward<double>(gxs.data(), p.pos.data(), dx.data(), m, k, d);
  std::vector<double> xs(m * k * d);
  auto lg = [&] {
    moe_gather<double>(x.data(), p.rows.data(), xs.data(), m, k, d);
    return lm::testing::dot(xs, gxs);
  };
  EXPECT_LT(lm::testing::fd_check(x, dx, lg, 150), 1e-8);
  // combine: L = <y(eo, w), dy>.
  std::vector<double> deo(m * k * d, 9.0), dw(m * k, 9.0), y(m * d);
  moe_combine_backward<double>(eo.data(), w.data(), p.pos.data(), dy.data(), deo.data(), dw.data(), m, k, d);
  auto lc = [&] {
    moe_combine<double>(eo.data(), w.data(), p.pos.data(), y.data(), m, k, d);
    return lm::testing::dot(y, dy);
  };
  EXPECT_LT(lm::testing::fd_check(eo, deo, lc, 150), 1e-8);
  EXPECT_LT(lm::testing::fd_check(w, dw, lc, 90), 1e-8);
}

TEST(MoePermute, DeterministicAcrossThreadCounts) {
  const int64_t m = 20000, n = 64, k = 8, d = 16;
  std::vector<double> wd;
  const auto idx = random_routing(m, n, k, 231, &wd);
  const std::vector<float> w(wd.begin(), wd.end());
  const auto eo = lm::testing::randn<float>(m * k * d, 232);
  const int saved = num_threads();
  auto run = [&](int threads) {
    set_num_threads(threads);
    const auto p = moe_permutation(idx.data(), m, k, n);
    std::vector<float> y(m * d);
    moe_combine<float>(eo.data(), w.data(), p.pos.data(), y.data(), m, k, d);
    return std::make_pair(p.rows, y);
  };
  const auto a = run(1);
  const auto b = run(std::max(2, saved));
  set_num_threads(saved);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.second, b.second);
}

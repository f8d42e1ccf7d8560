// Router: forward vs a naive full sort (incl. ties), extras, errors, backward by finite differences.
// Legend: m tokens, n experts, k experts per token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/moe/router.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;

namespace {

template <class F>
struct Routed {
  std::vector<int32_t> idx;
  std::vector<F> w, s, margin, alpha;
};

template <class F>
Routed<F> route(const std::vector<F>& logits, const std::vector<F>* bias, int64_t m, int64_t n, const RouterConfig& c) {
  Routed<F> r;
  r.idx.resize(m * c.k);
  r.w.resize(m * c.k);
  r.s.resize(m * n);
  r.margin.resize(m);
  r.alpha.resize(m);
  router_forward<F>(logits.data(), bias ? bias->data() : nullptr, m, n, c,
                    {r.idx.data(), r.w.data(), r.s.data(), r.margin.data(), r.alpha.data()});
  return r;
}

// The definition: full stable sort by biased score descending (ties: lower index first).
template <class F>
Routed<F> naive(const std::vector<F>& logits, const std::vector<F>* bias, int64_t m, int64_t n, const RouterConfig& c) {
  Routed<F> r;
  const int64_t k = c.k;
  for (int64_t i = 0; i < m; ++i) {
    std::vector<F> s(n), v(n);
    for (int64_t j = 0; j < n; ++j) {
      s[j] = F(1) / (F(1) + std::exp(-logits[i * n + j]));
      v[j] = s[j] + (bias ? (*bias)[j] : F(0));
    }
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    std::vector<int32_t> sel(order.begin(), order.begin() + k);
    std::sort(sel.begin(), sel.end());
    F sum = 0;
    for (int32_t j : sel) sum += s[j];
    for (int32_t j : sel) {
      r.idx.push_back(j);
      r.w.push_back(c.renormalize ? s[j] * (F(c.routed_scaling_factor) / (sum + F(1e-20)))
                                  : s[j] * F(c.routed_scaling_factor));
    }
    r.margin.push_back(k < n ? v[order[k - 1]] - v[order[k]] : std::numeric_limits<F>::infinity());
    r.alpha.push_back(k < n ? v[order[k]] : -std::numeric_limits<F>::infinity());
    r.s.insert(r.s.end(), s.begin(), s.end());
  }
  return r;
}

template <class F>
void expect_same(const Routed<F>& a, const Routed<F>& b, double tol) {
  ASSERT_EQ(a.idx, b.idx);
  for (size_t t = 0; t < a.w.size(); ++t) EXPECT_NEAR(a.w[t], b.w[t], tol * std::fabs(double(b.w[t])) + 1e-30) << t;
  for (size_t t = 0; t < a.margin.size(); ++t) {
    EXPECT_EQ(a.margin[t], b.margin[t]) << t;
    EXPECT_EQ(a.alpha[t], b.alpha[t]) << t;
  }
  EXPECT_EQ(a.s, b.s);
}

}  // namespace

template <class F>
void naive_random_case(uint64_t seed) {
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{300, 37, 5}, {130, 64, 8}, {64, 16, 1}, {40, 9, 8}}) {
    auto logits = lm::testing::randn<F>(m * n, seed + n, 1.5);
    auto bias = lm::testing::randn<F>(n, seed + 1000 + n, 0.05);
    for (bool renorm : {true, false}) {
      RouterConfig c{k, renorm, 2.446};
      expect_same(route(logits, &bias, m, n, c), naive(logits, &bias, m, n, c), 1e-6);
      expect_same(route<F>(logits, nullptr, m, n, c), naive<F>(logits, nullptr, m, n, c), 1e-6);
    }
  }
}

TEST(MoeRouter, MatchesNaiveSortDouble) { naive_random_case<double>(11); }
TEST(MoeRouter, MatchesNaiveSortFloat) { naive_random_case<float>(12); }

TEST(MoeRouter, TiesBreakToLowerExpertIndex) {
  // Logits and bias on a coarse grid: most tokens have tied biased scores across the cutoff.
  const int64_t m = 500, n = 24, k = 6;
  auto u = lm::testing::randu<double>(m * n, 21, 0.0, 3.0);
  std::vector<double> logits(m * n);
  for (size_t t = 0; t < u.size(); ++t) logits[t] = std::floor(u[t]) - 1.0;  // {-1, 0, 1}
  std::vector<double> bias(n);
  for (int64_t j = 0; j < n; ++j) bias[j] = (j % 3 == 0) ? 0.25 : 0.0;  // exact in binary
  const RouterConfig c{k, true, 1.0};
  const auto r = route(logits, &bias, m, n, c);
  expect_same(r, naive(logits, &bias, m, n, c), 1e-14);
  int64_t ties = 0;
  for (double g : r.margin) ties += (g == 0.0);
  EXPECT_GT(ties, m / 4) << "the case should exercise ties";
  // All-equal row: experts 0..k-1 are selected.
  std::vector<double> flat(n, 0.3);
  const auto f = route<double>(flat, nullptr, 1, n, c);
  for (int64_t t = 0; t < k; ++t) EXPECT_EQ(f.idx[t], t);
  EXPECT_EQ(f.margin[0], 0.0);
}

TEST(MoeRouter, KEqualsNAndDegenerateInputs) {
  const int64_t n = 5;
  auto logits = lm::testing::randn<double>(3 * n, 31);
  const auto r = route<double>(logits, nullptr, 3, n, RouterConfig{n, true, 1.0});
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isinf(r.margin[i]) && r.margin[i] > 0);
    EXPECT_TRUE(std::isinf(r.alpha[i]) && r.alpha[i] < 0);
    double sum = 0;
    for (int64_t t = 0; t < n; ++t) {
      EXPECT_EQ(r.idx[i * n + t], t);
      sum += r.w[i * n + t];
    }
    EXPECT_NEAR(sum, 1.0, 1e-15);
  }
  // Saturated logits stay finite (sigmoid of -1000 is an exact 0; the 1e-20 guards the division).
  std::vector<double> sat(n, -1000.0);
  const auto z = route<double>(sat, nullptr, 1, n, RouterConfig{2, true, 1.0});
  EXPECT_EQ(z.w[0], 0.0);
  EXPECT_EQ(z.w[1], 0.0);
}

TEST(MoeRouter, RejectsBadArguments) {
  std::vector<double> logits(8, 0.0);
  std::vector<int32_t> idx(8);
  std::vector<double> w(8);
  RouterOutputs<double> out{idx.data(), w.data()};
  EXPECT_THROW(router_forward<double>(logits.data(), nullptr, 2, 4, RouterConfig{0, true, 1.0}, out), Error);
  EXPECT_THROW(router_forward<double>(logits.data(), nullptr, 2, 4, RouterConfig{5, true, 1.0}, out), Error);
  logits[5] = std::nan("");
  EXPECT_THROW(router_forward<double>(logits.data(), nullptr, 2, 4, RouterConfig{2, true, 1.0}, out), Error);
  std::vector<double> dl(8);
  idx = {0, 4, 1, 2, 0, 0, 0, 0};  // 4 is out of range for n = 4
  EXPECT_THROW(router_backward<double>(logits.data(), idx.data(), w.data(), dl.data(), 2, 4,
                                       RouterConfig{2, true, 1.0}),
               Error);
}

TEST(MoeRouter, DeterministicAcrossThreadCounts) {
  const int64_t m = 3000, n = 96, k = 8;
  auto logits = lm::testing::randn<float>(m * n, 41);
  auto bias = lm::testing::randn<float>(n, 42, 0.1);
  const RouterConfig c{k, true, 1.0};
  const int saved = num_threads();
  set_num_threads(1);
  const auto a = route(logits, &bias, m, n, c);
  set_num_threads(std::max(2, saved));
  const auto b = route(logits, &bias, m, n, c);
  set_num_threads(saved);
  EXPECT_EQ(a.idx, b.idx);
  EXPECT_EQ(a.w, b.w);
  EXPECT_EQ(a.alpha, b.alpha);
}

// FD in float64 with the selection held fixed: perturbations of 1e-6 are far below the margins.
TEST(MoeRouter, BackwardMatchesFiniteDifferences) {
  const int64_t m = 24, n = 20, k = 4;
  auto bias = lm::testing::randn<double>(n, 52, 0.05);
  for (bool renorm : {true, false}) {
    for (double factor : {1.0, 2.446}) {
      auto logits = lm::testing::randn<double>(m * n, 51, 1.2);
      const RouterConfig c{k, renorm, factor};
      const auto base = route(logits, &bias, m, n, c);
      double min_margin = *std::min_element(base.margin.begin(), base.margin.end());
      ASSERT_GT(min_margin, 1e-4);
      auto dw = lm::testing::randn<double>(m * k, 53);
      std::vector<double> grad(m * n, 123.0);
      router_backward<double>(logits.data(), base.idx.data(), dw.data(), grad.data(), m, n, c);
      // Non-selected logits get exactly zero.
      for (int64_t i = 0; i < m; ++i) {
        const auto row = base.idx.begin() + i * k;
        for (int64_t j = 0; j < n; ++j)
          if (std::find(row, row + k, j) == row + k) {
            EXPECT_EQ(grad[i * n + j], 0.0);
          }
      }
      auto loss = [&] {
        const auto r = route(logits, &bias, m, n, c);
        EXPECT_EQ(r.idx, base.idx) << "selection changed under the FD perturbation";
        return lm::testing::dot(r.w, dw);
      };
      // Probe every selected entry (the informative ones) plus a spread of all entries.
      EXPECT_LT(lm::testing::fd_check(logits, grad, loss, 200), 1e-7) << renorm << " " << factor;
      // accumulate adds.
      std::vector<double> acc(m * n, 1.0);
      router_backward<double>(logits.data(), base.idx.data(), dw.data(), acc.data(), m, n, c, true);
      for (int64_t t = 0; t < m * n; ++t) EXPECT_NEAR(acc[t], 1.0 + grad[t], 1e-15);
    }
  }
}

TEST(MoeRouter, FloatBackwardAgreesWithDouble) {
  const int64_t m = 64, n = 32, k = 6;
  auto ld = lm::testing::randn<double>(m * n, 61);
  auto dwd = lm::testing::randn<double>(m * k, 62);
  std::vector<float> lf(ld.begin(), ld.end()), dwf(dwd.begin(), dwd.end());
  const RouterConfig c{k, true, 2.446};
  const auto rd = route<double>(ld, nullptr, m, n, c);
  const auto rf = route<float>(lf, nullptr, m, n, c);
  ASSERT_EQ(rd.idx, rf.idx);
  std::vector<double> gd(m * n);
  std::vector<float> gf(m * n);
  router_backward<double>(ld.data(), rd.idx.data(), dwd.data(), gd.data(), m, n, c);
  router_backward<float>(lf.data(), rf.idx.data(), dwf.data(), gf.data(), m, n, c);
  std::vector<double> gfd(gf.begin(), gf.end());
  EXPECT_LT(lm::testing::rel_rms_vec(gd, gfd), 1e-6);
}

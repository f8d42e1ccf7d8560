// Quantile Balancing (exact definition, histogram convergence, balancing effect, invariances),
// DeepSeek sign update, Switch-style aux loss (value and gradient), loads and MaxVio.
// Legend: m tokens, n experts, k experts per token, q = m·k/n.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "ops/moe/balance.hpp"
#include "ops/moe/router.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;

namespace {

// A skewed router: logits_ij = z_ij + skew·μ_j, z ~ N(0, 1), μ_j a fixed per-expert preference.
template <class F>
std::vector<F> skewed_logits(int64_t m, int64_t n, uint64_t seed, double skew, const std::vector<double>& mu) {
  const Rng r{seed, 0};
  std::vector<F> l(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const uint64_t t = static_cast<uint64_t>(i * n + j);
      const double z = std::is_same_v<F, float> ? double(r.normal(t)) : r.normal_f64(t);
      l[i * n + j] = static_cast<F>(z + skew * mu[j]);
    }
  return l;
}

template <class F>
std::vector<F> sigmoid_all(const std::vector<F>& l) {
  std::vector<F> s(l.size());
  for (size_t t = 0; t < l.size(); ++t) s[t] = F(1) / (F(1) + std::exp(-l[t]));
  return s;
}

// Loads and MaxVio of routing the scores s with bias b.
template <class F>
double maxvio_of(const std::vector<F>& s, const std::vector<F>& b, int64_t m, int64_t n, int64_t k) {
  // Token i selects j iff s_ij + b_j ranks above its (k+1)-th value α_i (ties at α: none here).
  std::vector<F> alpha(m);
  qb_admission_cutoff(s.data(), b.data(), alpha.data(), m, n, k);
  std::vector<int64_t> loads(n, 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) loads[j] += (s[i * n + j] + b[j]) > alpha[i];
  return max_violation(loads.data(), n);
}

// Naive β by full sort with the documented interpolation, in the same arithmetic as the op.
template <class F>
std::vector<F> naive_beta(const std::vector<F>& s, const std::vector<F>& b, int64_t m, int64_t n, int64_t k) {
  std::vector<F> alpha(m), beta(n);
  for (int64_t i = 0; i < m; ++i) {
    std::vector<F> v(n);
    for (int64_t j = 0; j < n; ++j) v[j] = s[i * n + j] + b[j];
    std::sort(v.begin(), v.end(), std::greater<F>());
    alpha[i] = v[k];
  }
  const int64_t Q = m * k / n;
  const double f = double((m * k) % n) / double(n);
  for (int64_t j = 0; j < n; ++j) {
    std::vector<F> r(m);
    for (int64_t i = 0; i < m; ++i) r[i] = s[i * n + j] - alpha[i];
    std::sort(r.begin(), r.end(), std::greater<F>());
    beta[j] = f == 0 ? r[Q] : F((1 - f) * double(r[Q]) + f * double(r[std::min(Q + 1, m - 1)]));
  }
  return beta;
}

}  // namespace

TEST(MoeQb, AdmissionCutoffMatchesRouterAlpha) {
  const int64_t m = 200, n = 48, k = 6;
  auto logits = lm::testing::randn<double>(m * n, 101);
  auto b = lm::testing::randn<double>(n, 102, 0.1);
  std::vector<int32_t> idx(m * k);
  std::vector<double> w(m * k), s(m * n), alpha_r(m), alpha_q(m);
  router_forward<double>(logits.data(), b.data(), m, n, RouterConfig{k, true, 1.0},
                         {idx.data(), w.data(), s.data(), nullptr, alpha_r.data()});
  qb_admission_cutoff(s.data(), b.data(), alpha_q.data(), m, n, k);
  EXPECT_EQ(alpha_r, alpha_q);
}

template <class F>
void exact_matches_naive(uint64_t seed) {
  // (m, n, k): q integer, non-integer, tiny (r_(Q+2) past the end), and K3-like k/n.
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 16, 4}, {333, 16, 4}, {7, 16, 4}, {2, 4, 3},
                         {3000, 64, 8}, {2000, 128, 3}}) {
    for (bool ties : {false, true}) {
      auto s = sigmoid_all(lm::testing::randn<F>(m * n, seed + m + n, 1.3));
      auto b = lm::testing::randn<F>(n, seed + 1, 0.05);
      if (ties) {  // scores and bias on a 1/64 grid: many exactly equal margins in one bucket
        for (F& v : s) v = std::round(v * F(64)) / F(64);
        for (F& v : b) v = std::round(v * F(64)) / F(64);
      }
      std::vector<F> beta(n);
      qb_beta_exact<F>(s.data(), b.data(), nullptr, beta.data(), m, n, k);
      EXPECT_EQ(beta, naive_beta(s, b, m, n, k)) << m << " " << n << " " << k << " ties " << ties;
    }
  }
}
TEST(MoeQb, ExactBetaMatchesFullSortDouble) { exact_matches_naive<double>(110); }
TEST(MoeQb, ExactBetaMatchesFullSortFloat) { exact_matches_naive<float>(210); }

TEST(MoeQb, ExactBetaCountsAroundTheQuantile) {
  const int64_t n = 16, k = 4, m = 640;  // q = 160
  auto s = sigmoid_all(lm::testing::randn<double>(m * n, 115));
  auto b = lm::testing::randn<double>(n, 111, 0.05);
  std::vector<double> beta(n), alpha(m);
  qb_beta_exact<double>(s.data(), b.data(), nullptr, beta.data(), m, n, k);
  // At most q margins lie above β_j and at least q + 1 at or above it. (Not exactly q above:
  // every token whose (k+1)-th expert is j has r_ij = −b_j up to rounding, an atom.)
  qb_admission_cutoff(s.data(), b.data(), alpha.data(), m, n, k);
  for (int64_t j = 0; j < n; ++j) {
    int64_t above = 0, at_or_above = 0;
    for (int64_t i = 0; i < m; ++i) {
      above += (s[i * n + j] - alpha[i]) > beta[j] + 1e-12;
      at_or_above += (s[i * n + j] - alpha[i]) >= beta[j] - 1e-12;
    }
    EXPECT_LE(above, m * k / n);
    EXPECT_GE(at_or_above, m * k / n + 1);
  }
}

TEST(MoeQb, BiasIsMeanZeroAndInvariantToShifts) {
  const int64_t m = 2000, n = 64, k = 8;
  std::vector<double> mu = lm::testing::randn<double>(n, 121);
  auto s = sigmoid_all(skewed_logits<double>(m, n, 122, 1.0, mu));
  auto b = lm::testing::randn<double>(n, 123, 0.1);
  std::vector<double> b1(n), b2(n), b3(n), bh(n);
  qb_update_exact<double>(s.data(), b.data(), nullptr, b1.data(), m, n, k);
  double sum = 0;
  for (double v : b1) sum += v;
  EXPECT_NEAR(sum, 0.0, 1e-13);
  // Same scores plus a constant (0.375 and its sums stay exact enough in binary).
  auto s_shift = s;
  for (double& v : s_shift) v += 0.375;
  qb_update_exact<double>(s_shift.data(), b.data(), nullptr, b2.data(), m, n, k);
  // Same selection, bias shifted by a constant.
  auto b_shift = b;
  for (double& v : b_shift) v -= 0.125;
  qb_update_exact<double>(s.data(), b_shift.data(), nullptr, b3.data(), m, n, k);
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_NEAR(b2[j], b1[j], 1e-14);
    EXPECT_NEAR(b3[j], b1[j], 1e-14);
  }
  // Histogram estimator: mean zero as well, and also shift-invariant up to its resolution.
  const QbHistogram h{};
  qb_update_hist<double>(s.data(), b.data(), nullptr, bh.data(), m, n, k, h);
  sum = 0;
  for (double v : bh) sum += v;
  EXPECT_NEAR(sum, 0.0, 1e-13);
  qb_update_hist<double>(s_shift.data(), b.data(), nullptr, b2.data(), m, n, k, h);
  for (int64_t j = 0; j < n; ++j) EXPECT_NEAR(b2[j], bh[j], 1e-12);
}

// Histogram β → exact β as the bins shrink, for both layouts, in float and double.
template <class F>
void hist_converges() {
  const int64_t m = 4096, n = 32, k = 4;
  std::vector<double> mu = lm::testing::randn<double>(n, 131);
  auto s = sigmoid_all(skewed_logits<F>(m, n, 132, 0.7, mu));
  auto b = lm::testing::randn<F>(n, 133, 0.05);
  std::vector<F> exact(n), est(n);
  qb_beta_exact<F>(s.data(), b.data(), nullptr, exact.data(), m, n, k);
  for (QbHistLayout layout : {QbHistLayout::Uniform, QbHistLayout::Rational}) {
    double err_1024 = 0;
    for (int64_t bins : {64, 256, 1024, 4096, 16384, 65536}) {
      QbHistogram h = qb_hist_cover(b.data(), n, bins);
      if (layout == QbHistLayout::Rational) {
        h.layout = QbHistLayout::Rational;
        h.scale = 0.05;
      }
      std::vector<int64_t> counts(n * qb_hist_slots(h), 0);
      qb_hist_accumulate<F>(s.data(), b.data(), nullptr, m, n, k, h, counts.data());
      for (int64_t j = 0; j < n; ++j) {
        int64_t tot = 0;
        for (int64_t t = 0; t < qb_hist_slots(h); ++t) tot += counts[j * qb_hist_slots(h) + t];
        ASSERT_EQ(tot, m);
      }
      qb_beta_from_hist<F>(counts.data(), b.data(), est.data(), n, k, h);
      // The answer's bin bounds the error: report it in units of that bin's width.
      double err = 0, err_bins = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double e = std::fabs(double(est[j]) - double(exact[j]));
        const double x = double(exact[j]) + double(b[j]);  // the biased margin the bins see
        double w;
        if (layout == QbHistLayout::Uniform) {
          w = 2.0 * h.range / double(bins);
        } else {
          const double phi = x / (std::fabs(x) + h.scale), dphi = 2.0 / double(bins);
          w = h.scale * dphi / ((1 - std::fabs(phi)) * (1 - std::fabs(phi)));  // dx/dφ · Δφ
        }
        err = std::max(err, e);
        err_bins = std::max(err_bins, e / w);
      }
      std::printf("%s bins %6lld: max |β_hist − β_exact| = %.3g (%.2f bin widths)\n",
                  layout == QbHistLayout::Uniform ? "uniform " : "rational", static_cast<long long>(bins), err,
                  err_bins);
      EXPECT_LT(err_bins, 1.0) << "the estimate stays inside the answer's bin";
      if (bins == 1024) err_1024 = err;
      if (bins == 65536) {
        EXPECT_LT(err, err_1024 / 8);
        EXPECT_LT(err, 1e-4);
      }
    }
  }
}
TEST(MoeQb, HistogramConvergesToExactDouble) { hist_converges<double>(); }
TEST(MoeQb, HistogramConvergesToExactFloat) { hist_converges<float>(); }

TEST(MoeQb, HistogramCountsAddAcrossShards) {
  // What a distributed run does: each process counts its tokens, the counts are summed.
  const int64_t m = 3000, n = 40, k = 5;
  std::vector<double> mu = lm::testing::randn<double>(n, 141);
  auto s = sigmoid_all(skewed_logits<float>(m, n, 142, 1.0, mu));
  auto b = lm::testing::randn<float>(n, 143, 0.05);
  const QbHistogram h{};
  const int64_t slots = qb_hist_slots(h);
  std::vector<int64_t> whole(n * slots, 0), parts(n * slots, 0);
  qb_hist_accumulate<float>(s.data(), b.data(), nullptr, m, n, k, h, whole.data());
  const int64_t cut[] = {0, 700, 1901, m};
  for (int p = 0; p < 3; ++p)
    qb_hist_accumulate<float>(s.data() + cut[p] * n, b.data(), nullptr, cut[p + 1] - cut[p], n, k, h, parts.data());
  EXPECT_EQ(whole, parts);
  std::vector<float> b1(n), b2(n);
  qb_update_hist<float>(s.data(), b.data(), nullptr, b1.data(), m, n, k, h);
  std::vector<float> beta(n);
  qb_beta_from_hist<float>(parts.data(), b.data(), beta.data(), n, k, h);
  qb_bias_from_beta(beta.data(), b2.data(), n);
  EXPECT_EQ(b1, b2);
}

// The point of QB, simulated as training: every step routes a fresh batch of a skewed router with
// the current bias, then installs the QB update computed from that batch for the next step.
TEST(MoeQb, BalancesASkewedRouter) {
  const int64_t m = 65536, n = 64, k = 8;
  std::vector<double> mu = lm::testing::randn<double>(n, 151);
  std::vector<float> b_exact(n, 0.0f), b_hist(n, 0.0f), b_sign(n, 0.0f);
  const QbHistogram h{};
  for (int step = 0; step < 5; ++step) {
    const auto s = sigmoid_all(skewed_logits<float>(m, n, 152 + step, 1.0, mu));
    const double v_exact = maxvio_of(s, b_exact, m, n, k), v_hist = maxvio_of(s, b_hist, m, n, k);
    const double v_sign = maxvio_of(s, b_sign, m, n, k);
    std::printf("step %d MaxVio: QB exact %.4f, QB histogram %.4f, sign update (γ = 1e-3) %.4f\n", step, v_exact,
                v_hist, v_sign);
    if (step == 0) {
      EXPECT_GT(v_exact, 3.0) << "the router should start badly imbalanced";
    } else if (step == 1) {  // one update from far away: most of the way (the cutoffs α_i move too)
      EXPECT_LT(v_exact, 0.2);
      EXPECT_LT(v_hist, 0.2);
    } else {
      EXPECT_LT(v_exact, 0.1);
      EXPECT_LT(v_hist, 0.1);
    }
    // In place: b_new may alias b.
    qb_update_exact<float>(s.data(), b_exact.data(), nullptr, b_exact.data(), m, n, k);
    qb_update_hist<float>(s.data(), b_hist.data(), nullptr, b_hist.data(), m, n, k, h);
    std::vector<float> alpha(m);
    qb_admission_cutoff(s.data(), b_sign.data(), alpha.data(), m, n, k);
    std::vector<int64_t> loads(n, 0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) loads[j] += (s[i * n + j] + b_sign[j]) > alpha[i];
    bias_sign_update<float>(loads.data(), b_sign.data(), n);
  }
}

TEST(MoeQb, RejectsBadArguments) {
  std::vector<double> s(8, 0.5), b(4, 0.0), out(4);
  EXPECT_THROW(qb_update_exact<double>(s.data(), b.data(), nullptr, out.data(), 2, 4, 4), Error);  // k == n
  EXPECT_THROW(qb_update_exact<double>(s.data(), b.data(), nullptr, out.data(), 0, 4, 2), Error);  // no tokens
  std::vector<double> alpha(2, 0.5), s_nan = s;
  s_nan[5] = std::nan("");
  EXPECT_THROW(qb_update_exact<double>(s_nan.data(), b.data(), nullptr, out.data(), 2, 4, 2), Error);
  EXPECT_THROW(qb_update_exact<double>(s_nan.data(), b.data(), alpha.data(), out.data(), 2, 4, 2), Error);
  QbHistogram h;
  h.layout = QbHistLayout::Uniform;
  h.range = 0.0;
  EXPECT_THROW(qb_update_hist<double>(s.data(), b.data(), nullptr, out.data(), 2, 4, 2, h), Error);
  std::vector<int64_t> zero(4 * qb_hist_slots(QbHistogram{}), 0);
  EXPECT_THROW(qb_beta_from_hist<double>(zero.data(), b.data(), out.data(), 4, 2, QbHistogram{}), Error);
}

TEST(MoeBalance, LoadsAndMaxViolation) {
  const std::vector<int32_t> idx = {0, 1, 0, 2, 0, 3, 1, 2};  // m = 4, k = 2, n = 4
  std::vector<int64_t> loads(4);
  expert_loads(idx.data(), 4, 2, 4, loads.data());
  EXPECT_EQ(loads, (std::vector<int64_t>{3, 2, 2, 1}));
  EXPECT_DOUBLE_EQ(max_violation(loads.data(), 4), 3.0 / 2.0 - 1.0);
  const std::vector<int64_t> even = {5, 5, 5};
  EXPECT_EQ(max_violation(even.data(), 3), 0.0);
  const std::vector<int32_t> bad = {0, 4};
  EXPECT_THROW(expert_loads(bad.data(), 1, 2, 4, loads.data()), Error);
}

TEST(MoeBalance, SignUpdateMovesTowardsTheMean) {
  const std::vector<int64_t> loads = {10, 4, 7, 7};  // mean 7
  std::vector<double> b = {0.0, 0.0, 0.5, -0.5};
  bias_sign_update<double>(loads.data(), b.data(), 4);
  EXPECT_EQ(b, (std::vector<double>{-1e-3, 1e-3, 0.5, -0.5}));
  std::vector<float> bf(4, 0.0f);
  bias_sign_update<float>(loads.data(), bf.data(), 4, 0.01f);
  EXPECT_EQ(bf, (std::vector<float>{-0.01f, 0.01f, 0.0f, 0.0f}));
}

TEST(MoeBalance, AuxLossValueAndGradient) {
  const int64_t m = 40, n = 12, k = 3;
  const double coef = 0.01;
  std::vector<double> mu = lm::testing::randn<double>(n, 161);
  auto logits = skewed_logits<double>(m, n, 162, 1.0, mu);
  std::vector<int32_t> idx(m * k);
  std::vector<double> w(m * k);
  router_forward<double>(logits.data(), nullptr, m, n, RouterConfig{k, true, 1.0}, {idx.data(), w.data()});
  // Value against the textbook form coef · n · Σ f_j P_j.
  std::vector<int64_t> loads(n);
  expert_loads(idx.data(), m, k, n, loads.data());
  auto s = sigmoid_all(logits);
  double ref = 0;
  for (int64_t j = 0; j < n; ++j) {
    double P = 0;
    for (int64_t i = 0; i < m; ++i) {
      double S = 0;
      for (int64_t l = 0; l < n; ++l) S += s[i * n + l];
      P += s[i * n + j] / S / m;
    }
    ref += double(loads[j]) / double(m * k) * P;
  }
  ref *= coef * n;
  EXPECT_NEAR(aux_loss_forward<double>(logits.data(), idx.data(), m, n, k, coef), ref, 1e-15);
  // Uniform f and P give exactly coef.
  std::vector<double> zeros(n * n, 0.0);
  std::vector<int32_t> cyc(n * k);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t t = 0; t < k; ++t) cyc[i * k + t] = static_cast<int32_t>((i + t) % n);
  EXPECT_NEAR(aux_loss_forward<double>(zeros.data(), cyc.data(), n, n, k, coef), coef, 1e-15);
  // Gradient w.r.t. the logits with the selection (f) fixed.
  std::vector<double> grad(m * n, 5.0);
  aux_loss_backward<double>(logits.data(), idx.data(), grad.data(), m, n, k, coef);
  auto loss = [&] { return aux_loss_forward<double>(logits.data(), idx.data(), m, n, k, coef); };
  EXPECT_LT(lm::testing::fd_check(logits, grad, loss, 120), 1e-6);
  // Accumulation on top of a router gradient, float agrees with double.
  std::vector<float> lf(logits.begin(), logits.end()), gf(m * n, 1.0f);
  aux_loss_backward<float>(lf.data(), idx.data(), gf.data(), m, n, k, coef, true);
  for (int64_t t = 0; t < m * n; ++t) EXPECT_NEAR(gf[t], 1.0 + grad[t], 1e-7);
}

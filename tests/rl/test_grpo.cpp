// GRPO (rl/grpo.hpp): group advantages and the clipped token loss against their formulas written out by hand, the
// loss's dL/dlogp against finite differences, the mask (prompt and tool tokens carry nothing), and the whole
// model's gradient through Model::forward_backward_logp against finite differences of the loss of
// Model::target_logprobs (float64 model).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "model/model.hpp"
#include "rl/grpo.hpp"
#include "tests/testing.hpp"
#include "train/tiny_run.hpp"

using namespace lm;
using namespace lm::rl;

TEST(Grpo, GroupAdvantagesAreStandardisedWithinEachGroup) {
  // Two groups of 4: {1, 0, 0, 1} has mean 0.5 and std 0.5; {0, 0, 0, 0} gives nothing to learn from.
  const std::vector<double> r = {1, 0, 0, 1, 0, 0, 0, 0, 3, 1, 2, 2};
  const auto a = group_advantages(r, 4, 1e-6);
  ASSERT_EQ(a.size(), 12u);
  EXPECT_NEAR(a[0], 0.5 / (0.5 + 1e-6), 1e-12);
  EXPECT_NEAR(a[1], -0.5 / (0.5 + 1e-6), 1e-12);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(a[i], 0.0);
  const double sd = std::sqrt((1.0 + 1.0 + 0 + 0) / 4);  // {3, 1, 2, 2}: mean 2
  EXPECT_NEAR(a[8], 1 / (sd + 1e-6), 1e-12);
  EXPECT_NEAR(a[9], -1 / (sd + 1e-6), 1e-12);
  EXPECT_EQ(a[10], 0.0);
  EXPECT_THROW(group_advantages(r, 5, 1e-6), Error);
}

TEST(Grpo, LengthPenaltyOnlyBeyondTheBudget) {
  GrpoConfig c;
  c.length_budget = 100;
  c.length_penalty = 0.5;
  EXPECT_EQ(shaped_reward(1, 100, c), 1.0);
  EXPECT_DOUBLE_EQ(shaped_reward(1, 150, c), 0.75);
  c.length_budget = 0;
  EXPECT_EQ(shaped_reward(1, 10000, c), 1.0);
}

namespace {

GrpoTokens four_tokens() {
  GrpoTokens b;
  b.mask = {0, 1, 1, 1, 1, 0};
  b.old_logp = {-9, -1.0, -2.0, -0.5, -1.5, -9};
  b.adv = {5, 1.0, 1.0, -1.0, -1.0, 5};
  b.ref_logp = {-9, -1.2, -1.9, -0.6, -1.0, -9};
  return b;
}

}  // namespace

TEST(Grpo, ClippedLossAndStatsAgainstTheFormula) {
  GrpoConfig c;
  c.clip_low = 0.2;
  c.clip_high = 0.3;
  c.kl_coef = 0.1;
  const GrpoTokens b = four_tokens();
  // rho: 1 (A>0), e^0.5 = 1.65 > 1.3 (A>0: clipped), e^-0.5 = 0.61 < 0.8 (A<0: clipped), e^0.2 = 1.22 (A<0: not)
  const std::vector<double> logp = {0, -1.0, -1.5, -1.0, -1.3, 0};
  const GrpoLoss L = grpo_loss(logp, b, c);
  EXPECT_EQ(L.n, 4);
  EXPECT_DOUBLE_EQ(L.clip_frac, 0.5);
  const double r1 = std::exp(0.2);
  const double pol = (-(1.0) - (1.3) - (-0.8) - (-r1)) / 4;  // -min(rho A, clip(rho) A)
  EXPECT_NEAR(L.policy_loss, pol, 1e-12);
  double kl = 0;
  const int rows[] = {1, 2, 3, 4};
  for (int t : rows) {
    const double dq = b.ref_logp[t] - logp[t];
    kl += (std::exp(dq) - dq - 1) / 4;
  }
  EXPECT_NEAR(L.kl, kl, 1e-12);
  EXPECT_NEAR(L.loss, pol + 0.1 * kl, 1e-12);
  // Clipped tokens carry only the KL gradient; masked rows nothing.
  EXPECT_EQ(L.dlogp[0], 0.0);
  EXPECT_EQ(L.dlogp[5], 0.0);
  EXPECT_NEAR(L.dlogp[2], 0.1 * (1 - std::exp(b.ref_logp[2] - logp[2])) / 4, 1e-12);
  EXPECT_NEAR(L.dlogp[4], (r1 + 0.1 * (1 - std::exp(b.ref_logp[4] - logp[4]))) / 4, 1e-12);
}

TEST(Grpo, LossGradientMatchesFiniteDifferencesAndIgnoresMaskedRows) {
  GrpoConfig c;
  c.kl_coef = 0.05;
  const GrpoTokens b = four_tokens();
  std::vector<double> logp = {0, -0.9, -2.1, -0.45, -1.6, 0};  // all within the clip range: smooth there
  const GrpoLoss L = grpo_loss(logp, b, c);
  EXPECT_EQ(L.clip_frac, 0.0);
  const double e = lm::testing::fd_check(logp, L.dlogp, [&] { return grpo_loss(logp, b, c).loss; }, 6);
  EXPECT_LT(e, 1e-7);
  // A masked row's log-prob (a prompt or tool-result token) changes nothing.
  std::vector<double> other = logp;
  other[0] = -3, other[5] = -7;
  EXPECT_EQ(grpo_loss(other, b, c).loss, L.loss);
  GrpoTokens bad = b;
  bad.adv.pop_back();
  EXPECT_THROW(grpo_loss(logp, bad, c), Error);
}

// The whole path: Model<double>::forward_backward_logp with the GRPO loss's dL/dlogp against central differences
// of grpo_loss(target_logprobs) on entries of every parameter kind.
TEST(Grpo, ModelGradientMatchesFiniteDifferences) {
  const model::ModelConfig mc = model::ModelConfig::from_json(io::json::parse(train::tiny::kTinyModel), "tiny");
  model::Model<double> m(mc);
  m.params().init(11);
  m.params().enable_grads();
  const model::Seqs s = model::Seqs::packed({0, 7, 13});
  std::vector<int32_t> ids(13), tg(13);
  for (int i = 0; i < 13; ++i) ids[i] = (i * 37 + 5) % 320, tg[i] = (i * 53 + 11) % 320;
  GrpoTokens b;
  b.mask = {0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0};
  for (int i = 0; i < 13; ++i) tg[i] = b.mask[i] ? tg[i] : -100;
  const std::vector<double> lp0 = m.target_logprobs(ids.data(), tg.data(), s);
  for (int i = 0; i < 13; ++i) b.old_logp.push_back(lp0[i] + 0.05 * std::sin(i));  // ratios near 1, unclipped
  for (int i = 0; i < 13; ++i) b.ref_logp.push_back(lp0[i] - 0.1 * std::cos(i));
  b.adv = {0, 0, 1.2, 1.2, 1.2, 0, 0, 0, 0, -0.7, -0.7, -0.7, 0};
  GrpoConfig c;
  c.kl_coef = 0.1;
  m.params().zero_grads();
  GrpoLoss last;
  m.forward_backward_logp(ids.data(), tg.data(), s, [&](const std::vector<double>& lp) {
    last = grpo_loss(lp, b, c);
    return last.dlogp;
  });
  EXPECT_EQ(last.clip_frac, 0.0);
  auto loss = [&] { return grpo_loss(m.target_logprobs(ids.data(), tg.data(), s), b, c).loss; };
  double worst = 0;
  int checked = 0;
  for (auto& p : m.params().all()) {
    if (!p.g()) continue;
    const int64_t n = p.value.numel();
    for (int64_t j : {int64_t{0}, n - 1}) {
      double* w = p.w() + j;
      const double w0 = *w, h = 1e-5;
      *w = w0 + h;
      const double lp = loss();
      *w = w0 - h;
      const double lm = loss();
      *w = w0;
      const double fd = (lp - lm) / (2 * h), an = p.g()[j];
      const double err = std::abs(fd - an) / std::max(1e-5, std::abs(fd) + std::abs(an));  // floor: FD round-off on tiny entries
      worst = std::max(worst, err);
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
  EXPECT_LT(worst, 1e-5);
  std::printf("GRPO model gradient vs central differences: %d entries, worst rel err %.2e\n", checked, worst);
}

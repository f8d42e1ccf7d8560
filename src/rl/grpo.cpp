// GRPO advantages and the clipped token loss (see grpo.hpp for the formulas).
#include "rl/grpo.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace lm::rl {

GrpoConfig GrpoConfig::from_json(const io::json& j, const std::string& ctx) {
  LM_CHECK(j.is_object(), "{}: grpo must be an object", ctx);
  GrpoConfig c;
  for (const auto& [k, v] : j.items()) {
    auto num = [&, k = k, v = v]() {
      LM_CHECK(v.is_number(), "{}: grpo.{} must be a number", ctx, k);
      return v.get<double>();
    };
    if (k == "group_size") c.group_size = static_cast<int64_t>(num());
    else if (k == "clip_low") c.clip_low = num();
    else if (k == "clip_high") c.clip_high = num();
    else if (k == "kl_coef") c.kl_coef = num();
    else if (k == "adv_eps") c.adv_eps = num();
    else if (k == "length_penalty") c.length_penalty = num();
    else if (k == "length_budget") c.length_budget = static_cast<int64_t>(num());
    else lm::fail("{}: grpo.{} is not a GRPO setting (group_size, clip_low, clip_high, kl_coef, adv_eps, "
                  "length_penalty, length_budget)", ctx, k);
  }
  LM_CHECK(c.group_size >= 2, "{}: grpo.group_size {} must be >= 2 (advantages are relative to the group)", ctx,
           c.group_size);
  LM_CHECK(c.clip_low >= 0 && c.clip_low < 1 && c.clip_high >= 0, "{}: grpo.clip_low must be in [0, 1), clip_high >= 0",
           ctx);
  LM_CHECK(c.kl_coef >= 0 && c.adv_eps > 0 && c.length_penalty >= 0 && c.length_budget >= 0,
           "{}: grpo.kl_coef, length_penalty and length_budget must be >= 0 and adv_eps > 0", ctx);
  return c;
}

io::json GrpoConfig::to_json() const {
  return {{"group_size", group_size}, {"clip_low", clip_low},           {"clip_high", clip_high},
          {"kl_coef", kl_coef},       {"adv_eps", adv_eps},             {"length_penalty", length_penalty},
          {"length_budget", length_budget}};
}

double shaped_reward(double reward, int64_t tokens, const GrpoConfig& c) {
  if (c.length_budget <= 0 || tokens <= c.length_budget) return reward;
  return reward - c.length_penalty * static_cast<double>(tokens - c.length_budget) /
                      static_cast<double>(c.length_budget);
}

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t K, double eps) {
  LM_CHECK(K >= 1 && rewards.size() % static_cast<size_t>(K) == 0,
           "group_advantages: {} rewards are not groups of {}", rewards.size(), K);
  std::vector<double> a(rewards.size());
  for (size_t g = 0; g < rewards.size(); g += static_cast<size_t>(K)) {
    double mean = 0, var = 0;
    for (int64_t k = 0; k < K; ++k) mean += rewards[g + k];
    mean /= static_cast<double>(K);
    for (int64_t k = 0; k < K; ++k) var += (rewards[g + k] - mean) * (rewards[g + k] - mean);
    const double sd = std::sqrt(var / static_cast<double>(K));
    for (int64_t k = 0; k < K; ++k) a[g + k] = sd == 0 ? 0.0 : (rewards[g + k] - mean) / (sd + eps);
  }
  return a;
}

GrpoLoss grpo_loss(const std::vector<double>& logp, const GrpoTokens& b, const GrpoConfig& c) {
  const size_t n = logp.size();
  LM_CHECK(b.mask.size() == n && b.old_logp.size() == n && b.adv.size() == n && (b.ref_logp.empty() ||
           b.ref_logp.size() == n), "grpo_loss: {} rows but mask {}, old_logp {}, adv {}, ref_logp {}", n,
           b.mask.size(), b.old_logp.size(), b.adv.size(), b.ref_logp.size());
  GrpoLoss r;
  r.dlogp.assign(n, 0.0);
  for (size_t t = 0; t < n; ++t) r.n += b.mask[t] != 0;
  if (r.n == 0) return r;
  const double inv_n = 1.0 / static_cast<double>(r.n);
  const bool kl = c.kl_coef > 0 && !b.ref_logp.empty();
  int64_t clipped = 0;
  for (size_t t = 0; t < n; ++t) {
    if (!b.mask[t]) continue;
    const double A = b.adv[t], rho = std::exp(logp[t] - b.old_logp[t]);
    const double rho_c = std::clamp(rho, 1 - c.clip_low, 1 + c.clip_high);
    const double l = -std::min(rho * A, rho_c * A);
    const bool is_clipped = (A > 0 && rho > 1 + c.clip_high) || (A < 0 && rho < 1 - c.clip_low);
    clipped += is_clipped;
    double g = is_clipped ? 0.0 : -rho * A;
    double k = 0;
    if (kl) {
      const double dq = b.ref_logp[t] - logp[t];
      k = std::exp(dq) - dq - 1;
      g += c.kl_coef * (1 - std::exp(dq));
    }
    r.policy_loss += l * inv_n;
    r.kl += k * inv_n;
    r.ratio_mean += rho * inv_n;
    r.dlogp[t] = g * inv_n;
  }
  r.loss = r.policy_loss + (kl ? c.kl_coef * r.kl : 0.0);
  r.clip_frac = static_cast<double>(clipped) * inv_n;
  return r;
}

}  // namespace lm::rl

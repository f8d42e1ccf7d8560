#pragma once
// GRPO (group relative policy optimisation) for agentic RL (docs/rl.md "longmoe rl"): K trajectories per prompt,
// group-relative advantages, a token-level PPO-clipped policy-gradient loss against the log-probs recorded at
// rollout time, an optional KL penalty to a frozen reference, a length-budget penalty on the reward.
//
// Legend: i trajectory, g its group (prompt), K trajectories per group, t token, m_t = 1 on tokens the policy
// generated (never prompt, tool result or chat-template tokens), N = sum_t m_t over the batch.
//   shaped reward  r~_i = r_i - length_penalty * max(0, n_i - length_budget) / length_budget   (n_i: generated tokens)
//   advantage      A_i = (r~_i - mean_g r~) / (std_g r~ + eps)      (population std of the K rewards of the group)
//   ratio          rho_t = exp(logp_t - logp_old_t)                  (logp_old: the sampler's, at rollout time)
//   policy loss    l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
//   KL (k3)        k_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1    (>= 0, unbiased for KL(pi||ref))
//   loss           L = (1/N) sum_t m_t (l_t + beta k_t)                           (token-level mean over the batch)
//   dL/dlogp_t = (m_t/N) (-[not clipped_t] rho_t A + beta (1 - exp(logp_ref_t - logp_t)))
// A token is clipped (no policy gradient) when A > 0 and rho_t > 1 + eps_high, or A < 0 and rho_t < 1 - eps_low.
#include <cstdint>
#include <vector>

#include "io/json.hpp"

namespace lm::rl {

struct GrpoConfig {
  int64_t group_size = 4;       // K trajectories per prompt
  double clip_low = 0.2, clip_high = 0.2;
  double kl_coef = 0;           // beta; > 0 keeps a frozen copy of the initial policy as the reference
  double adv_eps = 1e-6;
  double length_penalty = 0;    // reward lost per length_budget tokens beyond length_budget
  int64_t length_budget = 0;    // generated tokens; 0: no penalty
  static GrpoConfig from_json(const io::json& j, const std::string& ctx);  // strict: unknown fields are errors
  io::json to_json() const;
};

// The reward after the length-budget penalty, for a trajectory that generated `tokens` tokens.
double shaped_reward(double reward, int64_t tokens, const GrpoConfig& c);

// A_i per trajectory; rewards.size() must be a multiple of K, groups consecutive. A group whose rewards are all
// equal gets advantages 0 (nothing to learn from it).
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t K, double eps);

// The token rows of a batch of trajectories, in the model's row order.
struct GrpoTokens {
  std::vector<uint8_t> mask;        // m_t
  std::vector<double> old_logp;     // logp_old_t (read where m_t = 1)
  std::vector<double> ref_logp;     // logp_ref_t (empty: no KL term)
  std::vector<double> adv;          // A of the row's trajectory
};

struct GrpoLoss {
  double loss = 0;         // L
  double policy_loss = 0;  // (1/N) sum m_t l_t
  double kl = 0;           // (1/N) sum m_t k_t (0 without a reference)
  double clip_frac = 0;    // share of the N tokens that are clipped
  double ratio_mean = 0;   // (1/N) sum m_t rho_t
  int64_t n = 0;           // N
  std::vector<double> dlogp;  // dL/dlogp_t
};
GrpoLoss grpo_loss(const std::vector<double>& logp, const GrpoTokens& b, const GrpoConfig& c);

}  // namespace lm::rl

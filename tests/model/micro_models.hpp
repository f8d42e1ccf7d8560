#pragma once
// Micro models shared by the model tests (test_model.cpp, test_multimodal.cpp): configs small enough for float64
// finite differences, and random weights like the goldens'.
#include <cmath>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "io/json.hpp"
#include "model/config.hpp"
#include "model/params.hpp"
#include "testing.hpp"

namespace lm::testing::micro {

using model::ModelConfig;
using model::ParamStore;

// A micro K3: layer 0 KDA + dense FFN, layer 1 KDA + LatentMoE, layer 2 MLA + LatentMoE; AttnRes.
inline const char* kMicroK3 = R"({
  "model_type": "kimi_linear", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 3,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 6,
  "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "mla_use_nope": true, "mla_use_output_gate": true,
  "linear_attn_config": {"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": true,
                         "gate_lower_bound": -5.0, "kda_layers": [1, 2], "full_attn_layers": [3]},
  "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "intermediate_size": 12, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 6,
  "routed_expert_hidden_size": 8, "latent_moe_use_norm": true, "moe_router_activation_func": "sigmoid",
  "moe_renormalize": true, "routed_scaling_factor": 1.5, "num_expert_group": 1, "topk_group": 1,
  "attn_res_block_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false })";

// A micro Kimi Linear: softplus gate, low-rank output gate, plain MLA, SwiGLU, full-width MoE, residuals.
inline const char* kMicroKL = R"({
  "model_type": "kimi_linear", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 3,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": null, "kv_lora_rank": 6,
  "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "mla_use_nope": true,
  "linear_attn_config": {"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
                         "kda_layers": [1, 3], "full_attn_layers": [2]},
  "hidden_act": "silu", "intermediate_size": 12, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_experts": 5, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 6,
  "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 2.446,
  "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": false })";

inline ModelConfig parse(const char* text) { return ModelConfig::from_json(io::json::parse(text), "test config"); }

// Random weights like the goldens: non-zero AttnRes queries and router biases, gains near 1.
template <class F>
void randomise(ParamStore<F>& ps, uint64_t seed) {
  ps.init(seed);
  uint64_t s = seed * 1000;
  for (auto& p : ps.all()) {
    const std::string& n = p.spec.name;
    const int64_t N = p.value.numel();
    if (n.find(".A_log") != std::string::npos) {
      // exp(A_log) in [1, 2]: the gates stay out of saturation, where gradients drop below the
      // finite-difference noise floor (the goldens' U(1, 16) saturates the lower-bound gate).
      for (int64_t i = 0; i < N; ++i) p.w()[i] = static_cast<F>(std::log(1.0 + (i + 0.5) / N));
    } else if (n.find("_res_proj") != std::string::npos || n.find("e_score_correction_bias") != std::string::npos) {
      const auto r = randn<double>(N, ++s, n.find("bias") != std::string::npos ? 0.05 : 0.3);
      for (int64_t i = 0; i < N; ++i) p.w()[i] = static_cast<F>(r[i]);
    } else if (n.find("norm") != std::string::npos) {
      const auto r = randn<double>(N, ++s, 0.1);
      for (int64_t i = 0; i < N; ++i) p.w()[i] = static_cast<F>(1.0 + r[i]);
    }
  }
}

inline std::vector<int32_t> random_ids(int64_t n, int64_t V, uint64_t seed) {
  Rng r{seed, 3};
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>(r.bits(i).v[0] % V);
  return ids;
}

}  // namespace lm::testing::micro

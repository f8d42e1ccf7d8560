// The stack plan (model/stack.hpp) against the SPEC §6 wiring written out by hand, and the mixers' cache
// layouts (model/cache.hpp) against the config.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/json.hpp"
#include "model/model.hpp"
#include "model/stack.hpp"

using namespace lm;
using namespace lm::model;

namespace {

// Seven layers, KDA except layers 4 and 7 (1-based), MoE from layer 2, AttnRes blocks of 3.
ModelConfig config(bool attn_res) {
  io::json j = io::json::parse(R"({
    "model_type": "kimi_linear", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 7,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": null, "kv_lora_rank": 6,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "mla_use_nope": true,
    "linear_attn_config": {"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7]},
    "hidden_act": "silu", "intermediate_size": 12, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 6,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
    "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": false })");
  if (attn_res) j["attn_res_block_size"] = 3;
  return ModelConfig::from_json(j, "test config");
}

TEST(StackPlan, KindsAndSlots) {
  const StackPlan p = StackPlan::build(config(false));
  ASSERT_EQ(p.size(), 7);
  const std::vector<bool> kda = {true, true, true, false, true, true, false};
  const std::vector<int64_t> slot = {0, 1, 2, 0, 3, 4, 1}, moe_slot = {-1, 0, 1, 2, 3, 4, 5};
  for (int64_t i = 0; i < 7; ++i) {
    EXPECT_EQ(p[i].index, i);
    EXPECT_EQ(p[i].kda(), kda[i]) << i;
    EXPECT_EQ(p[i].mixer_slot, slot[i]) << i;
    EXPECT_EQ(p[i].moe(), i > 0) << i;
    EXPECT_EQ(p[i].moe_slot, moe_slot[i]) << i;
    EXPECT_FALSE(p[i].opens_block);
    EXPECT_EQ(p[i].attn_closed, 0);
  }
  EXPECT_EQ(p.num_kda(), 5);
  EXPECT_EQ(p.num_mla(), 2);
  EXPECT_EQ(p.num_moe(), 6);
  EXPECT_FALSE(p.attn_res);
  EXPECT_TRUE(p.block_reads.empty());
}

// SPEC §6 by hand: blocks of 3 close at layers 0, 3, 6; the mixer read sees the blocks closed before the
// layer, the FFN read also the one the layer closes; the output read sees all three.
TEST(StackPlan, AttnResBlocks) {
  const StackPlan p = StackPlan::build(config(true));
  ASSERT_TRUE(p.attn_res);
  const std::vector<int64_t> attn = {0, 1, 1, 1, 2, 2, 2}, mlp = {1, 1, 1, 2, 2, 2, 3}, block = {0, 0, 0, 1, 1, 1, 2};
  for (int64_t i = 0; i < 7; ++i) {
    EXPECT_EQ(p[i].opens_block, i % 3 == 0) << i;
    EXPECT_EQ(p[i].attn_closed, attn[i]) << i;
    EXPECT_EQ(p[i].mlp_closed, mlp[i]) << i;
    EXPECT_EQ(p[i].block, block[i]) << i;
  }
  EXPECT_EQ(p.out_closed, 3);
  // Read groups: every read in group b sees closed[0 : b + 1].
  ASSERT_EQ(p.block_reads.size(), 3u);
  auto str = [](const std::vector<ReadPlan>& g) {
    std::string s;
    for (const auto& r : g) {
      s.push_back(r.kind == ReadPlan::Attn ? 'a' : r.kind == ReadPlan::Mlp ? 'm' : 'o');
      s.append(std::to_string(r.layer)).push_back(' ');
    }
    return s;
  };
  EXPECT_EQ(str(p.block_reads[0]), "m0 a1 m1 a2 m2 ");
  EXPECT_EQ(str(p.block_reads[1]), "m3 a4 m4 a5 m5 ");
  EXPECT_EQ(str(p.block_reads[2]), "m6 o7 ");
  for (size_t b = 0; b < 3; ++b)
    for (const auto& r : p.block_reads[b]) {
      const int64_t closed = r.kind == ReadPlan::Out ? p.out_closed
                             : r.kind == ReadPlan::Attn ? p[r.layer].attn_closed
                                                        : p[r.layer].mlp_closed;
      EXPECT_EQ(closed, static_cast<int64_t>(b) + 1);
    }
}

TEST(StackPlan, CacheSpecsFromTheLayers) {
  const ModelConfig c = config(true);
  Model<float> m(c);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const CacheSpec s = m.cache_spec(i);
    if (m.plan()[i].kda()) {
      ASSERT_EQ(s.states.size(), 2u) << i;
      EXPECT_EQ(s.states[0].shape, (std::vector<int64_t>{2, 4, 4}));
      EXPECT_EQ(s.states[1].shape, (std::vector<int64_t>{3, 8, 3}));
      EXPECT_EQ(s.row_width, 0);
    } else {
      EXPECT_TRUE(s.states.empty()) << i;
      EXPECT_EQ(s.row_width, c.mla_cache_dim());
      EXPECT_EQ(s.row_dtype, DType::BF16);
    }
    const LayerCache<float> lc = LayerCache<float>::empty(s);
    EXPECT_EQ(lc.tokens(), 0);
    EXPECT_EQ(lc.size(), m.plan()[i].kda() ? 2 * 4 * 4 + 3 * 8 * 3 : 0);
  }
}

}  // namespace

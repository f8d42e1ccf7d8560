// ModelConfig: parsing every published and golden config, strict errors, aliases, nesting, round trip.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "io/json.hpp"
#include "model/config.hpp"
#include "testing.hpp"

namespace {

using lm::io::json;
using lm::model::ModelConfig;
namespace fs = std::filesystem;

std::string shared_dir() {
  // golden_dir() is <shared>/golden; the published configs are in <shared>/configs.
  const std::string g = lm::testing::golden_dir();
  return g.empty() ? std::string() : fs::path(g).parent_path().string();
}

#define REQUIRE_SHARED(dir)                        \
  const std::string dir = shared_dir();            \
  if (dir.empty() || !fs::exists(dir + "/configs")) GTEST_SKIP() << "shared/configs not found"

json read(const std::string& path) { return lm::io::load_json_file(path); }

// Expects from_json to throw lm::Error whose message contains every one of `needles`.
void expect_error(const json& j, std::initializer_list<std::string> needles) {
  try {
    (void)ModelConfig::from_json(j, "cfg.json");
    ADD_FAILURE() << "no error for " << j.dump();
  } catch (const lm::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

TEST(Config, ParsesK3) {
  REQUIRE_SHARED(dir);
  const ModelConfig c = ModelConfig::load(dir + "/configs/kimi-k3.json");
  EXPECT_EQ(c.num_hidden_layers, 93);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_kda_layers(), 69);
  EXPECT_EQ(c.num_mla_layers(), 24);
  // MLA at 1-based 4, 8, ..., 92 and 93 -> 0-based 3, 7, ..., 91, 92.
  for (int64_t i = 0; i < 93; ++i) EXPECT_EQ(c.is_mla(i), (i + 1) % 4 == 0 || i == 92) << i;
  EXPECT_FALSE(c.is_moe(0));
  for (int64_t i = 1; i < 93; ++i) EXPECT_TRUE(c.is_moe(i));
  EXPECT_EQ(c.num_moe_layers(), 92);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.mla_cache_dim(), 576);
  EXPECT_EQ(c.mla_qk_head_dim(), 192);
  EXPECT_TRUE(c.mla_use_output_gate);
  EXPECT_TRUE(c.kda_full_rank_gate);
  ASSERT_TRUE(c.kda_gate_lower_bound.has_value());
  EXPECT_EQ(*c.kda_gate_lower_bound, -5.0);
  EXPECT_TRUE(c.is_situ());
  EXPECT_EQ(c.activation_situ_beta, 4.0);
  EXPECT_EQ(c.activation_situ_linear_beta, 25.0);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.num_experts_per_token, 16);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.expert_width(), 3584);
  EXPECT_EQ(c.shared_intermediate_size(), 6144);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_EQ(c.attn_res_max_sources(), 9);  // 8 closed blocks (block 0 = embedding) + the partial block
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
}

TEST(Config, ParsesKimiLinear) {
  REQUIRE_SHARED(dir);
  const ModelConfig c = ModelConfig::load(dir + "/configs/kimi-linear-48b-a3b.json");
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.num_mla_layers(), 7);
  EXPECT_TRUE(c.is_mla(26));
  EXPECT_FALSE(c.has_q_lora());
  EXPECT_FALSE(c.mla_use_output_gate);
  EXPECT_FALSE(c.kda_full_rank_gate);
  EXPECT_FALSE(c.kda_bounded_gate());
  EXPECT_FALSE(c.is_situ());
  EXPECT_FALSE(c.has_latent_moe());
  EXPECT_EQ(c.expert_width(), 2304);
  EXPECT_FALSE(c.has_attn_res());
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
}

TEST(Config, ParsesGoldenConfigs) {
  LM_REQUIRE_GOLDEN(g);
  {
    const ModelConfig c = ModelConfig::load(g + "/model/k3-tiny");  // a folder works too
    EXPECT_EQ(c.num_hidden_layers, 8);
    EXPECT_TRUE(c.is_mla(3));
    EXPECT_TRUE(c.is_mla(7));
    EXPECT_TRUE(c.is_kda(0));
    EXPECT_EQ(c.q_lora_rank, 64);
    EXPECT_EQ(c.attn_res_block_size, 3);
    EXPECT_EQ(c.expert_width(), 64);
    EXPECT_EQ(c.torch_dtype, "float32");
    EXPECT_TRUE(c.pad_token_id.is_null());
  }
  {
    const ModelConfig c = ModelConfig::load(g + "/model/kimi-linear-tiny/config.json");
    EXPECT_EQ(c.num_hidden_layers, 6);
    EXPECT_TRUE(c.is_mla(3));
    EXPECT_TRUE(c.is_mla(5));
    EXPECT_FALSE(c.has_q_lora());
    EXPECT_FALSE(c.mla_use_output_gate);
    EXPECT_EQ(c.num_shared_experts, 1);
  }
}

std::vector<std::string> all_config_paths() {
  std::vector<std::string> r;
  const std::string s = shared_dir();
  if (s.empty()) return r;
  for (const char* p : {"/configs/kimi-k3.json", "/configs/kimi-linear-48b-a3b.json", "/golden/model/k3-tiny/config.json",
                        "/golden/model/kimi-linear-tiny/config.json"})
    if (fs::exists(s + p)) r.push_back(s + p);
  return r;
}

TEST(Config, RoundTripToJson) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  for (const auto& p : paths) {
    SCOPED_TRACE(p);
    const ModelConfig c = ModelConfig::load(p);
    const json out = c.to_json();
    const ModelConfig back = ModelConfig::from_json(json::parse(out.dump()), "roundtrip");
    EXPECT_TRUE(back == c);
    EXPECT_EQ(back.to_json(), out);
    // Every field of the original file that carries meaning survives with its value.
    const json orig = read(p);
    for (auto it = orig.begin(); it != orig.end(); ++it) {
      if (it.value().is_null()) continue;  // null == absent
      if (it.key() == "attention_dropout") continue;  // ignored (checked to be 0)
      ASSERT_TRUE(out.contains(it.key())) << it.key();
      if (it.key() == "linear_attn_config") {
        for (auto f = it.value().begin(); f != it.value().end(); ++f)
          EXPECT_EQ(out.at(it.key()).at(f.key()), f.value()) << f.key();
        continue;
      }
      EXPECT_EQ(out.at(it.key()), it.value()) << it.key();
    }
  }
}

TEST(Config, SaveWritesAtomicallyAndReloads) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const fs::path dir = fs::temp_directory_path() / ("lm_cfg_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const ModelConfig c = ModelConfig::load(paths[0]);
  c.save((dir / "config.json").string());
  EXPECT_TRUE(ModelConfig::load(dir.string()) == c);
  fs::remove_all(dir);
}

TEST(Config, TextConfigNesting) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  for (const auto& p : paths) {
    const json flat = read(p);
    json inner = flat;
    inner.erase("architectures");
    json nested = {{"architectures", {"KimiK3ForConditionalGeneration"}},
                   {"model_type", "kimi_k3"},
                   {"vision_config", json::object()},
                   {"torch_dtype", "bfloat16"},
                   {"text_config", inner}};
    const ModelConfig a = ModelConfig::from_json(flat, p);
    ModelConfig b = ModelConfig::from_json(nested, p);
    if (!a.torch_dtype) {
      EXPECT_EQ(b.torch_dtype, "bfloat16");
    }
    b.torch_dtype = a.torch_dtype;
    EXPECT_TRUE(a == b) << p;
  }
  // Errors inside text_config name the nested field.
  json nested = {{"text_config", read(paths[0])}};
  nested["text_config"]["hidden_size"] = "big";
  expect_error(nested, {"text_config.hidden_size", "integer"});
  nested = {{"text_config", read(paths[0])}, {"bogus", 1}};
  expect_error(nested, {"unknown field 'bogus'"});
}

TEST(Config, HfAliases) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const json base = read(paths[0]);
  json j = base;
  const std::pair<const char*, const char*> aliases[] = {{"num_experts", "num_local_experts"},
                                                         {"num_experts_per_token", "num_experts_per_tok"},
                                                         {"num_shared_experts", "n_shared_experts"},
                                                         {"moe_renormalize", "norm_topk_prob"},
                                                         {"num_expert_group", "n_group"}};
  for (auto [canon, alias] : aliases) {
    j[alias] = j[canon];
    j.erase(canon);
  }
  EXPECT_TRUE(ModelConfig::from_json(j, "aliases") == ModelConfig::from_json(base, "base"));
  // Both names given and equal: fine; different: an error naming both.
  j = base;
  j["num_local_experts"] = j["num_experts"];
  EXPECT_NO_THROW((void)ModelConfig::from_json(j, "x"));
  j["num_local_experts"] = 7;
  expect_error(j, {"num_experts", "num_local_experts", "disagree"});
  j = base;
  j["n_group"] = 2;
  j.erase("num_expert_group");
  expect_error(j, {"n_group", "must be 1"});
  // HF 5's derived linear_* copies must agree with linear_attn_config.
  j = base;
  j["linear_num_heads"] = j["linear_attn_config"]["num_heads"];
  EXPECT_NO_THROW((void)ModelConfig::from_json(j, "x"));
  j["linear_head_dim"] = 3;
  expect_error(j, {"linear_head_dim", "linear_attn_config.head_dim"});
}

TEST(Config, OptionalFieldDefaults) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  json j = read(paths[0]);  // K3
  for (const char* k : {"activation_situ_linear_beta", "routed_expert_hidden_size", "attn_res_block_size",
                        "mla_use_output_gate", "q_lora_rank", "rms_norm_eps", "num_key_value_heads",
                        "moe_layer_freq", "latent_moe_use_norm"})
    j.erase(k);
  j["linear_attn_config"].erase("gate_lower_bound");
  j["linear_attn_config"].erase("use_full_rank_gate");
  j["linear_attn_config"].erase("short_conv_kernel_size");
  const ModelConfig c = ModelConfig::from_json(j, "defaults");
  EXPECT_FALSE(c.activation_situ_linear_beta.has_value());
  EXPECT_FALSE(c.has_latent_moe());
  EXPECT_FALSE(c.has_attn_res());
  EXPECT_FALSE(c.mla_use_output_gate);
  EXPECT_FALSE(c.has_q_lora());
  EXPECT_FALSE(c.kda_bounded_gate());
  EXPECT_FALSE(c.kda_full_rank_gate);
  EXPECT_EQ(c.kda_conv_kernel, 4);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);  // HF KimiLinearConfig default
  EXPECT_EQ(c.num_key_value_heads, c.num_attention_heads);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_TRUE(c.latent_moe_use_norm);
  // q_lora_rank null is the same as absent.
  j["q_lora_rank"] = nullptr;
  EXPECT_FALSE(ModelConfig::from_json(j, "x").has_q_lora());
  // No MoE at all: every layer dense.
  json d = read(paths[0]);
  for (const char* k : {"num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
                        "routed_expert_hidden_size"})
    d.erase(k);
  const ModelConfig dense = ModelConfig::from_json(d, "dense");
  EXPECT_EQ(dense.num_moe_layers(), 0);
  EXPECT_TRUE(ModelConfig::from_json(dense.to_json(), "x") == dense);
}

TEST(Config, MoeLayerFreq) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  json j = read(paths[0]);
  j["moe_layer_freq"] = 2;
  j["first_k_dense_replace"] = 3;
  const ModelConfig c = ModelConfig::from_json(j, "x");
  EXPECT_FALSE(c.is_moe(0));
  EXPECT_FALSE(c.is_moe(2));
  EXPECT_FALSE(c.is_moe(3));  // 3 % 2 != 0
  EXPECT_TRUE(c.is_moe(4));
  EXPECT_FALSE(c.is_moe(5));
  EXPECT_TRUE(c.is_dense_ffn(5));
}

TEST(Config, TruncatedJsonNamesTheFile) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const std::string text = read(paths[0]).dump(2);
  const fs::path p = fs::temp_directory_path() / ("lm_trunc_" + std::to_string(::getpid()) + ".json");
  {
    std::ofstream o(p);
    o << text.substr(0, text.size() / 2);
  }
  try {
    (void)ModelConfig::load(p.string());
    ADD_FAILURE() << "truncated config accepted";
  } catch (const lm::Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  fs::remove(p);
  EXPECT_THROW((void)ModelConfig::load("/nonexistent/dir/config.json"), lm::Error);
}

TEST(Config, MalformedFieldsNameTheField) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const json base = read(paths[0]);  // K3
  auto with = [&](const std::string& key, const json& v) {
    json j = base;
    j[key] = v;
    return j;
  };
  auto without = [&](const std::string& key) {
    json j = base;
    j.erase(key);
    return j;
  };
  auto la = [&](const std::string& key, const json& v) {
    json j = base;
    j["linear_attn_config"][key] = v;
    return j;
  };
  // wrong types
  expect_error(with("hidden_size", "7168"), {"'hidden_size'", "integer", "string"});
  expect_error(with("hidden_size", 7168.5), {"'hidden_size'", "integer"});
  expect_error(with("hidden_size", true), {"'hidden_size'", "integer"});
  expect_error(with("rms_norm_eps", "1e-5"), {"'rms_norm_eps'", "number"});
  expect_error(with("mla_use_output_gate", 1), {"'mla_use_output_gate'", "true or false"});
  expect_error(with("hidden_act", 3), {"'hidden_act'", "string"});
  expect_error(with("linear_attn_config", json::array()), {"'linear_attn_config'", "object"});
  expect_error(la("kda_layers", "1,2,3"), {"'linear_attn_config.kda_layers'", "list"});
  expect_error(la("kda_layers", json::array({1, "2"})), {"'linear_attn_config.kda_layers'", "entry 1"});
  expect_error(with("eos_token_id", "x"), {"'eos_token_id'"});
  expect_error(with("num_experts", 18446744073709551615ull), {"'num_experts'", "out of range"});
  expect_error(with("vocab_size", -5), {"'vocab_size'", "out of range"});
  // missing required
  expect_error(without("vocab_size"), {"missing required field 'vocab_size'"});
  expect_error(without("model_type"), {"missing required field 'model_type'"});
  expect_error(without("linear_attn_config"), {"missing required field 'linear_attn_config'"});
  expect_error(without("mla_use_nope"), {"'mla_use_nope'"});
  expect_error(without("num_experts_per_token"), {"num_experts_per_token"});
  expect_error(without("activation_situ_beta"), {"activation_situ_beta"});
  expect_error(with("hidden_size", nullptr), {"missing required field 'hidden_size'"});
  // unknown fields, with a suggestion for typos
  expect_error(with("hiden_size", 7168), {"unknown field 'hiden_size'", "did you mean 'hidden_size'"});
  expect_error(with("quantization_config", json::object()), {"quantization_config", "not supported"});
  expect_error(la("num_head", 96), {"unknown field 'linear_attn_config.num_head'"});
  // inconsistent or unsupported values
  expect_error(with("model_type", "deepseek_v3"), {"'model_type'", "kimi_linear"});
  expect_error(with("tie_word_embeddings", true), {"'tie_word_embeddings'", "false"});
  expect_error(with("num_nextn_predict_layers", 1), {"'num_nextn_predict_layers'"});
  expect_error(with("num_expert_group", 8), {"'num_expert_group'", "must be 1"});
  expect_error(with("topk_group", 4), {"'topk_group'"});
  expect_error(with("moe_router_activation_func", "softmax"), {"'moe_router_activation_func'", "sigmoid"});
  expect_error(with("hidden_act", "gelu"), {"'hidden_act'", "silu", "situ"});
  expect_error(with("num_experts_per_token", 897), {"'num_experts_per_token'", "896"});
  expect_error(with("num_key_value_heads", 8), {"'num_key_value_heads'"});
  expect_error(with("mla_use_nope", false), {"'mla_use_nope'"});
  expect_error(with("rms_norm_eps", 0), {"'rms_norm_eps'"});
  expect_error(with("attention_dropout", 0.1), {"'attention_dropout'"});
  expect_error(la("gate_lower_bound", 5.0), {"'linear_attn_config.gate_lower_bound'", "negative"});
  expect_error(with("first_k_dense_replace", 94), {"'first_k_dense_replace'"});
  json j = without("intermediate_size");
  expect_error(j, {"'intermediate_size'", "dense"});
  // layer lists must partition 1..L
  {
    json k = base;
    auto& kda = k["linear_attn_config"]["kda_layers"];
    kda.push_back(4);  // 4 is also a full-attention layer
    expect_error(k, {"layer 4", "both"});
  }
  {
    json k = base;
    k["linear_attn_config"]["kda_layers"].erase(0);  // layer 1 in neither
    expect_error(k, {"layer 1", "neither"});
  }
  {
    json k = base;
    k["linear_attn_config"]["full_attn_layers"].push_back(94);
    expect_error(k, {"full_attn_layers", "94", "1-based"});
  }
  {
    json k = base;
    k["linear_attn_config"]["full_attn_layers"] = json::array({0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56,
                                                               60, 64, 68, 72, 76, 80, 84, 88, 92});
    expect_error(k, {"full_attn_layers", "layer 0", "1-based"});
  }
  {
    json k = base;
    k["linear_attn_config"]["kda_layers"].push_back(1);
    expect_error(k, {"kda_layers", "twice"});
  }
  // not an object at all
  expect_error(json::array(), {"JSON object"});
  expect_error(json(nullptr), {"JSON object"});
  expect_error(json(3), {"JSON object"});
}

// Any single-field corruption either parses or throws lm::Error: never another exception type.
TEST(Config, MutationsThrowOnlyLmError) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const std::vector<json> values = {nullptr, true, false, "x", -1, 0, 1, 3, 1e300, -1e300, 0.5,
                                    json::array(), json::array({1, 2}), json::object(),
                                    json(18446744073709551615ull), json(-9223372036854775807LL - 1)};
  int parsed = 0, rejected = 0;
  auto attempt = [&](const json& j, const std::string& what) {
    try {
      (void)ModelConfig::from_json(j, "mut");
      ++parsed;
    } catch (const lm::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-lm::Error for " << what << ": " << e.what();
    }
  };
  for (const auto& p : paths) {
    const json base = read(p);
    for (auto it = base.begin(); it != base.end(); ++it)
      for (const auto& v : values) {
        json j = base;
        j[it.key()] = v;
        attempt(j, it.key() + " = " + v.dump());
        j = base;
        j.erase(it.key());
        attempt(j, "without " + it.key());
      }
    const json& la = base["linear_attn_config"];
    for (auto it = la.begin(); it != la.end(); ++it)
      for (const auto& v : values) {
        json j = base;
        j["linear_attn_config"][it.key()] = v;
        attempt(j, "linear_attn_config." + it.key() + " = " + v.dump());
      }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(parsed, 0);
}

TEST(Config, KnownFieldListsCoverTheConfigs) {
  const auto paths = all_config_paths();
  if (paths.empty()) GTEST_SKIP() << "configs not found";
  const auto& known = lm::model::known_config_fields();
  for (const auto& p : paths) {
    const json j = read(p);
    for (auto it = j.begin(); it != j.end(); ++it)
      EXPECT_NE(std::find(known.begin(), known.end(), it.key()), known.end()) << it.key();
  }
}

}  // namespace

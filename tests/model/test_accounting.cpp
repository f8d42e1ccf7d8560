// Parameter naming against the golden checkpoints, and the published parameter / memory figures.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include "core/error.hpp"
#include "io/safetensors.hpp"
#include "model/accounting.hpp"
#include "model/config.hpp"
#include "model/param_names.hpp"
#include "model/stack.hpp"
#include "testing.hpp"

namespace {

using namespace lm::model;
namespace fs = std::filesystem;

std::string configs_dir() {
  const std::string g = lm::testing::golden_dir();
  if (g.empty()) return "";
  const std::string d = (fs::path(g).parent_path() / "configs").string();
  return fs::exists(d) ? d : "";
}

#define REQUIRE_CONFIGS(dir) \
  const std::string dir = configs_dir(); \
  if (dir.empty()) GTEST_SKIP() << "shared/configs not found"

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// ---- tensor names and shapes ------------------------------------------------------------------

void check_golden_names(const std::string& case_dir) {
  const ModelConfig c = ModelConfig::load(case_dir);
  const auto st = lm::io::SafeTensorsFile::open(case_dir + "/model.safetensors");
  std::map<std::string, lm::Shape> expected;
  for (const auto& t : st.tensors()) expected[t.name] = t.shape;
  std::map<std::string, lm::Shape> generated;
  for (const auto& p : param_specs(c)) {
    EXPECT_TRUE(generated.emplace(p.name, p.shape).second) << "duplicate name " << p.name;
  }
  for (const auto& [n, s] : expected) {
    auto it = generated.find(n);
    if (it == generated.end()) {
      ADD_FAILURE() << "checkpoint tensor not generated: " << n;
    } else {
      EXPECT_EQ(lm::shape_str(it->second), lm::shape_str(s)) << n;
    }
  }
  for (const auto& [n, s] : generated) EXPECT_TRUE(expected.count(n)) << "generated tensor not in checkpoint: " << n;
  EXPECT_EQ(expected.size(), generated.size());
}

TEST(ParamNames, MatchGoldenK3Tiny) {
  LM_REQUIRE_GOLDEN(g);
  check_golden_names(g + "/model/k3-tiny");
}

TEST(ParamNames, MatchGoldenKimiLinearTiny) {
  LM_REQUIRE_GOLDEN(g);
  check_golden_names(g + "/model/kimi-linear-tiny");
}

TEST(ParamNames, ComponentsAndFlags) {
  LM_REQUIRE_GOLDEN(g);
  const ModelConfig c = ModelConfig::load(g + "/model/k3-tiny");
  std::map<std::string, ParamSpec> by_name;
  for (const auto& p : param_specs(c)) by_name[p.name] = p;
  auto comp = [&](const std::string& n) { return by_name.at(n).component; };
  EXPECT_EQ(comp("model.embed_tokens.weight"), Component::Embedding);
  EXPECT_EQ(comp("lm_head.weight"), Component::LmHead);
  EXPECT_EQ(comp("model.layers.0.self_attn.A_log"), Component::Kda);
  EXPECT_EQ(comp("model.layers.3.self_attn.kv_b_proj.weight"), Component::Mla);
  EXPECT_EQ(comp("model.layers.0.mlp.up_proj.weight"), Component::DenseFfn);
  EXPECT_EQ(comp("model.layers.1.block_sparse_moe.gate.weight"), Component::Router);
  EXPECT_EQ(comp("model.layers.1.block_sparse_moe.experts.15.w2.weight"), Component::RoutedExpert);
  EXPECT_EQ(by_name.at("model.layers.1.block_sparse_moe.experts.15.w2.weight").expert, 15);
  EXPECT_EQ(comp("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"), Component::SharedExpert);
  EXPECT_EQ(comp("model.layers.1.block_sparse_moe.routed_expert_norm.weight"), Component::LatentProj);
  EXPECT_EQ(comp("model.layers.1.input_layernorm.weight"), Component::Norm);
  EXPECT_EQ(comp("model.norm.weight"), Component::Norm);
  EXPECT_EQ(comp("model.output_attn_res_proj.weight"), Component::AttnRes);
  EXPECT_EQ(comp("model.layers.5.mlp_res_norm.weight"), Component::AttnRes);
  EXPECT_FALSE(by_name.at("model.layers.1.block_sparse_moe.gate.e_score_correction_bias").trainable);
  EXPECT_TRUE(by_name.at("model.layers.1.block_sparse_moe.gate.weight").trainable);
  EXPECT_EQ(by_name.at("model.layers.6.self_attn.q_proj.weight").layer, 6);
  EXPECT_EQ(by_name.at("lm_head.weight").layer, -1);
  EXPECT_EQ(component_name(Component::RoutedExpert), "routed_expert");
}

// ---- published figures (SPEC §8) ------------------------------------------------------------

TEST(Accounting, K3Params) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-k3.json");
  const ParamCounts pc = count_params(c);
  EXPECT_NEAR(static_cast<double>(pc.total) / 1e9, 2779.5, 0.05);       // published 2.78T
  EXPECT_NEAR(static_cast<double>(pc.activated) / 1e9, 104.19, 0.005);  // published 104.2B
  // Pieces, by hand from SPEC: 92 MoE layers x 896 experts x 3 x 3584 x 3072.
  EXPECT_EQ(pc[Component::RoutedExpert].total, int64_t{92} * 896 * 3 * 3584 * 3072);
  EXPECT_EQ(pc[Component::RoutedExpert].activated, int64_t{92} * 16 * 3 * 3584 * 3072);
  EXPECT_EQ(pc[Component::Embedding].total, int64_t{163840} * 7168);
  EXPECT_EQ(pc[Component::Embedding].activated, 0);
  EXPECT_EQ(pc[Component::LmHead].activated, int64_t{163840} * 7168);
  EXPECT_EQ(pc[Component::SharedExpert].total, int64_t{92} * 3 * 7168 * 6144);
  EXPECT_EQ(pc[Component::DenseFfn].total, int64_t{3} * 7168 * 33792);
  EXPECT_EQ(pc[Component::LatentProj].total, int64_t{92} * (2 * 7168 * 3584 + 3584));
  EXPECT_EQ(pc.total - pc.trainable, int64_t{92} * 896);  // the QB biases
  int64_t sum = 0, act = 0;
  for (const auto& cc : pc.by_component) sum += cc.total, act += cc.activated;
  EXPECT_EQ(sum, pc.total);
  EXPECT_EQ(act, pc.activated);
}

TEST(Accounting, KimiLinearParams) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-linear-48b-a3b.json");
  const ParamCounts pc = count_params(c);
  EXPECT_NEAR(static_cast<double>(pc.total) / 49.12e9, 1.0, 1e-3);
  EXPECT_NEAR(static_cast<double>(pc.activated) / 1e9, 3.1, 0.05);
  EXPECT_EQ(pc[Component::LatentProj].total, 0);
  EXPECT_EQ(pc[Component::AttnRes].total, 0);
}

// GPU inference memory and decode traffic of the 48B shape (model::inference_memory, decode_traffic): the parts
// that follow from the tensor list exactly, and the limits of the expert term. (The H200 run of
// `bench decode --device cuda` prints the measured memory beside the prediction.)
TEST(Accounting, InferenceMemoryAndDecodeTraffic) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-linear-48b-a3b.json");
  const ParamCounts pc = count_params(c);
  const InferenceMemory m = inference_memory(c, 1048576, 1);
  EXPECT_EQ(m.mla_cache, 7.0 * 576 * 2 * 1048576);  // 7 MLA layers of bf16 [R | k_r] rows
  EXPECT_EQ(m.kda_caches, 20.0 * 4 * (32 * 128 * 128 + 3 * 4096 * 3));
  EXPECT_GE(m.weights, 2.0 * double(pc.total));
  EXPECT_LT(m.weights, 2.0 * double(pc.total) + 4.0 * 1e7);  // + the small fp32 tensors
  EXPECT_EQ(inference_memory(c, 1000, 4, 16384, 64 * 100).mla_cache, 7.0 * 576 * 2 * 64 * 100);  // a shared pool
  EXPECT_THROW(inference_memory(c, 0, 1), lm::Error);
  const double routed = double(pc[Component::RoutedExpert].total);
  const DecodeTraffic one = decode_traffic(c, 8192, 1), many = decode_traffic(c, 8192, 4096);
  EXPECT_NEAR(one.experts, 2.0 * routed * 8 / 256, 1.0);  // batch 1: its k experts per layer
  EXPECT_NEAR(many.experts / (2.0 * routed), 1.0, 1e-6);  // a large batch reads every expert
  EXPECT_EQ(one.mla_cache, 7.0 * 576 * 2 * 8192);
  EXPECT_EQ(many.weights - one.weights, 2.0 * 4095 * 2304);  // only the embedding rows grow with the batch
}

// The GPU training plan (model::gpu_training_plan) on the repository's k3-1b: everything keeps while it fits; at a
// longer sequence the MLA layers are the first kept; the predicted total only grows with the kept layers and the
// tokens and stays within the device; a length that cannot fit even recomputing everything is an error naming it.
TEST(Accounting, GpuTrainingPlan) {
  const ModelConfig c = ModelConfig::load(std::string(LONGMOE_SOURCE_DIR) + "/configs/k3-1b.json");
  const double dev = 0.97 * 139.8 * 1073741824.0;
  const int64_t L = c.num_hidden_layers;
  const GpuTrainingMemory small = gpu_training_plan(c, 16384, dev);
  EXPECT_EQ(small.kept_layers, L);
  EXPECT_EQ(small.total(), gpu_training_memory(c, 16384, std::vector<bool>(size_t(L), true)).total());
  const GpuTrainingMemory mid = gpu_training_plan(c, 131072, dev);
  EXPECT_GT(mid.kept_layers, 0);
  EXPECT_LT(mid.kept_layers, L);
  EXPECT_LE(mid.total(), dev);
  for (int64_t i = 0; i < L; ++i) {
    if (c.is_kda(i)) continue;
    EXPECT_TRUE(mid.keep[size_t(i)]) << "MLA layer " << i << " is recomputed first";
  }
  std::vector<bool> keep(size_t(L), false);
  double last = gpu_training_memory(c, 131072, keep).total();
  for (int64_t i = 0; i < L; ++i) {
    keep[size_t(i)] = true;
    const double t = gpu_training_memory(c, 131072, keep).total();
    EXPECT_GT(t, last) << "keeping layer " << i;
    last = t;
  }
  EXPECT_GT(gpu_training_memory(c, 131072, keep).total(), gpu_training_memory(c, 65536, keep).total());
  try {
    gpu_training_plan(c, 1048576, dev);
    ADD_FAILURE() << "1M tokens of k3-1b fitted one device";
  } catch (const lm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1048576 tokens"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpu_training_memory(c, 4096, std::vector<bool>(3, true)), lm::Error);
}

// Offload in the plan: k3-1b's transient input states are those of the layers that open no AttnRes block (12 of
// 16); offloaded, they take two device states instead of twelve and wait in host memory. At 262,144 tokens the plan
// fits only with them on the host, and only when the host can pin them; a plan that fits the device keeps them there.
TEST(Accounting, GpuTrainingPlanOffloadsStates) {
  const ModelConfig c = ModelConfig::load(std::string(LONGMOE_SOURCE_DIR) + "/configs/k3-1b.json");
  const double dev = 0.97 * 139.8 * 1073741824.0, G = 1073741824.0;
  const int64_t L = c.num_hidden_layers, n = 262144;
  const std::vector<bool> t = gpu_transient_states(c);
  const StackPlan sp = StackPlan::build(c);
  int64_t transient = 0;
  for (int64_t i = 0; i < L; ++i) {
    EXPECT_EQ(t[size_t(i)], i > 0 && !sp[i].opens_block) << "layer " << i;
    transient += t[size_t(i)];
  }
  EXPECT_EQ(transient, 12);
  const std::vector<bool> none(size_t(L), false);
  const GpuTrainingMemory on = gpu_training_memory(c, n, none, true), off = gpu_training_memory(c, n, none, false);
  const double state = double(n) * 4 * double(c.hidden_size);
  EXPECT_DOUBLE_EQ(on.host, double(transient) * state);
  EXPECT_DOUBLE_EQ(off.states - on.states, double(transient - 2) * state);
  EXPECT_EQ(off.host, 0.0);
  EXPECT_EQ(gpu_training_plan(c, 16384, dev, 64 * G).offload, false);
  const GpuTrainingMemory p = gpu_training_plan(c, n, dev, 64 * G);
  EXPECT_TRUE(p.offload);
  EXPECT_LE(p.total(), dev);
  try {
    gpu_training_plan(c, n, dev, 8 * G);
    ADD_FAILURE() << "262K tokens of k3-1b fitted without offload";
  } catch (const lm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("would not fit the 8.0 GiB of pinned host memory"), std::string::npos)
        << e.what();
  }
}

// Communication per GPU and step (model::training_traffic): nothing on one GPU; data parallel with ZeRO-1 moves
// 6 bytes per held parameter around the ring (fp32 gradients reduce-scattered, bf16 weights gathered), without it
// 8 (an fp32 all-reduce); expert and context parallel add their own terms; cp splits activations and must divide
// the sequence.
TEST(Accounting, TrainingTraffic) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-linear-48b-a3b.json");
  ParallelPlan one;
  EXPECT_EQ(training_traffic(c, one).total(), 0.0);
  ParallelPlan dp = one;
  dp.dp = 8;
  const TrainingMemory m = training_memory(c, dp);
  const double held = m.dense_params + m.expert_params;
  EXPECT_NEAR(training_traffic(c, dp).dp / (6.0 * held * 7 / 8), 1.0, 1e-12);
  dp.zero1 = false;
  EXPECT_NEAR(training_traffic(c, dp).dp / (8.0 * held * 7 / 8), 1.0, 1e-12);
  ParallelPlan ep = one;
  ep.dp = 8, ep.ep = 8;
  EXPECT_GT(training_traffic(c, ep).ep, 0.0);
  ParallelPlan cp = one;
  cp.cp = 4;
  const TrainingTraffic t = training_traffic(c, cp);
  EXPECT_GT(t.cp, 0.0);
  EXPECT_EQ(t.ep, 0.0);
  EXPECT_NEAR(training_memory(c, cp).activation_bytes * 4 / training_memory(c, one).activation_bytes, 1.0, 1e-12);
  cp.seq_len = 8190;
  EXPECT_THROW(training_traffic(c, cp), lm::Error);
}

TEST(Accounting, CountsEqualTheTensorList) {
  REQUIRE_CONFIGS(dir);
  for (const char* f : {"/kimi-k3.json", "/kimi-linear-48b-a3b.json"}) {
    const ModelConfig c = ModelConfig::load(dir + f);
    int64_t n = 0, layers = 0;
    for_each_param(c, [&](const ParamSpec& p) { n += p.numel(); });
    const ParamCounts pc = count_params(c);
    EXPECT_EQ(n, pc.total) << f;
    for (int64_t t : pc.layer_total) layers += t;
    EXPECT_EQ(layers + pc.embedding + pc.head, pc.total) << f;
  }
}

TEST(Accounting, GoldenCountsEqualCheckpoint) {
  LM_REQUIRE_GOLDEN(g);
  for (const char* m : {"/model/k3-tiny", "/model/kimi-linear-tiny"}) {
    const ModelConfig c = ModelConfig::load(g + m);
    const auto st = lm::io::SafeTensorsFile::open(g + m + "/model.safetensors");
    int64_t n = 0;
    for (const auto& t : st.tensors()) n += lm::shape_numel(t.shape);
    EXPECT_EQ(count_params(c).total, n) << m;
  }
}

TEST(Accounting, K3DecodeMemoryAt1M) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-k3.json");
  const DecodeMemory m = decode_memory(c, 1 << 20);
  EXPECT_EQ(m.mla_bytes_per_token, 576 * 2 * 24);
  EXPECT_NEAR(static_cast<double>(m.mla_bytes_per_seq) / kGiB, 27.0, 0.05);
  EXPECT_EQ(m.kda_state_bytes_per_seq, int64_t{96} * 128 * 128 * 4 * 69);
  EXPECT_NEAR(static_cast<double>(m.kda_state_bytes_per_seq) / kMiB, 414.0, 0.5);
  EXPECT_EQ(m.conv_state_bytes_per_seq, int64_t{3} * 96 * 128 * 3 * 2 * 69);
  EXPECT_EQ(m.total_bytes_per_seq, m.mla_bytes_per_seq + m.kda_state_bytes_per_seq + m.conv_state_bytes_per_seq);
  EXPECT_EQ(m.weight_bytes, 2 * count_params(c).total);
}

TEST(Accounting, Flops) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-k3.json");
  const ParamCounts pc = count_params(c);
  const FlopsPerToken f = flops_per_token(c, 8192, 1 << 20);
  EXPECT_DOUBLE_EQ(f.matmul_fwd, 2.0 * static_cast<double>(pc.activated_matmul));
  // Matmul weights are the activated parameters minus vectors (norms, convs, A_log, dt_bias, biases).
  EXPECT_LT(pc.activated_matmul, pc.activated);
  EXPECT_GT(static_cast<double>(pc.activated_matmul), 0.999 * static_cast<double>(pc.activated));
  EXPECT_DOUBLE_EQ(f.mla_attn_fwd_train, 24.0 * 2 * 96 * (192 + 128) * (8192 + 1) / 2.0);
  EXPECT_DOUBLE_EQ(f.kda_attn_fwd, 69.0 * 96 * (6.0 * 128 * 128 + 3.0 * 64 * 128 + 64.0 * 64));
  EXPECT_DOUBLE_EQ(f.train, 3 * (f.matmul_fwd + f.mla_attn_fwd_train + f.kda_attn_fwd));
  EXPECT_GT(f.decode, f.matmul_fwd);
  // Longer training sequences cost more attention per token; KDA does not depend on length.
  const FlopsPerToken g = flops_per_token(c, 65536, 1 << 20);
  EXPECT_GT(g.mla_attn_fwd_train, f.mla_attn_fwd_train);
  EXPECT_EQ(g.kda_attn_fwd, f.kda_attn_fwd);
}

TEST(Accounting, TrainingMemorySingleDevice) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-linear-48b-a3b.json");
  const ParamCounts pc = count_params(c);
  ParallelPlan p;  // 1 device
  const TrainingMemory m = training_memory(c, p);
  const double n = static_cast<double>(pc.total);
  EXPECT_DOUBLE_EQ(m.dense_params + m.expert_params, n);
  EXPECT_DOUBLE_EQ(m.weight_bytes, 2 * n);
  EXPECT_DOUBLE_EQ(m.grad_bytes, 4 * n);
  EXPECT_DOUBLE_EQ(m.master_bytes, 4 * n);
  EXPECT_DOUBLE_EQ(m.optimizer_bytes, 8 * n);
  EXPECT_GT(m.activation_bytes, 0);
  EXPECT_FALSE(m.assumptions.empty());
  p.optimizer = Optimizer::Muon;
  EXPECT_DOUBLE_EQ(training_memory(c, p).optimizer_bytes, 4 * n);
}

TEST(Accounting, TrainingMemorySplits) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-k3.json");
  const ParamCounts pc = count_params(c);
  ParallelPlan p;
  p.dp = 64;
  p.ep = 64;
  p.pp = 16;
  p.tp = 1;
  p.seq_len = 8192;
  const TrainingMemory m = training_memory(c, p);
  // 93 layers over 16 stages: stages take 6 or 5 layers.
  EXPECT_TRUE(m.stage_layers == 6 || m.stage_layers == 5);
  const double per_stage_experts = 6.0 * static_cast<double>(pc.layer_routed[5]);
  EXPECT_LE(m.expert_params, per_stage_experts / 64 + 1);
  // ZeRO-1 shards master + state: expert replicas = dp*tp/ep = 1, dense replicas = dp = 64.
  EXPECT_NEAR(m.master_bytes, 4 * (m.dense_params / 64 + m.expert_params), 1.0);
  ParallelPlan q = p;
  q.zero1 = false;
  EXPECT_GT(training_memory(c, q).optimizer_bytes, m.optimizer_bytes);
  ParallelPlan r = p;
  r.recompute = Recompute::Full;
  EXPECT_LT(training_memory(c, r).activation_bytes, m.activation_bytes);
  // More expert parallelism, less expert memory per device.
  ParallelPlan e = p;
  e.ep = 32;
  EXPECT_GT(training_memory(c, e).expert_params, m.expert_params);
  // The whole K3 fits nowhere on one device, but this plan is well under 141 GB of weights+state.
  EXPECT_LT(m.weight_bytes + m.grad_bytes + m.master_bytes + m.optimizer_bytes, 141e9);
}

TEST(Accounting, PlanValidation) {
  REQUIRE_CONFIGS(dir);
  const ModelConfig c = ModelConfig::load(dir + "/kimi-k3.json");
  ParallelPlan p;
  p.dp = 8;
  p.ep = 3;  // 896 % 3 != 0
  EXPECT_THROW((void)training_memory(c, p), lm::Error);
  p.ep = 16;  // does not divide dp*tp = 8
  EXPECT_THROW((void)training_memory(c, p), lm::Error);
  p.ep = 8;
  p.pp = 94;  // more stages than layers
  EXPECT_THROW((void)training_memory(c, p), lm::Error);
  p.pp = 1;
  p.micro_batch = 0;
  EXPECT_THROW((void)training_memory(c, p), lm::Error);
}

}  // namespace

// The CPU training engine against the model and optimiser it wraps: the same losses, steps and weights bit
// for bit, the step's expert loads, which balancing kinds move the selection bias, NaN/Inf reports that name the
// layer, and the device checks (with the GPU's parallel layouts).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <numeric>

#include "core/error.hpp"
#include "dist/nccl.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "train/engine.hpp"
#include "train/engine_testing.hpp"
#include "testing.hpp"

namespace lm::train {
namespace {

// Two layers: 0 KDA with a dense FFN, 1 gated MLA with a LatentMoE of 6 experts (top 2); AttnRes.
model::ModelConfig two_layers() {
  return model::ModelConfig::from_json(io::json::parse(R"({"model_type": "kimi_linear", "vocab_size": 48,
    "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,
    "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "mla_use_nope": true,
    "mla_use_output_gate": true, "linear_attn_config": {"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
    "use_full_rank_gate": true, "gate_lower_bound": -5.0, "kda_layers": [1], "full_attn_layers": [2]},
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "intermediate_size": 12,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 6, "num_experts_per_token": 2,
    "num_shared_experts": 1, "moe_intermediate_size": 6, "routed_expert_hidden_size": 8, "latent_moe_use_norm": true,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": true, "routed_scaling_factor": 1.0,
    "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 2, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": false})"),
                                       "two layers");
}

using engine_testing::batch;
using engine_testing::Host;

std::vector<float> values(const model::Param<float>& p) { return {p.w(), p.w() + p.value.numel()}; }

TEST(Engine, CpuEngineIsTheModelAndOptimizer) {
  const model::ModelConfig c = two_layers();
  RunConfig rc;
  rc.balance = Balance::None;
  Host a(c, rc.optim), b(c, rc.optim);
  const auto engine = make_engine("cpu", rc, a.m, *a.optim, dist::single());
  const Batch whole = batch(2, 16, static_cast<int32_t>(c.vocab_size));
  const int64_t n = whole.predicted();
  for (int step = 0; step < 2; ++step) {
    engine->zero_grads();
    b.m.params().zero_grads();
    double la = 0, lb = 0;
    for (int64_t s = 0; s < 2; ++s) {  // two micro-batches, normalised by the step's targets
      const Batch mb = whole.sequences(s, 1);
      la += engine->forward_backward(mb, n).loss_sum;
      lb += b.m.forward_backward(mb.ids.data(), mb.targets.data(), model::Seqs::packed(mb.cu_seqlens), n).loss_sum;
    }
    EXPECT_EQ(la, lb);
    const StepInfo ia = engine->step(0.5), ib = b.optim->step(0.5);
    EXPECT_EQ(ia.grad_norm, ib.grad_norm);
    EXPECT_EQ(ia.lr_adamw, ib.lr_adamw);
    engine->balance();  // none: nothing
    engine->sync_to_host();
    for (size_t i = 0; i < a.m.params().all().size(); ++i)
      ASSERT_EQ(values(a.m.params().all()[i]), values(b.m.params().all()[i])) << a.m.params().all()[i].spec.name;
    // The step's loads: k selections per token in the one MoE layer.
    ASSERT_EQ(engine->expert_loads().size(), 1u);
    const auto& l = engine->expert_loads()[0];
    ASSERT_EQ(static_cast<int64_t>(l.size()), c.num_experts);
    EXPECT_EQ(std::accumulate(l.begin(), l.end(), int64_t{0}), whole.tokens() * c.num_experts_per_token);
  }
  const auto ea = engine->loss(whole);
  const auto eb = b.m.loss(whole.ids.data(), whole.targets.data(), model::Seqs::packed(whole.cu_seqlens));
  EXPECT_EQ(ea.loss_sum, eb.loss_sum);
  EXPECT_EQ(ea.n_valid, n);
  engine->zero_grads();
  for (int64_t x : engine->expert_loads()[0]) EXPECT_EQ(x, 0);
  EXPECT_NE(engine->where().find("threads"), std::string::npos);
}

// qb (both estimators) and sign move the MoE layer's bias after the step; aux and none leave it, aux reports
// its loss.
// Batch::weights (data.answer_weight): the gradient of the weighted loss is the plain one plus (w − 1) times that of
// the weighted targets alone (every loss normalised by the same target count); the reported loss stays unweighted.
TEST(Engine, WeightedTargetsScaleTheirGradient) {
  const model::ModelConfig c = two_layers();
  RunConfig rc;
  rc.balance = Balance::None;
  Host a(c, rc.optim), b(c, rc.optim);
  const auto engine = make_engine("cpu", rc, a.m, *a.optim, dist::single());
  Batch plain = batch(2, 16, static_cast<int32_t>(c.vocab_size));
  const int64_t n = plain.predicted();
  const float w = 6.f;
  Batch weighted = plain, only = plain;  // only: the weighted targets alone
  weighted.weights.assign(plain.targets.size(), 1.f);
  for (size_t t = 0; t < plain.targets.size(); ++t) {
    const bool answer = t % 16 >= 9 && t % 16 < 12;  // three targets of each sequence
    if (answer) weighted.weights[t] = w;
    if (!answer) only.targets[t] = kIgnore;
  }
  auto grads = [](const model::Model<float>& m) {
    std::vector<std::vector<float>> g;
    for (const auto& p : m.params().all())  // (none for the selection bias)
      g.push_back(p.g() ? std::vector<float>(p.g(), p.g() + p.value.numel()) : std::vector<float>{});
    return g;
  };
  engine->zero_grads(1);
  const LossStats lw = engine->forward_backward(weighted, n);
  const auto gw = grads(a.m);
  b.m.params().zero_grads();
  const auto lp =
      b.m.forward_backward(plain.ids.data(), plain.targets.data(), model::Seqs::packed(plain.cu_seqlens), n);
  const auto g1 = grads(b.m);
  b.m.params().zero_grads();
  b.m.forward_backward(only.ids.data(), only.targets.data(), model::Seqs::packed(only.cu_seqlens), n);
  const auto gs = grads(b.m);
  EXPECT_NEAR(lw.loss_sum, lp.loss_sum, 1e-5 * lp.loss_sum);
  EXPECT_EQ(lw.n_valid, n);
  double worst = 0;
  for (size_t i = 0; i < gw.size(); ++i) {
    std::vector<float> want(g1[i].size());
    for (size_t j = 0; j < want.size(); ++j) want[j] = g1[i][j] + (w - 1) * gs[i][j];
    double rr = 0;
    for (float v : want) rr += double(v) * v;
    if (rr == 0) continue;
    const double e = lm::testing::rel_rms_vec(want, gw[i]);
    worst = std::max(worst, e);
    EXPECT_LT(e, 1e-4) << a.m.params().all()[i].spec.name;
  }
  std::printf("weighted targets: worst gradient rel rms %.2e\n", worst);
  weighted.weights.pop_back();  // a weight short
  engine->zero_grads(1);
  EXPECT_THROW(engine->forward_backward(weighted, n), Error);
}

TEST(Engine, CpuBalanceKinds) {
  const model::ModelConfig c = two_layers();
  const Batch whole = batch(2, 16, static_cast<int32_t>(c.vocab_size));
  for (const auto& [kind, estimator] : std::vector<std::pair<Balance, std::string>>{
           {Balance::QB, "exact"}, {Balance::QB, "hist"}, {Balance::Sign, "exact"}, {Balance::Aux, "exact"},
           {Balance::None, "exact"}}) {
    RunConfig rc;
    rc.balance = kind, rc.qb_estimator = estimator;
    Host h(c, rc.optim);
    const auto engine = make_engine("cpu", rc, h.m, *h.optim, dist::single());
    const float* bias = h.m.moe(1)->bias();
    const std::vector<float> before(bias, bias + c.num_experts);
    engine->zero_grads();
    engine->forward_backward(whole, whole.predicted());
    engine->step(1.0);
    engine->balance();
    const bool moved = std::vector<float>(bias, bias + c.num_experts) != before;
    const std::string what = std::string(balance_name(kind)) + " " + estimator;
    EXPECT_EQ(moved, kind == Balance::QB || kind == Balance::Sign) << what;
    if (kind == Balance::Aux) EXPECT_GT(engine->aux_loss(), 0) << what;
    else EXPECT_EQ(engine->aux_loss(), 0) << what;
  }
}

TEST(Engine, NonFiniteLossAndGradientNameTheLayer) {
  const model::ModelConfig c = two_layers();
  RunConfig rc;
  Host h(c, rc.optim);
  const auto engine = make_engine("cpu", rc, h.m, *h.optim, dist::single());
  const Batch whole = batch(1, 16, static_cast<int32_t>(c.vocab_size));
  // NaN experts in layer 1 (after its router, which refuses NaN logits), then a NaN final norm.
  auto expect_loss_error = [&](const std::string& needle) {
    engine->zero_grads();
    try {
      engine->forward_backward(whole, 0);
      FAIL() << "a NaN loss went through";
    } catch (const NonFinite& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  for (int64_t e = 0; e < c.num_experts; ++e)
    h.m.params().w("model.layers.1.block_sparse_moe.experts." + std::to_string(e) + ".w2.weight")[0] = NAN;
  expect_loss_error("the first non-finite activation is the output of layer 1 (MLA mixer, MoE)");
  h.m.params().init(3);
  h.m.params().w("model.norm.weight")[0] = NAN;
  expect_loss_error("every layer's output is finite: the LM head overflowed");
  h.m.params().init(3);
  engine->zero_grads();
  engine->forward_backward(whole, 0);
  const std::string bad = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  h.m.params().g(bad)[0] = INFINITY;
  const auto before = values(h.m.params().at(bad));
  try {
    engine->step(1.0);
    FAIL() << "an Inf gradient went through";
  } catch (const NonFinite& e) {
    EXPECT_EQ(std::string(e.what()), "a gradient became NaN/Inf in layer 1 (MoE), parameter '" + bad + "'");
  }
  EXPECT_EQ(values(h.m.params().at(bad)), before);
  EXPECT_EQ(h.optim->step_count(), 0);
}

TEST(Engine, DeviceChecks) {
  RunConfig rc;  // Muon: the CPU only
  EXPECT_THROW(check_device("tpu", rc), Error);
  EXPECT_NO_THROW(check_device("cpu", rc));
  EXPECT_THROW(check_device("cuda", rc), Error);
  rc.optim.kind = "adamw";
  rc.balance = Balance::Sign;
  EXPECT_THROW(check_device("cuda", rc), Error);
  rc.balance = Balance::QB;
  // The GPU runs data parallel alone, over NCCL, and ZeRO-1 there splits each bucket into dp equal blocks.
  auto refused = [&](const RunConfig& bad, const std::string& needle) {
    try {
      check_device("cuda", bad);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  RunConfig bad = rc;
  bad.parallel.dp = bad.parallel.ep = 2;
  refused(bad, "expert parallelism (parallel.ep 2) runs on the CPU only");
  bad = rc;
  bad.parallel.cp = 2;
  refused(bad, "context parallelism (parallel.cp 2) runs on the CPU only");
  bad = rc;
  bad.parallel.dp = 3;
  refused(bad, dist::built_with_nccl() ? "needs dp dividing 64 (got dp 3); use parallel.zero 0" : "built without it");
  if (!model::cuda::available()) {
    const model::ModelConfig c = two_layers();
    Host h(c, rc.optim);
    EXPECT_THROW(make_engine("cuda", rc, h.m, *h.optim, dist::single()), Error);
  }
}

}  // namespace
}  // namespace lm::train

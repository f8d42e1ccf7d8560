// Optimisers: AdamW against a hand-computed step, Muon's Newton–Schulz (singular values near 1, per-head
// blocks independent), group rules on the K3 config, clipping, NaN/Inf naming, state round trip and
// thread-count determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/safetensors.hpp"
#include "model/config.hpp"
#include "model/params.hpp"
#include "tests/testing.hpp"
#include "train/optim.hpp"

namespace lm::train {
namespace {

using model::Component;
using model::ModelConfig;
using model::ParamStore;
using lm::testing::randn;

// A micro K3: layers 0-1 KDA (2 heads × 4), layer 2 MLA (2 heads, q_lora 8, nope 4 + rope 2, v 4),
// LatentMoE with 6 experts, AttnRes.
const char* kMicroK3 = R"({
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

ModelConfig micro() { return ModelConfig::from_json(io::json::parse(kMicroK3), "micro"); }

std::unique_ptr<ParamStore<float>> make_store(const ModelConfig& c, uint64_t seed = 1) {
  auto ps = std::make_unique<ParamStore<float>>(c);
  ps->init(seed);
  ps->enable_grads();
  return ps;
}

// Deterministic gradients, different per step.
void fill_grads(ParamStore<float>& ps, uint64_t seed, double sd = 0.01) {
  uint64_t k = 0;
  for (auto& p : ps.all()) {
    ++k;
    if (!p.grad.defined()) continue;
    const auto g = randn<float>(static_cast<size_t>(p.grad.numel()), seed * 1000003 + k, sd);
    std::copy(g.begin(), g.end(), p.g());
  }
}

std::vector<float> values(const model::Param<float>& p) { return {p.w(), p.w() + p.value.numel()}; }

OptimConfig no_clip(const char* kind = "muon") {
  OptimConfig c;
  c.kind = kind;
  c.clip = 0;
  return c;
}

// Eigenvalues of a symmetric n×n matrix (cyclic Jacobi, double): σ² of the orthogonalised matrix.
std::vector<double> sym_eigenvalues(std::vector<double> a, int n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    if (off < 1e-22) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // rotate columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rotate rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(n);
  for (int i = 0; i < n; ++i) ev[i] = a[i * n + i];
  return ev;
}

// Singular values of an r×c matrix via the eigenvalues of its small Gram matrix.
std::vector<double> singular_values(const std::vector<float>& x, int r, int c) {
  const int m = std::min(r, c);
  std::vector<double> g(static_cast<size_t>(m * m), 0.0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < m; ++j) {
      double s = 0;
      if (r <= c)
        for (int k = 0; k < c; ++k) s += double(x[i * c + k]) * x[j * c + k];  // X Xᵀ
      else
        for (int k = 0; k < r; ++k) s += double(x[k * c + i]) * x[k * c + j];  // Xᵀ X
      g[i * m + j] = s;
    }
  std::vector<double> sv;
  for (double e : sym_eigenvalues(g, m)) sv.push_back(std::sqrt(std::max(0.0, e)));
  return sv;
}

// ---------------------------------------------------------------------------------------------

TEST(Optim, AdamWMatchesHandComputedSteps) {
  const ModelConfig c = micro();
  auto ps = make_store(c);
  OptimConfig oc = no_clip("adamw");
  oc.lr_adamw = 1e-2, oc.beta1 = 0.9, oc.beta2 = 0.99, oc.eps = 1e-8, oc.weight_decay = 0.1;
  Optimizer opt(*ps, c, oc);
  EXPECT_TRUE(opt.group_params(Group::Muon).empty());

  // Reference state in double for every trainable parameter.
  std::map<std::string, std::vector<double>> w, m, v;
  for (const auto& p : ps->all()) {
    if (!p.spec.trainable) continue;
    w[p.spec.name].assign(p.w(), p.w() + p.value.numel());
    m[p.spec.name].assign(p.value.numel(), 0.0);
    v[p.spec.name].assign(p.value.numel(), 0.0);
  }
  const double factors[3] = {1.0, 0.5, 0.25};
  for (int t = 1; t <= 3; ++t) {
    fill_grads(*ps, t, 0.05);
    const double lr = oc.lr_adamw * factors[t - 1];
    const StepInfo info = opt.step(factors[t - 1]);
    EXPECT_DOUBLE_EQ(info.lr_adamw, lr);
    EXPECT_EQ(info.clip_coef, 1.0);
    for (const auto& p : ps->all()) {
      if (!p.spec.trainable) continue;
      const bool decay = p.spec.shape.size() >= 2 && p.spec.component != Component::AttnRes &&
                         p.spec.component != Component::Embedding;
      EXPECT_EQ(opt.rule(p.spec.name).decay, decay) << p.spec.name;
      auto &W = w[p.spec.name], &M = m[p.spec.name], &V = v[p.spec.name];
      double worst = 0;
      for (size_t i = 0; i < W.size(); ++i) {
        const double g = p.g()[i];
        M[i] = 0.9 * M[i] + 0.1 * g;
        V[i] = 0.99 * V[i] + 0.01 * g * g;
        const double mh = M[i] / (1 - std::pow(0.9, t)), vh = V[i] / (1 - std::pow(0.99, t));
        W[i] = W[i] * (1 - (decay ? lr * 0.1 : 0.0)) - lr * mh / (std::sqrt(vh) + 1e-8);
        worst = std::max(worst, std::fabs(W[i] - p.w()[i]) / std::max(1.0, std::fabs(W[i])));
      }
      EXPECT_LT(worst, 2e-6) << p.spec.name << " step " << t;
    }
  }
  EXPECT_EQ(opt.step_count(), 3);
  // the QB bias was never touched
  const auto& qb = ps->at("model.layers.1.block_sparse_moe.gate.e_score_correction_bias");
  for (int64_t i = 0; i < qb.value.numel(); ++i) EXPECT_EQ(qb.w()[i], 0.0f);
}

TEST(Optim, NewtonSchulzSingularValuesNearOne) {
  // Gaussian matrices, wide and tall, plus columns spread over a decade (a condition number ~10x
  // worse): every singular value ends in the quintic's band. Its fixed point is not 1 — the
  // coefficients trade exactness for fast growth of small singular values — so the band is ~[0.7, 1.2].
  struct Case {
    int r, c;
    double decades;
  };
  for (Case k : {Case{48, 128, 0}, Case{128, 48, 0}, Case{64, 32, 1}, Case{32, 96, 1}, Case{7, 200, 1},
                 Case{300, 5, 1}, Case{1, 64, 0}, Case{64, 1, 0}}) {
    auto x = randn<float>(static_cast<size_t>(k.r * k.c), 77 + k.r * 1000 + k.c);
    for (int i = 0; i < k.r; ++i)
      for (int j = 0; j < k.c; ++j) x[i * k.c + j] *= static_cast<float>(std::pow(10.0, -k.decades * j / k.c));
    newton_schulz(x.data(), k.r, k.c, 5);
    for (double s : singular_values(x, k.r, k.c)) {
      EXPECT_GT(s, 0.68) << k.r << "x" << k.c;
      EXPECT_LT(s, 1.2) << k.r << "x" << k.c;
    }
  }
  // Square Gaussian matrices have singular values reaching towards 0 (relative to the Frobenius
  // norm); five steps lift most but not all of them into the band, and none overshoots it.
  auto x = randn<float>(40 * 40, 8);
  newton_schulz(x.data(), 40, 40, 5);
  const auto sv = singular_values(x, 40, 40);
  int in_band = 0;
  for (double s : sv) {
    EXPECT_LT(s, 1.2);
    in_band += s > 0.68;
  }
  EXPECT_GE(in_band, 34);
  // zero stays zero (no division by zero)
  std::vector<float> z(12, 0.0f);
  newton_schulz(z.data(), 3, 4, 5);
  for (float v : z) EXPECT_EQ(v, 0.0f);
}

TEST(Optim, MuonPerHeadBlocksAreIndependent) {
  const ModelConfig c = micro();
  const std::string qb = "model.layers.2.self_attn.q_b_proj.weight";   // [2 heads × 6, 8]
  const std::string kvb = "model.layers.2.self_attn.kv_b_proj.weight";  // [2 heads × (4 + 4), 6]
  const std::string kq = "model.layers.0.self_attn.q_proj.weight";      // [2 heads × 4, 16]

  auto run = [&](bool per_head, bool perturb_head1) {
    auto ps = make_store(c);
    OptimConfig oc = no_clip();
    oc.muon_per_head = per_head;
    oc.weight_decay = 0;
    Optimizer opt(*ps, c, oc);
    fill_grads(*ps, 3);
    if (perturb_head1)
      for (const std::string& n : {qb, kvb, kq}) {
        auto& p = ps->at(n);
        const int64_t half = p.value.numel() / 2;
        for (int64_t i = half; i < p.value.numel(); ++i) p.g()[i] *= (i % 3 == 0 ? -5.0f : 0.3f);
      }
    opt.step();
    std::map<std::string, std::vector<float>> r;
    for (const std::string& n : {qb, kvb, kq}) r[n] = values(ps->at(n));
    return r;
  };
  const auto a = run(true, false), b = run(true, true);
  const auto cw = run(false, false), dw = run(false, true);
  for (const std::string& n : {qb, kvb, kq}) {
    const size_t half = a.at(n).size() / 2;
    // per head: head 0's rows do not see head 1's gradient
    EXPECT_TRUE(std::equal(a.at(n).begin(), a.at(n).begin() + half, b.at(n).begin())) << n;
    EXPECT_FALSE(std::equal(a.at(n).begin() + half, a.at(n).end(), b.at(n).begin() + half)) << n;
    // whole-matrix orthogonalisation couples them
    EXPECT_FALSE(std::equal(cw.at(n).begin(), cw.at(n).begin() + half, dw.at(n).begin())) << n;
  }

  // The update of each head block is -lr · 0.2·sqrt(max(rows, cols)) · NS(g_block) (momentum starts at 0,
  // Nesterov: u = g + μ·g).
  auto ps = make_store(c);
  OptimConfig oc = no_clip();
  oc.weight_decay = 0;
  oc.lr_muon = 0.01;
  Optimizer opt(*ps, c, oc);
  EXPECT_EQ(opt.rule(qb).group, Group::Muon);
  EXPECT_EQ(opt.rule(qb).blocks, 2);
  EXPECT_EQ(opt.rule(kvb).blocks, 2);
  EXPECT_EQ(opt.rule(kq).blocks, 2);
  EXPECT_EQ(opt.rule("model.layers.0.self_attn.v_proj.weight").blocks, 1);
  EXPECT_EQ(opt.rule("model.layers.2.self_attn.o_proj.weight").blocks, 1);
  fill_grads(*ps, 9);
  auto& p = ps->at(kvb);
  const auto w0 = values(p);
  std::vector<float> g(p.g(), p.g() + p.value.numel());
  opt.step();
  const int rows = 8, cols = 6;
  for (int h = 0; h < 2; ++h) {
    std::vector<float> u(g.begin() + h * rows * cols, g.begin() + (h + 1) * rows * cols);
    for (float& x : u) x = x + 0.95f * x;
    newton_schulz(u.data(), rows, cols, 5);
    const double scale = 0.01 * 0.2 * std::sqrt(8.0);
    for (int i = 0; i < rows * cols; ++i) {
      const size_t k = static_cast<size_t>(h * rows * cols + i);
      EXPECT_NEAR(p.w()[k], w0[k] - scale * u[static_cast<size_t>(i)], 1e-6) << h << " " << i;
    }
  }
  // update RMS of a block ≈ lr · 0.2 (the RMS-matching rule)
  double ss = 0;
  for (size_t i = 0; i < w0.size(); ++i) ss += (p.w()[i] - w0[i]) * (p.w()[i] - w0[i]);
  const double rms = std::sqrt(ss / static_cast<double>(w0.size()));
  EXPECT_GT(rms, 0.01 * 0.2 * 0.7);
  EXPECT_LT(rms, 0.01 * 0.2 * 1.2);
}

TEST(Optim, GroupRulesOnK3Config) {
  const std::string path = lm::testing::golden_dir().empty()
                               ? std::string()
                               : lm::testing::golden_dir() + "/../configs/kimi-k3.json";
  if (path.empty() || !std::filesystem::exists(path)) GTEST_SKIP() << "shared/configs/kimi-k3.json not found";
  const ModelConfig c = ModelConfig::load(path);
  const OptimConfig oc;  // defaults: Muon
  int64_t n_muon = 0, n_adam = 0, n_none = 0, n_total = 0;
  std::map<std::string, ParamRule> seen;
  model::for_each_param(c, [&](const model::ParamSpec& p) {
    ++n_total;
    const ParamRule r = param_rule(p, c, oc);
    (r.group == Group::Muon ? n_muon : r.group == Group::AdamW ? n_adam : n_none)++;
    EXPECT_EQ(r.group == Group::None, !p.trainable) << p.name;
    if (r.group == Group::Muon) {
      EXPECT_TRUE(p.matmul && p.shape.size() == 2 && p.layer >= 0) << p.name;
      EXPECT_EQ(p.shape[0] % r.blocks, 0) << p.name;
    }
    if (p.layer <= 3 && p.expert <= 0) seen[p.name] = r;
  });
  EXPECT_EQ(n_muon + n_adam + n_none, n_total);
  EXPECT_EQ(n_none, c.num_moe_layers());  // exactly the QB biases
  auto rule = [&](const std::string& n) {
    EXPECT_TRUE(seen.count(n)) << n;
    return seen[n];
  };
  auto expect = [&](const std::string& n, Group g, bool decay, int64_t blocks = 1) {
    const ParamRule r = rule(n);
    EXPECT_EQ(r.group, g) << n;
    EXPECT_EQ(r.decay, decay) << n;
    EXPECT_EQ(r.blocks, blocks) << n;
  };
  const std::string K = "model.layers.0.self_attn.", M = "model.layers.3.self_attn.",
                    E = "model.layers.1.block_sparse_moe.";
  expect("model.embed_tokens.weight", Group::AdamW, false);
  expect("lm_head.weight", Group::AdamW, true);
  expect("model.norm.weight", Group::AdamW, false);
  expect("model.output_attn_res_proj.weight", Group::AdamW, false);
  expect("model.layers.0.self_attention_res_proj.weight", Group::AdamW, false);
  expect("model.layers.0.mlp_res_norm.weight", Group::AdamW, false);
  expect("model.layers.0.input_layernorm.weight", Group::AdamW, false);
  // KDA: q/k per head (96), the rest whole; gates and convs AdamW
  expect(K + "q_proj.weight", Group::Muon, true, 96);
  expect(K + "k_proj.weight", Group::Muon, true, 96);
  expect(K + "v_proj.weight", Group::Muon, true);
  expect(K + "g_proj.weight", Group::Muon, true);
  expect(K + "o_proj.weight", Group::Muon, true);
  expect(K + "A_log", Group::AdamW, false);
  expect(K + "dt_bias", Group::AdamW, false);
  expect(K + "q_conv1d.weight", Group::AdamW, true);
  expect(K + "o_norm.weight", Group::AdamW, false);
  // MLA: q_b and kv_b per head (96), the shared latent projections whole
  expect(M + "q_a_proj.weight", Group::Muon, true);
  expect(M + "q_b_proj.weight", Group::Muon, true, 96);
  expect(M + "kv_b_proj.weight", Group::Muon, true, 96);
  expect(M + "kv_a_proj_with_mqa.weight", Group::Muon, true);
  expect(M + "q_a_layernorm.weight", Group::AdamW, false);
  expect(M + "o_proj.weight", Group::Muon, true);
  // MoE: router AdamW, QB bias nowhere, experts and latent projections Muon
  expect(E + "gate.weight", Group::AdamW, true);
  expect(E + "gate.e_score_correction_bias", Group::None, false);
  expect(E + "experts.0.w1.weight", Group::Muon, true);
  expect(E + "experts.0.w2.weight", Group::Muon, true);
  expect(E + "shared_experts.down_proj.weight", Group::Muon, true);
  expect(E + "routed_expert_down_proj.weight", Group::Muon, true);
  expect(E + "routed_expert_norm.weight", Group::AdamW, false);
  expect("model.layers.0.mlp.gate_proj.weight", Group::Muon, true);

  // adamw kind: every trainable parameter in AdamW; decay_embeddings switches the embedding's decay
  OptimConfig ad;
  ad.kind = "adamw";
  ad.decay_embeddings = true;
  model::for_each_layer_param(c, 3, [&](const model::ParamSpec& p) {
    EXPECT_EQ(param_rule(p, c, ad).group, p.trainable ? Group::AdamW : Group::None) << p.name;
  });
  model::ParamSpec emb;
  model::for_each_param(c, [&](const model::ParamSpec& p) {
    if (p.component == Component::Embedding) emb = p;
  });
  EXPECT_TRUE(param_rule(emb, c, ad).decay);

  // Kimi Linear (no q LoRA): the plain MLA q_proj is split per head too.
  const ModelConfig kl = ModelConfig::load(lm::testing::golden_dir() + "/../configs/kimi-linear-48b-a3b.json");
  int found = 0;
  model::for_each_layer_param(kl, 3, [&](const model::ParamSpec& p) {
    if (p.name == "model.layers.3.self_attn.q_proj.weight") {
      ++found;
      EXPECT_TRUE(kl.is_mla(3));
      EXPECT_EQ(param_rule(p, kl, oc).blocks, kl.num_attention_heads);
    }
  });
  EXPECT_EQ(found, 1);

  // The micro store: group_params partitions the trainable parameters.
  const ModelConfig mc = micro();
  auto ps = make_store(mc);
  Optimizer opt(*ps, mc, OptimConfig{});
  std::set<std::string> all;
  for (Group g : {Group::Muon, Group::AdamW})
    for (const auto& n : opt.group_params(g)) EXPECT_TRUE(all.insert(n).second) << n;
  for (const auto& p : ps->all()) EXPECT_EQ(all.count(p.spec.name), p.spec.trainable ? 1u : 0u) << p.spec.name;
}

TEST(Optim, GradientNormAndClipping) {
  const ModelConfig c = micro();
  auto ps = make_store(c);
  fill_grads(*ps, 4, 0.1);
  double ss = 0;
  for (const auto& p : ps->all())
    if (p.grad.defined())
      for (int64_t i = 0; i < p.grad.numel(); ++i) ss += double(p.g()[i]) * p.g()[i];
  const double ref = std::sqrt(ss);
  EXPECT_NEAR(grad_norm(*ps), ref, 1e-12 * ref);
  ASSERT_GT(ref, 1.0);
  // clip to 1: returns the pre-clip norm, leaves norm 1
  EXPECT_NEAR(clip_grad_norm(*ps, 1.0), ref, 1e-12 * ref);
  EXPECT_NEAR(grad_norm(*ps), 1.0, 1e-5);
  // below the threshold: untouched
  const auto before = std::vector<float>(ps->all()[0].g(), ps->all()[0].g() + 10);
  EXPECT_NEAR(clip_grad_norm(*ps, 10.0), 1.0, 1e-5);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), ps->all()[0].g()));

  // the optimiser's folded clip: same weights as clipping first, then stepping without a clip
  auto a = make_store(c), b = make_store(c);
  fill_grads(*a, 5, 0.1), fill_grads(*b, 5, 0.1);
  OptimConfig oa;
  oa.clip = 0.5;
  Optimizer opt_a(*a, c, oa);
  const StepInfo info = opt_a.step();
  EXPECT_NEAR(info.grad_norm, grad_norm(*b), 1e-12);
  EXPECT_NEAR(info.clip_coef, 0.5 / (info.grad_norm + 1e-6), 1e-15);
  clip_grad_norm(*b, 0.5);
  Optimizer opt_b(*b, c, no_clip());
  opt_b.step();
  for (size_t i = 0; i < a->all().size(); ++i) {
    const auto va = values(a->all()[i]), vb = values(b->all()[i]);
    for (size_t k = 0; k < va.size(); ++k) ASSERT_NEAR(va[k], vb[k], 1e-6) << a->all()[i].spec.name;
  }
}

TEST(Optim, NonFiniteGradientNamesTheParameter) {
  const ModelConfig c = micro();
  auto ps = make_store(c);
  Optimizer opt(*ps, c, OptimConfig{});
  fill_grads(*ps, 6);
  EXPECT_FALSE(nonfinite_grad(*ps).has_value());
  const std::string bad = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  ps->at(bad).grad.data<float>()[5] = NAN;
  ps->at("lm_head.weight").grad.data<float>()[0] = INFINITY;  // later in checkpoint order: the first one is named
  EXPECT_EQ(nonfinite_grad(*ps).value_or(""), bad);
  EXPECT_TRUE(std::isnan(grad_norm(*ps)));
  const auto before = values(ps->at("model.embed_tokens.weight"));
  try {
    opt.step();
    FAIL() << "step accepted a NaN gradient";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer 1"), std::string::npos) << msg;
  }
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_EQ(values(ps->at("model.embed_tokens.weight")), before);  // nothing applied
  EXPECT_THROW(clip_grad_norm(*ps, 1.0), Error);
  ps->at(bad).grad.data<float>()[5] = 0;
  EXPECT_EQ(nonfinite_grad(*ps).value_or(""), "lm_head.weight");
  ps->at("lm_head.weight").grad.data<float>()[0] = 0;
  EXPECT_NO_THROW(opt.step());
  EXPECT_FALSE(nonfinite_value(*ps).has_value());
  ps->at("model.norm.weight").w()[2] = -INFINITY;
  EXPECT_EQ(nonfinite_value(*ps).value_or(""), "model.norm.weight");
}

TEST(Optim, StateRoundTripIsBitIdentical) {
  const ModelConfig c = micro();
  const lm::testing::ScratchDir scratch("optim_state");
  const std::string dir = scratch.path.string();
  std::filesystem::create_directories(dir);
  for (const char* kind : {"muon", "adamw"}) {
    OptimConfig oc;
    oc.kind = kind;
    auto a = make_store(c);
    Optimizer oa(*a, c, oc);
    for (int t = 1; t <= 3; ++t) {
      fill_grads(*a, 10 + t, 0.3);
      oa.step(0.5 + 0.1 * t);
    }
    // save weights and state (plus an unrelated tensor, which load_state ignores), reload into a
    // fresh store and optimiser
    const std::string wfile = dir + "/" + kind + "_weights.safetensors", file = dir + "/" + kind + ".safetensors";
    io::save_safetensors(wfile, a->named());
    io::NamedTensors st = oa.state();
    st.emplace_back("trainer.data_position", Tensor::from_vector<int64_t>({1234}, {1}));
    io::save_safetensors(file, st);
    auto b = make_store(c, 99);
    b->load(io::Checkpoint::open(wfile));
    Optimizer ob(*b, c, oc);
    ob.load_state(io::SafeTensorsFile::open(file));
    EXPECT_EQ(ob.step_count(), 3);
    for (int t = 4; t <= 5; ++t) {
      fill_grads(*a, 10 + t, 0.3), fill_grads(*b, 10 + t, 0.3);
      oa.step(0.9), ob.step(0.9);
    }
    for (size_t i = 0; i < a->all().size(); ++i)
      EXPECT_EQ(values(a->all()[i]), values(b->all()[i])) << kind << " " << a->all()[i].spec.name;
    const auto sa = oa.state(), sb = ob.state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].first, sb[i].first);
      EXPECT_EQ(std::memcmp(sa[i].second.raw(), sb[i].second.raw(), sa[i].second.nbytes()), 0) << sa[i].first;
    }
  }
  // a state from other groups (AdamW everywhere) does not load into a Muon optimiser, and nothing changes
  auto ps = make_store(c);
  Optimizer muon(*ps, c, OptimConfig{});
  const auto f = io::SafeTensorsFile::open(dir + "/adamw.safetensors");
  try {
    muon.load_state(f);
    FAIL() << "loaded an AdamW state into Muon";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim."), std::string::npos) << e.what();
  }
  EXPECT_EQ(muon.step_count(), 0);
  // a wrong shape names the tensor
  std::map<std::string, Tensor> m;
  for (auto& [n, t] : muon.state()) m[n] = t.clone();
  m["optim.adamw.m.lm_head.weight"] = Tensor::zeros({3});
  try {
    muon.load_state(m);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optim.adamw.m.lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST(Optim, DeterministicAcrossThreadCounts) {
  const ModelConfig c = micro();
  const int saved = num_threads();
  std::vector<std::vector<float>> ref;
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    auto ps = make_store(c);
    Optimizer opt(*ps, c, OptimConfig{});
    for (int t = 1; t <= 2; ++t) {
      fill_grads(*ps, 20 + t, 1.0);
      opt.step();
    }
    std::vector<std::vector<float>> got;
    for (const auto& p : ps->all()) got.push_back(values(p));
    if (ref.empty()) ref = got;
    else EXPECT_EQ(got, ref) << threads << " threads";
  }
  // Muon alone on a store with a few large blocks (fewer blocks than threads included)
  const ModelConfig one = ModelConfig::from_json(
      [] {
        auto j = io::json::parse(kMicroK3);
        j["hidden_size"] = 256;
        j["num_hidden_layers"] = 1;
        j["linear_attn_config"]["kda_layers"] = {1};
        j["linear_attn_config"]["full_attn_layers"] = io::json::array();
        j["linear_attn_config"]["head_dim"] = 128;
        j["intermediate_size"] = 384;
        return j;
      }(),
      "one");
  std::vector<std::vector<float>> ref1;
  for (int threads : {1, 2, 8}) {
    set_num_threads(threads);
    auto ps = make_store(one);
    Optimizer opt(*ps, one, OptimConfig{});
    fill_grads(*ps, 31, 1.0);
    opt.step();
    EXPECT_EQ(num_threads(), threads);  // the optimiser leaves the thread count as it found it
    std::vector<std::vector<float>> got;
    for (const auto& p : ps->all()) got.push_back(values(p));
    if (ref1.empty()) ref1 = got;
    else EXPECT_EQ(got, ref1) << threads << " threads";
  }
  set_num_threads(saved);
}

TEST(Optim, ConfigJson) {
  const auto c = OptimConfig::from_json(
      io::json::parse(R"({"kind": "muon", "lr": 0.002, "weight_decay": 0.1, "muon_ns_steps": 6, "clip": 0})"), "t");
  EXPECT_EQ(c.lr_adamw, 0.002);
  EXPECT_EQ(c.lr_muon, 0.002);
  EXPECT_EQ(c.muon_ns_steps, 6);
  const auto d = OptimConfig::from_json(io::json::parse(R"({"lr": 0.002, "lr_muon": 0.02})"), "t");
  EXPECT_EQ(d.lr_adamw, 0.002);
  EXPECT_EQ(d.lr_muon, 0.02);
  const auto e = OptimConfig::from_json(c.to_json(), "rt");
  EXPECT_EQ(e.to_json(), c.to_json());
  for (const char* bad : {R"({"kind": "sgd"})", R"({"beta1": 1.0})", R"({"lr": -1})", R"({"eps": 0})",
                          R"({"muon_ns_steps": 0})", R"({"learning_rate": 0.1})", R"({"lr": "0.1"})"}) {
    EXPECT_THROW(OptimConfig::from_json(io::json::parse(bad), "t"), Error) << bad;
  }
  try {
    OptimConfig::from_json(io::json::parse(R"({"learning_rate": 0.1})"), "run.json: optimizer");
  } catch (const Error& e2) {
    EXPECT_NE(std::string(e2.what()).find("learning_rate"), std::string::npos);
    EXPECT_NE(std::string(e2.what()).find("run.json"), std::string::npos);
  }
}

}  // namespace
}  // namespace lm::train

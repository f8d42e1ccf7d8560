// The whole model: golden parity (both reference models), float64 finite-difference checks of every
// layer type and of a micro model (two KDA layers, one MLA layer, AttnRes, LatentMoE), varlen packing.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "io/checkpoint.hpp"
#include "io/safetensors.hpp"
#include "model/model.hpp"
#include "micro_models.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::model;
using lm::testing::fd_check;
using lm::testing::randn;
using namespace lm::testing::micro;

namespace {

// Probes a few entries of every trainable parameter of the model by central differences of the loss.
void fd_whole_model(const ModelConfig& cfg, const Seqs& s, uint64_t seed) {
  Model<double> m(cfg);
  randomise(m.params(), seed);
  m.params().enable_grads();
  const int64_t rows = s.rows();
  const auto ids = random_ids(rows, cfg.vocab_size, seed + 1);
  auto targets = random_ids(rows, cfg.vocab_size, seed + 2);
  targets[3] = -100;  // an ignored position
  m.forward_backward(ids.data(), targets.data(), s);
  auto loss = [&] {
    const auto st = m.loss(ids.data(), targets.data(), s);
    return st.loss_sum / static_cast<double>(st.n_valid);
  };
  int checked = 0;
  for (auto& p : m.params().all()) {
    if (!p.spec.trainable) continue;
    std::vector<double> x(p.w(), p.w() + p.value.numel()), g(p.g(), p.g() + p.value.numel());
    auto f = [&] {
      std::copy(x.begin(), x.end(), p.w());
      return loss();
    };
    const double err = fd_check(x, g, f, 3, 1e-5);
    std::copy(x.begin(), x.end(), p.w());
    EXPECT_LT(err, 1e-5) << p.spec.name;
    ++checked;
  }
  EXPECT_GT(checked, 40);
}

}  // namespace

TEST(Model, GoldenModelsMatchInFp32) {
  LM_REQUIRE_GOLDEN(dir);
  for (const char* name : {"k3-tiny", "kimi-linear-tiny"}) {
    const std::string d = dir + "/model/" + name;
    const auto cfg = ModelConfig::load(d + "/config.json");
    Model<float> m(cfg);
    m.params().load(io::Checkpoint::open(d + "/model.safetensors"));
    const auto in = io::SafeTensorsFile::open(d + "/inputs.safetensors");
    const Tensor ids = in.get_as("input_ids", DType::I32).contiguous();
    const int64_t B = ids.dim(0), T = ids.dim(1), rows = B * T;
    ForwardResult<float> out;
    m.forward(ids.data<int32_t>(), Seqs::batch(B, T), ForwardOptions{true, true, true}, &out);
    const auto ex = io::SafeTensorsFile::open(d + "/expected.safetensors");
    auto err = [&](const std::string& n, const std::vector<float>& got) {
      const Tensor ref = ex.get_as(n, DType::F32).contiguous();
      EXPECT_EQ(ref.numel(), static_cast<int64_t>(got.size())) << n;
      return rel_rms(ref.data<float>(), got.data(), ref.numel());
    };
    EXPECT_LT(err("logits", out.logits), 1e-4) << name;
    EXPECT_LT(err("final_hidden", out.final_hidden), 1e-4) << name;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      EXPECT_LT(err("hidden." + std::to_string(i), out.hidden[i]), 1e-4) << name << " layer " << i;
      if (!cfg.is_moe(i)) continue;
      const Tensor ref = ex.get_as("topk_idx." + std::to_string(i), DType::I32).contiguous();
      ASSERT_EQ(ref.numel(), rows * cfg.num_experts_per_token);
      EXPECT_TRUE(std::equal(out.topk[i].begin(), out.topk[i].end(), ref.data<int32_t>())) << name << " layer " << i;
    }
  }
}

TEST(Model, LoadRejectsMismatchedCheckpoints) {
  LM_REQUIRE_GOLDEN(dir);
  // k3-tiny's weights into the Kimi Linear configuration: missing / unknown tensors, named clearly.
  const auto cfg = ModelConfig::load(dir + "/model/kimi-linear-tiny/config.json");
  Model<float> m(cfg);
  const float before = m.params().all().front().w()[0];
  try {
    m.params().load(io::Checkpoint::open(dir + "/model/k3-tiny/model.safetensors"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("lacks tensor") != std::string::npos || msg.find("does not use") != std::string::npos)
        << msg;
  }
  EXPECT_EQ(m.params().all().front().w()[0], before);  // nothing was changed
}

TEST(Model, MicroK3FiniteDifferences) { fd_whole_model(parse(kMicroK3), Seqs::batch(2, 9), 11); }

TEST(Model, MicroKimiLinearFiniteDifferences) { fd_whole_model(parse(kMicroKL), Seqs::batch(1, 13), 12); }

TEST(Model, MicroK3VarlenFiniteDifferences) { fd_whole_model(parse(kMicroK3), Seqs::packed({0, 5, 6, 14}), 13); }

// Packed documents equal separate runs (KDA state and attention do not cross the boundary).
TEST(Model, PackedSequencesEqualSeparateRuns) {
  for (const char* text : {kMicroK3, kMicroKL}) {
    const auto cfg = parse(text);
    Model<double> m(cfg);
    randomise(m.params(), 5);
    const std::vector<int64_t> cu{0, 7, 8, 30};
    const auto ids = random_ids(cu.back(), cfg.vocab_size, 9);
    ForwardResult<double> packed;
    m.forward(ids.data(), Seqs::packed(cu), ForwardOptions{false, true, false}, &packed);
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t L = cu[n + 1] - cu[n];
      ForwardResult<double> one;
      m.forward(ids.data() + cu[n], Seqs::batch(1, L), ForwardOptions{false, true, false}, &one);
      const int64_t V = cfg.vocab_size;
      std::vector<double> part(packed.logits.begin() + cu[n] * V, packed.logits.begin() + cu[n + 1] * V);
      EXPECT_LT(lm::testing::rel_rms_vec(one.logits, part), 1e-12) << "sequence " << n;
    }
  }
}

// Per-layer checks: each sublayer alone, loss = sum(y * r), finite differences w.r.t. input and weights.
namespace {
template <class Layer>
void fd_layer(Layer& layer, ParamStore<double>& ps, const Seqs& s, int64_t d, uint64_t seed,
              const std::string& prefix) {
  const int64_t rows = s.rows();
  auto x = randn<double>(rows * d, seed);
  const auto r = randn<double>(rows * d, seed + 1);
  std::vector<double> y(rows * d), dx(rows * d);
  ps.zero_grads();
  layer.forward(x.data(), y.data(), s);
  layer.backward(r.data(), dx.data(), s);
  auto loss = [&] {
    std::vector<double> yy(rows * d);
    layer.forward(x.data(), yy.data(), s);
    return lm::testing::dot(yy, r);
  };
  EXPECT_LT(fd_check(x, dx, loss, 24, 1e-6), 1e-6) << prefix << " dx";
  for (auto& p : ps.all()) {
    if (!p.spec.trainable || p.spec.name.rfind(prefix, 0) != 0) continue;
    std::vector<double> w(p.w(), p.w() + p.value.numel()), g(p.g(), p.g() + p.value.numel());
    auto f = [&] {
      std::copy(w.begin(), w.end(), p.w());
      return loss();
    };
    EXPECT_LT(fd_check(w, g, f, 4, 1e-6), 1e-6) << p.spec.name;
    std::copy(w.begin(), w.end(), p.w());
  }
}
}  // namespace

TEST(Layers, EveryLayerTypeFiniteDifferences) {
  for (const char* text : {kMicroK3, kMicroKL}) {
    const auto cfg = parse(text);
    ParamStore<double> ps(cfg);
    randomise(ps, 21);
    ps.enable_grads();
    const Seqs s = Seqs::batch(2, 11);
    const int64_t d = cfg.hidden_size;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      const std::string P = "model.layers." + std::to_string(i);
      if (cfg.is_kda(i)) {
        KdaMixer<double> l(cfg, ps, static_cast<int>(i));
        fd_layer(l, ps, s, d, 30 + i, P + ".self_attn");
      } else {
        GatedMla<double> l(cfg, ps, static_cast<int>(i));
        fd_layer(l, ps, s, d, 40 + i, P + ".self_attn");
      }
      if (cfg.is_moe(i)) {
        LatentMoe<double> l(cfg, ps, static_cast<int>(i));
        fd_layer(l, ps, s, d, 50 + i, P + ".block_sparse_moe");
      } else {
        DenseFfn<double> l(cfg, ps, P + ".mlp", cfg.intermediate_size);
        fd_layer(l, ps, s, d, 60 + i, P + ".mlp");
      }
    }
  }
}

// The vision tower and projector (SPEC §9): the golden case in float64 (reference and fast path) and fp32,
// the fast path against the float64 definition, every weight's gradient against central finite differences
// (images of two sizes, one resized, and a 2-frame clip), the parameter list, the config and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "io/checkpoint.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "model/accounting.hpp"
#include "model/vision.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::model;
using lm::io::json;

namespace {

const char* kTinyVision = R"({
  "patch_size": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
  "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 8,
  "vt_intermediate_size": 12, "qkv_hidden_size": 16, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
  "mm_projector_type": "patchmergerv2", "mm_hidden_size": 8, "projector_hidden_act": "gelu",
  "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "attn_bias": false, "patch_embed_proj_bias": false,
  "mlp_type": "mlp2", "linear_bias": false, "activation_func": "gelu_pytorch_tanh",
  "pos_emb_interpolation_mode": "bilinear", "text_hidden_size": 6 })";

VisionConfig tiny() { return VisionConfig::from_json(json::parse(kTinyVision), "tiny"); }

// Random weights: linears N(0, 1/sqrt(fan_in)), norm gains 1 + 0.1 N, the position table 0.3 N.
template <class F>
void randomize(ParamStore<F>& ps, uint64_t seed) {
  for (auto& p : ps.all()) {
    const auto n = static_cast<size_t>(p.value.numel());
    const bool gain = p.spec.shape.size() == 1;
    const double sd = gain ? 0.1 : p.spec.matmul ? 1.0 / std::sqrt(double(p.value.numel() / p.spec.shape[0])) : 0.3;
    const auto v = lm::testing::randn<double>(n, seed++, sd);
    for (size_t i = 0; i < n; ++i) p.w()[i] = static_cast<F>(v[i] + (gain ? 1.0 : 0.0));
  }
}

struct Golden {
  VisionConfig cfg;
  std::string dir;
  std::vector<MediaGrid> media;
  Tensor pixels;  // F64 [L, P]
  int64_t L = 0;
};

Golden load_golden(const std::string& golden_dir) {
  Golden g;
  g.dir = golden_dir + "/vision/moonvit-tiny";
  g.cfg = VisionConfig::load(g.dir);
  const auto in = io::SafeTensorsFile::open(g.dir + "/inputs.safetensors");
  const Tensor thw = in.get_as("grid_thws", DType::I32).contiguous();
  for (int64_t n = 0; n < thw.dim(0); ++n)
    g.media.push_back({thw.data<int32_t>()[n * 3], thw.data<int32_t>()[n * 3 + 1], thw.data<int32_t>()[n * 3 + 2]});
  g.pixels = in.get_as("pixel_values", DType::F64).contiguous();
  g.L = g.pixels.dim(0);
  return g;
}

// rms(ref − x) / rms(ref) of every expected tensor.
template <class F>
std::vector<std::pair<std::string, double>> golden_errors(const Golden& g, const VisionTrace<F>& tr) {
  const auto ex = io::SafeTensorsFile::open(g.dir + "/expected.safetensors");
  std::vector<std::pair<std::string, double>> r;
  auto cmp = [&](const std::string& name, const Buf<F>& got) {
    const Tensor ref = ex.get_as(name, DType::F64).contiguous();
    EXPECT_EQ(ref.numel(), static_cast<int64_t>(got.size())) << name;
    std::vector<double> x(got.begin(), got.end());
    r.emplace_back(name, rel_rms(ref.data<double>(), x.data(), std::min<int64_t>(ref.numel(), x.size())));
  };
  cmp("patch_embed", tr.patch_embed);
  for (size_t i = 0; i < tr.blocks.size(); ++i) cmp("block." + std::to_string(i), tr.blocks[i]);
  cmp("tower_out", tr.tower_out);
  cmp("merged", tr.merged);
  cmp("features", tr.features);
  return r;
}

template <class F>
VisionTrace<F> run_fast(const Golden& g) {
  ParamStore<F> ps(vision_param_specs(g.cfg));
  ps.load(io::Checkpoint::open(g.dir + "/model.safetensors"));
  VisionTower<F> tower(g.cfg, ps);
  const VisionBatch b = VisionBatch::make(g.cfg, g.media, g.L);
  std::vector<F> px(g.pixels.data<double>(), g.pixels.data<double>() + g.pixels.numel());
  std::vector<F> feats(b.merged() * g.cfg.text_hidden_size);
  VisionTrace<F> tr;
  tower.forward(px.data(), b, feats.data(), &tr);
  EXPECT_EQ(tr.features, feats);
  return tr;
}

}  // namespace

TEST(Vision, GoldenFp32AndFloat64) {
  LM_REQUIRE_GOLDEN(dir);
  const Golden g = load_golden(dir);
  ASSERT_EQ(g.media.size(), 3u);
  for (const auto& [name, err] : golden_errors(g, run_fast<float>(g))) {
    EXPECT_LT(err, 1e-4) << "fp32 " << name;
    std::printf("  fp32     %-12s %.3e\n", name.c_str(), err);
  }
  // The expectations are float64 results rounded to F32: ~3e-8 is the floor of any exact computation.
  for (const auto& [name, err] : golden_errors(g, run_fast<double>(g))) {
    EXPECT_LT(err, 1e-6) << "float64 " << name;
    std::printf("  float64  %-12s %.3e\n", name.c_str(), err);
  }
  ParamStore<double> ps(vision_param_specs(g.cfg));
  ps.load(io::Checkpoint::open(g.dir + "/model.safetensors"));
  const auto tr = vision_reference_forward(g.cfg, ps, g.pixels.data<double>(), VisionBatch::make(g.cfg, g.media, g.L));
  for (const auto& [name, err] : golden_errors(g, tr)) {
    EXPECT_LT(err, 1e-6) << "reference " << name;
    std::printf("  ref f64  %-12s %.3e\n", name.c_str(), err);
  }
  // Below that floor: the float64 fast path against the float64 definition on the same inputs.
  const VisionTrace<double> fast = run_fast<double>(g);
  EXPECT_LT(lm::testing::rel_rms_vec(tr.patch_embed, fast.patch_embed), 1e-13);
  for (size_t i = 0; i < tr.blocks.size(); ++i) EXPECT_LT(lm::testing::rel_rms_vec(tr.blocks[i], fast.blocks[i]), 1e-13);
  EXPECT_LT(lm::testing::rel_rms_vec(tr.tower_out, fast.tower_out), 1e-13);
  EXPECT_LT(lm::testing::rel_rms_vec(tr.merged, fast.merged), 1e-13);
  const double ff = lm::testing::rel_rms_vec(tr.features, fast.features);
  EXPECT_LT(ff, 1e-13);
  std::printf("  float64 fast path vs float64 definition: features %.3e\n", ff);
}

TEST(Vision, GoldenErrorsDetectAWrongTower) {
  // The comparison must be able to fail: a wrong RoPE (row and column swapped) or a missing time embedding
  // shows up far above the tolerance.
  LM_REQUIRE_GOLDEN(dir);
  Golden g = load_golden(dir);
  auto media = g.media;
  for (auto& m : media) std::swap(m.h, m.w);  // same patch count, transposed grids
  ParamStore<double> ps(vision_param_specs(g.cfg));
  ps.load(io::Checkpoint::open(g.dir + "/model.safetensors"));
  VisionTower<double> tower(g.cfg, ps);
  const VisionBatch b = VisionBatch::make(g.cfg, media, g.L);
  std::vector<double> feats(b.merged() * g.cfg.text_hidden_size);
  VisionTrace<double> tr;
  tower.forward(g.pixels.data<double>(), b, feats.data(), &tr);
  EXPECT_GT(golden_errors(g, tr).back().second, 1e-2);
}

TEST(Vision, FastPathMatchesTheDefinition) {
  const VisionConfig c = tiny();
  ParamStore<double> ps(vision_param_specs(c));
  randomize(ps, 100);
  ParamStore<float> psf(vision_param_specs(c));
  for (size_t i = 0; i < ps.all().size(); ++i)
    for (int64_t j = 0; j < ps.all()[i].value.numel(); ++j) psf.all()[i].w()[j] = static_cast<float>(ps.all()[i].w()[j]);
  const std::vector<MediaGrid> media{{1, 4, 4}, {1, 2, 6}, {2, 4, 2}, {1, 6, 8}};
  const VisionBatch b = VisionBatch::make(c, media, 16 + 12 + 16 + 48);
  const auto px = lm::testing::randn<double>(b.patches() * c.patch_dim(), 7);
  const auto ref = vision_reference_forward(c, ps, px.data(), b);
  VisionTower<double> tower(c, ps);
  std::vector<double> feats(b.merged() * c.text_hidden_size);
  VisionTrace<double> tr;
  tower.forward(px.data(), b, feats.data(), &tr);
  EXPECT_LT(lm::testing::rel_rms_vec(ref.patch_embed, tr.patch_embed), 1e-13);
  for (size_t i = 0; i < tr.blocks.size(); ++i) EXPECT_LT(lm::testing::rel_rms_vec(ref.blocks[i], tr.blocks[i]), 1e-12);
  EXPECT_LT(lm::testing::rel_rms_vec(ref.merged, tr.merged), 1e-12);
  EXPECT_LT(lm::testing::rel_rms_vec(ref.features, feats), 1e-12);
  VisionTower<float> towerf(c, psf);
  std::vector<float> pxf(px.begin(), px.end()), featsf(feats.size());
  towerf.forward(pxf.data(), b, featsf.data());
  EXPECT_LT(lm::testing::rel_rms_vec(ref.features, std::vector<double>(featsf.begin(), featsf.end())), 1e-5);
}

TEST(Vision, EveryWeightGradientMatchesFiniteDifferences) {
  // Images of two sizes (4x4 = the table, no resize; 2x6 resized: rows shrink, columns grow) and a 2-frame clip.
  const VisionConfig c = tiny();
  ParamStore<double> ps(vision_param_specs(c));
  randomize(ps, 200);
  ps.enable_grads();
  VisionTower<double> tower(c, ps);
  const std::vector<MediaGrid> media{{1, 4, 4}, {1, 2, 6}, {2, 4, 2}};
  const VisionBatch b = VisionBatch::make(c, media, 16 + 12 + 16);
  const auto px = lm::testing::randn<double>(b.patches() * c.patch_dim(), 9);
  const auto R = lm::testing::randn<double>(b.merged() * c.text_hidden_size, 10);
  std::vector<double> feats(R.size());
  auto loss = [&] {
    tower.forward(px.data(), b, feats.data());
    return lm::testing::dot(feats, R);
  };
  loss();
  tower.backward(R.data());
  int checked = 0;
  double worst = 0;
  for (auto& p : ps.all()) {
    const auto n = static_cast<size_t>(p.value.numel());
    std::vector<double> x(p.w(), p.w() + n), g(p.g(), p.g() + n);
    auto f = [&] {
      std::copy(x.begin(), x.end(), p.w());
      return loss();
    };
    const double err = lm::testing::fd_check(x, g, f, 12, 1e-5);
    std::copy(x.begin(), x.end(), p.w());
    EXPECT_LT(err, 1e-6) << p.spec.name;
    worst = std::max(worst, err);
    ++checked;
  }
  std::printf("  finite differences: %d tensors, worst relative error %.2e\n", checked, worst);
  EXPECT_EQ(checked, 2 + 6 * 2 + 1 + 3);
}

TEST(Vision, BadInputsAreClearErrors) {
  const VisionConfig c = tiny();
  auto expect_error = [&](const std::vector<MediaGrid>& m, int64_t rows, const std::string& needle) {
    try {
      (void)VisionBatch::make(c, m, rows);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("grid_thws"), std::string::npos) << e.what();
    }
  };
  expect_error({{1, 4, 4}}, 15, "pixel_values has 15 rows");
  expect_error({{1, 3, 4}}, 12, "multiples");
  expect_error({{1, 4, 5}}, 20, "multiples");
  expect_error({{3, 2, 2}}, 12, "init_pos_emb_time");
  expect_error({{0, 2, 2}}, 0, ">= 1");
  expect_error({}, 0, "no media");
  const int32_t thw[] = {1, 4, 4, 1, 2, 2};
  EXPECT_THROW(VisionBatch::make(c, thw, 2, 19), Error);
  EXPECT_NO_THROW(VisionBatch::make(c, thw, 2, 20));
  // Backward without a forward, and without gradients.
  ParamStore<double> ps(vision_param_specs(c));
  VisionTower<double> tower(c, ps);
  std::vector<double> d(6);
  EXPECT_THROW(tower.backward(d.data()), Error);
}

TEST(Vision, ConfigParsingIsStrict) {
  const json base = json::parse(kTinyVision);
  auto expect_error = [&](json j, const std::vector<std::string>& needles) {
    try {
      (void)VisionConfig::from_json(j, "cfg.json");
      ADD_FAILURE() << "no error for " << j.dump();
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  json j = base;
  j["vt_hidden_sise"] = 8;
  expect_error(j, {"cfg.json", "unknown field 'vision_config.vt_hidden_sise'", "vt_hidden_size"});
  j = base, j["merge_type"] = "sd2";
  expect_error(j, {"vision_config.merge_type", "sd2_tpool"});
  j = base, j["linear_bias"] = true;
  expect_error(j, {"vision_config.linear_bias", "bias-free"});
  j = base, j["qkv_hidden_size"] = 12;  // head_dim 6: not a multiple of 4
  expect_error(j, {"multiple of 4"});
  j = base, j["mm_hidden_size"] = 16;
  expect_error(j, {"vision_config.mm_hidden_size"});
  j = base, j.erase("vt_num_hidden_layers");
  expect_error(j, {"missing required field 'vision_config.vt_num_hidden_layers'"});
  j = base, j["merge_kernel_size"] = {2};
  expect_error(j, {"vision_config.merge_kernel_size"});
  j = base, j["vt_num_attention_heads"] = "two";
  expect_error(j, {"vision_config.vt_num_attention_heads", "integer"});
  // Round trip.
  const VisionConfig c = tiny();
  EXPECT_TRUE(VisionConfig::from_json(c.to_json(), "rt") == c);
}

TEST(Vision, ModelConfigCarriesAVisionConfig) {
  LM_REQUIRE_GOLDEN(dir);
  const std::string k3 = dir + "/../configs/kimi-k3.json";
  if (!std::filesystem::exists(k3)) GTEST_SKIP() << "configs/kimi-k3.json not found";
  json j = lm::io::load_json_file(k3);
  EXPECT_FALSE(ModelConfig::from_json(j, "k3").vision.has_value());  // text only, as before
  // K3's tower (SPEC §9): 27 blocks, D 1024, 12 heads x 128, I 4096, P0 64, into d 7168.
  json v = lm::io::load_json_file(dir + "/vision/moonvit-tiny/config.json").at("vision_config");
  v["init_pos_emb_height"] = 64, v["init_pos_emb_width"] = 64, v["vt_num_attention_heads"] = 12;
  v["vt_num_hidden_layers"] = 27, v["vt_hidden_size"] = 1024, v["mm_hidden_size"] = 1024;
  v["qkv_hidden_size"] = 1536, v["vt_intermediate_size"] = 4096, v["text_hidden_size"] = 7168;
  j["vision_config"] = v;
  const ModelConfig c = ModelConfig::from_json(j, "k3+vision");
  ASSERT_TRUE(c.vision.has_value());
  EXPECT_EQ(c.vision->head_dim(), 128);
  EXPECT_TRUE(ModelConfig::from_json(c.to_json(), "rt") == c);
  const VisionParamCounts vp = count_vision_params(*c.vision);
  EXPECT_GT(vp.tower, 390'000'000);
  EXPECT_LT(vp.tower, 410'000'000);
  EXPECT_EQ(vp.projector, int64_t{4096} * 4096 + int64_t{7168} * 4096 + 7168);
  // The nested (HF multimodal) layout: vision_config beside text_config.
  json inner = lm::io::load_json_file(k3);
  json nested = {{"model_type", "kimi_k3"}, {"text_config", inner}, {"vision_config", v}};
  EXPECT_TRUE(ModelConfig::from_json(nested, "nested").vision == c.vision);
  // The projector must write the text model's width.
  j["vision_config"]["text_hidden_size"] = 4096;
  try {
    (void)ModelConfig::from_json(j, "k3+vision");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("text_hidden_size"), std::string::npos) << e.what();
  }
  // null / {} mean no tower.
  j["vision_config"] = json::object();
  EXPECT_FALSE(ModelConfig::from_json(j, "k3").vision.has_value());
}

TEST(Vision, ShippedK3VisionConfigCountsTheTower) {
  const std::filesystem::path path =
      std::filesystem::path(LONGMOE_SOURCE_DIR) / "configs" / "kimi-k3-vision.json";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not found";
  const ModelConfig c = ModelConfig::load(path.string());
  ASSERT_TRUE(c.vision.has_value());
  const VisionParamCounts vp = count_vision_params(*c.vision);
  EXPECT_EQ(vp.tower, 401'214'464);  // 27 x 14.68M blocks + the 588-input patch conv + the 64x64 position table
  EXPECT_EQ(vp.projector, 46'144'512);
  EXPECT_EQ(count_params(c).total, 2'779'484'476'000);  // the text totals are unchanged by the tower
}

TEST(Vision, ParamNamesAreTheCheckpointsNames) {
  LM_REQUIRE_GOLDEN(dir);
  const VisionConfig c = VisionConfig::load(dir + "/vision/moonvit-tiny/config.json");
  const auto ckpt = io::Checkpoint::open(dir + "/vision/moonvit-tiny/model.safetensors");
  EXPECT_NO_THROW(check_checkpoint(vision_param_specs(c), ckpt));
  const auto specs = vision_param_specs(c);
  EXPECT_EQ(specs.size(), ckpt.size());
  EXPECT_EQ(specs.front().name, "vision_tower.patch_embed.proj.weight");
  EXPECT_EQ(specs.front().shape, (Shape{64, 3, 14, 14}));
  EXPECT_EQ(specs.back().name, "mm_projector.post_norm.weight");
}

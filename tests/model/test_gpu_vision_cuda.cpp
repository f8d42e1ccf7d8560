// The vision tower on the GPU (model/cuda/vision.cpp, issue 22 item 1) inside the whole multimodal GpuModel, against
// the CPU fp32 Model with the same bf16-rounded weights: the features, the loss of a batch whose placeholders take
// them, every tower, projector and text gradient; prompts with images prefilled whole and in chunks that cut through
// an image's rows, against the CPU logits; GpuEngine's attached images; and the errors. Skips without a GPU.
//
// Legend: rows tokens, d text width, M feature rows (merged patches) of the batch's media.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "core/rng.hpp"
#include "infer/engine.hpp"
#include "io/json.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::model;

#define REQUIRE_GPU() \
  if (!lm::model::cuda::available()) GTEST_SKIP() << "no CUDA device"

namespace {

constexpr int32_t kPh = 511;  // the placeholder: the last id of the 512

// The GPU tests' K3 wiring at toy width (3 KDA + 1 MLA layer with the decode kernel's 512 + 64 latent rows, latent
// MoE with every expert selected, so that no routing flips between the two paths) with a 2-block tower of width 64
// (2 heads of 32), 4x4-px patches and a 4x4 position table, into d = 256.
ModelConfig multimodal() {
  const char* text = R"({
  "model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
  "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 512,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
  "mla_use_output_gate": true,
  "linear_attn_config": {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": true,
    "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
  "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "intermediate_size": 512, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 4,
  "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 64,
  "routed_expert_hidden_size": 128, "latent_moe_use_norm": true, "moe_router_activation_func": "sigmoid",
  "moe_renormalize": true, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
  "attn_res_block_size": 2})";
  const char* vision = R"({
  "patch_size": 4, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
  "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 64,
  "vt_intermediate_size": 96, "qkv_hidden_size": 64, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
  "mm_projector_type": "patchmergerv2", "mm_hidden_size": 64, "projector_hidden_act": "gelu",
  "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh",
  "text_hidden_size": 256})";
  const io::json j = {{"architectures", {"KimiK3ForConditionalGeneration"}},
                      {"model_type", "kimi_k3"},
                      {"text_config", io::json::parse(text)},
                      {"vision_config", io::json::parse(vision)},
                      {"media_placeholder_token_id", kPh}};
  return ModelConfig::from_json(j, "gpu vision test config");
}

// The table's own grid, two resized ones (one of 120 patches: longer than an attention tile) and a 2-frame clip:
// 4 + 3 + 30 + 4 = 41 feature rows.
Media<float> media(uint64_t seed) {
  Media<float> m;
  m.grids = {{1, 4, 4}, {1, 2, 6}, {1, 10, 12}, {2, 4, 4}};
  int64_t patches = 0;
  for (const auto& g : m.grids) patches += g.patches();
  m.pixel_values = lm::testing::randu<float>(static_cast<size_t>(patches * 48), seed, -1.0, 1.0);
  return m;
}
constexpr int64_t kRows = 41;

// 160 tokens, the placeholders at [7, 7 + 41); targets random, one on a placeholder (it carries no loss).
struct Batch {
  std::vector<int32_t> ids, targets;
};
Batch batch(uint64_t seed) {
  Batch b;
  Rng r{seed, 3};
  for (int64_t i = 0; i < 160; ++i) {
    const bool ph = i >= 7 && i < 7 + kRows;
    b.ids.push_back(ph ? kPh : static_cast<int32_t>(r.bits(i).v[0] % 500));
    b.targets.push_back(static_cast<int32_t>(r.bits(i).v[1] % 500));
  }
  b.targets[20] = kPh;
  return b;
}

void round_weights_bf16(ParamStore<float>& ps) {
  for (auto& p : ps.all())
    for (int64_t i = 0; i < p.spec.numel(); ++i) p.w()[i] = bf16_to_f32(f32_to_bf16(p.w()[i]));
}

bool is_vision(const std::string& n) { return n.rfind("vision_tower.", 0) == 0 || n.rfind("mm_projector.", 0) == 0; }

}  // namespace

TEST(GpuVision, FeaturesLossAndEveryGradientMatchTheCpu) {
  REQUIRE_GPU();
  const ModelConfig c = multimodal();
  Model<float> cpu(c);
  cpu.params().init(21);
  round_weights_bf16(cpu.params());
  cpu.params().enable_grads();
  const Media<float> m = media(4);
  const Batch b = batch(5);
  const Seqs s = Seqs::batch(1, 160);
  int64_t rows_c = 0;
  const Buf<float> fc = cpu.media_features(m, &rows_c);
  const auto lc = cpu.forward_backward(b.ids.data(), b.targets.data(), s, 0, &m);

  cuda::GpuModel gpu(c);
  gpu.upload(cpu.params());
  int64_t rows_g = 0;
  const std::vector<float> fg = gpu.media_features(m, &rows_g);
  ASSERT_EQ(rows_g, kRows);
  ASSERT_EQ(rows_c, kRows);
  const double ef = lm::testing::rel_rms_vec(std::vector<float>(fc.begin(), fc.end()), fg);
  std::printf("features rel rms %.2e\n", ef);
  EXPECT_LT(ef, 2e-2);

  gpu.zero_grads();
  const auto lg = gpu.forward_backward(b.ids.data(), b.targets.data(), s, 0, &m);
  ASSERT_EQ(lg.n_valid, lc.n_valid);
  EXPECT_EQ(lg.n_valid, 160 - 1);  // the target naming the placeholder carries no loss
  const double mc = lc.loss_sum / lc.n_valid, mg = lg.loss_sum / lg.n_valid;
  std::printf("loss cpu %.6f gpu %.6f\n", mc, mg);
  EXPECT_LT(std::abs(mg - mc) / mc, 5e-3);

  Model<float> back(c);
  back.params().enable_grads();
  gpu.download_grads(back.params());
  int vision = 0;
  double worst = 0, worst_vision = 0;
  std::string worst_name;
  for (size_t t = 0; t < cpu.params().all().size(); ++t) {
    const auto& pc = cpu.params().all()[t];
    const auto& pg = back.params().all()[t];
    if (!pc.g()) continue;
    const std::vector<float> ref(pc.g(), pc.g() + pc.spec.numel()), got(pg.g(), pg.g() + pg.spec.numel());
    double rr = 0;
    for (float v : ref) rr += double(v) * v;
    ASSERT_TRUE(rr > 0 || !is_vision(pc.spec.name)) << pc.spec.name << " got no gradient on the CPU";
    if (rr == 0) continue;
    const double e = lm::testing::rel_rms_vec(ref, got);
    if (e > worst) worst = e, worst_name = pc.spec.name;
    vision += is_vision(pc.spec.name);
    // (A_log, and the gate's low-rank projections and dt_bias: the cancelling sums over tokens of
    // test_gpu_model_cuda.cpp; dt_bias measured 5.2e-2 here)
    const bool cancelling = pc.spec.name.find(".A_log") != std::string::npos;
    const bool gate_proj = pc.spec.name.find(".f_a_proj.") != std::string::npos ||
                           pc.spec.name.find(".f_b_proj.") != std::string::npos ||
                           pc.spec.name.find(".dt_bias") != std::string::npos;
    if (is_vision(pc.spec.name)) worst_vision = std::max(worst_vision, e);
    EXPECT_LT(e, cancelling ? 0.15 : gate_proj ? 8e-2 : 5e-2) << pc.spec.name;
  }
  std::printf("%d vision gradients compared, worst %.2e; worst of all %.2e (%s)\n", vision, worst_vision, worst,
              worst_name.c_str());
  EXPECT_EQ(vision, 2 * 6 + 6);  // every tower and projector tensor
}

// A prompt with images through prefill, whole and in 16-token chunks (an image's rows cut across four chunks), and
// a decode step after it, against the CPU Model's full forward over the same tokens.
TEST(GpuVision, PromptsWithImagesPrefillInChunksAndDecode) {
  REQUIRE_GPU();
  const ModelConfig c = multimodal();
  Model<float> cpu(c);
  cpu.params().init(22);
  round_weights_bf16(cpu.params());
  const Media<float> m = media(6);
  Batch b = batch(7);
  b.ids.resize(100);
  const int32_t next = 17;
  std::vector<int32_t> all = b.ids;
  all.push_back(next);
  ForwardOptions fo;
  fo.logits = true;
  ForwardResult<float> fr;
  cpu.forward(all.data(), Seqs::batch(1, std::ssize(all)), fo, &fr, &m);
  const int64_t V = c.vocab_size, n = std::ssize(b.ids);
  const std::vector<float> ref_last(fr.logits.begin() + (n - 1) * V, fr.logits.begin() + n * V);
  const std::vector<float> ref_next(fr.logits.begin() + n * V, fr.logits.begin() + (n + 1) * V);

  cuda::GpuModel gpu(c, cuda::GpuModel::Inference{});
  gpu.upload(cpu.params());
  gpu.reserve_caches(2, 256);
  const std::vector<float> feats = gpu.media_features(m);
  const std::vector<float> whole = gpu.prefill(0, b.ids.data(), n, nullptr, feats);
  gpu.prefill_chunk = 16;
  const std::vector<float> chunked = gpu.prefill(1, b.ids.data(), n, nullptr, feats);
  const double ew = lm::testing::rel_rms_vec(ref_last, whole), ec = lm::testing::rel_rms_vec(whole, chunked);
  std::printf("prefill vs cpu %.2e, chunked vs whole %.2e\n", ew, ec);
  EXPECT_LT(ew, 2e-2);
  EXPECT_LT(ec, 1e-2);
  const int32_t step[2] = {next, next};
  const std::vector<float> dec = gpu.decode(0, 2, step);
  const double ed = lm::testing::rel_rms_vec(ref_next, std::vector<float>(dec.begin(), dec.begin() + V));
  std::printf("decode after the images vs cpu %.2e\n", ed);
  EXPECT_LT(ed, 2e-2);

  // Bad calls are clear errors: a placeholder count that is not the rows', the placeholder as a decode token.
  const std::string few = lm::testing::error_of(
      [&] { gpu.prefill(0, b.ids.data(), n, nullptr, std::span<const float>(feats).first(feats.size() - 256)); });
  EXPECT_NE(few.find("41 media placeholder"), std::string::npos) << few;
  EXPECT_NE(lm::testing::error_of([&] { gpu.prefill(0, b.ids.data(), n); }).find("placeholder"), std::string::npos);
  gpu.prefill(0, b.ids.data(), n, nullptr, feats);
  const int32_t ph = kPh;
  EXPECT_NE(lm::testing::error_of([&] { gpu.decode(0, 1, &ph); }).find("media placeholder"), std::string::npos);
  Media<float> odd = m;
  odd.grids[0].h = 3;  // not a multiple of the 2x2 merge
  EXPECT_NE(lm::testing::error_of([&] { gpu.media_features(odd); }).find("merge"), std::string::npos);
}

// GpuEngine: images attached to a sequence fill its next prefills' placeholders (split across two calls), as the
// model given the rows directly; the rows are not keyed into the prefix cache.
TEST(GpuVision, EngineAttachesImages) {
  REQUIRE_GPU();
  const ModelConfig c = multimodal();
  Model<float> cpu(c);
  cpu.params().init(23);
  cuda::GpuModel gpu(c, cuda::GpuModel::Inference{});
  gpu.upload(cpu.params());
  const Media<float> m = media(8);
  const Batch b = batch(9);
  infer::GpuEngineOptions o;
  o.max_sequences = 2, o.context = 512, o.prefill_chunk = 32, o.prefix_cache_bytes = 64 << 20;
  infer::GpuEngine e(gpu, o);
  const auto id = e.open({}, 300);
  EXPECT_EQ(e.attach_media(id, m), kRows);
  const std::span<const int32_t> ids(b.ids);
  e.prefill(id, ids.first(30));
  const std::vector<float> lg = e.prefill(id, ids.subspan(30));
  const auto again = e.open({}, 300);
  e.attach_media(again, m);
  const std::vector<float> lg2 = e.prefill(again, ids);
  EXPECT_LT(lm::testing::rel_rms_vec(lg, lg2), 1e-2);
  EXPECT_EQ(e.prefix_stats().entries, 0);  // nothing with an image's rows is stored
  e.close(id), e.close(again);
  // Without the image the same tokens are an error.
  const auto none = e.open({}, 300);
  EXPECT_NE(lm::testing::error_of([&] { e.prefill(none, ids); }).find("placeholder"), std::string::npos);
}

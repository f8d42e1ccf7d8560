// The multimodal model (SPEC §9, issue 22 item 2): K3's config and checkpoint layout (text_config + vision_config,
// the text tensors under language_model.), the splice of the tower's features into the placeholder rows, its
// gradient into the tower (float64 finite differences), placeholder-count errors and no loss on placeholders.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include <unistd.h>

#include "infer/engine.hpp"
#include "infer/generate.hpp"
#include "infer/session.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "model/accounting.hpp"
#include "model/model.hpp"
#include "micro_models.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::model;
using namespace lm::testing::micro;
using lm::io::json;
using lm::testing::fd_check;
namespace fs = std::filesystem;

namespace {

// A tiny tower into kMicroK3's width d = 16: 2 blocks, D 8, 2 heads x 8, 2x2 patches of 2x2 px, a 4x4 table.
const char* kTinyVision = R"({
  "patch_size": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
  "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 8,
  "vt_intermediate_size": 12, "qkv_hidden_size": 16, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
  "mm_projector_type": "patchmergerv2", "mm_hidden_size": 8, "projector_hidden_act": "gelu",
  "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh",
  "text_hidden_size": 16 })";
constexpr int32_t kPh = 39;  // the placeholder: the last id of kMicroK3's 40

// kMicroK3 in K3's multimodal layout.
json multimodal_json() {
  return {{"architectures", {"KimiK3ForConditionalGeneration"}},
          {"model_type", "kimi_k3"},
          {"text_config", json::parse(kMicroK3)},
          {"vision_config", json::parse(kTinyVision)},
          {"media_placeholder_token_id", kPh}};
}
ModelConfig multimodal() { return ModelConfig::from_json(multimodal_json(), "multimodal test config"); }

// Two images: a 4x4-patch one (the table's own size) and a 2x6 one (the table resized): 4 + 3 = 7 feature rows.
template <class F>
Media<F> two_images(uint64_t seed) {
  Media<F> m;
  m.grids = {{1, 4, 4}, {1, 2, 6}};
  m.pixel_values = lm::testing::randu<F>(static_cast<size_t>((16 + 12) * 12), seed, -1.0, 1.0);
  return m;
}
constexpr int64_t kFeatureRows = 7;

// 16 tokens, the two images' placeholders at 2..5 and 8..10.
std::vector<int32_t> prompt() { return {5, 7, kPh, kPh, kPh, kPh, 9, 3, kPh, kPh, kPh, 11, 2, 8, 1, 4}; }
std::vector<int64_t> placeholder_rows() { return {2, 3, 4, 5, 8, 9, 10}; }

using lm::testing::error_of;

#define EXPECT_ERROR(stmt, ...)                                                     \
  do {                                                                              \
    const std::string msg_ = error_of([&] { stmt; });                                \
    EXPECT_FALSE(msg_.empty()) << "no error from " #stmt;                            \
    for (const char* part_ : {__VA_ARGS__}) EXPECT_NE(msg_.find(part_), std::string::npos) << msg_; \
  } while (0)

struct TmpDir {
  fs::path path;
  explicit TmpDir(const std::string& name) {
    path = fs::temp_directory_path() / fmt::format("longmoe-mm-{}-{}", name, ::getpid());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TmpDir() { fs::remove_all(path); }
};

// A checkpoint folder (config.json + safetensors) of `m` through the saver the trainer uses.
template <class F>
void save(const Model<F>& m, const fs::path& dir, uint64_t max_shard_bytes = uint64_t{1} << 30) {
  m.config().save((dir / "config.json").string());
  io::save_checkpoint(dir.string(), m.params().named(DType::F32), max_shard_bytes);
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------------------

TEST(Multimodal, ConfigIsWrittenInK3Layout) {
  const ModelConfig c = multimodal();
  ASSERT_TRUE(c.vision && c.vision->media_placeholder_token_id);
  EXPECT_EQ(*c.vision->media_placeholder_token_id, kPh);  // from the top level
  const json j = c.to_json();
  for (const char* k : {"text_config", "vision_config", "media_placeholder_token_id", "architectures", "model_type"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_FALSE(j.contains("hidden_size"));  // the text model's fields sit under text_config only
  EXPECT_FALSE(j.at("text_config").contains("vision_config"));
  EXPECT_EQ(j.at("text_config").at("hidden_size"), 16);
  EXPECT_EQ(j.at("architectures")[0], kMultimodalArchitecture);
  EXPECT_TRUE(ModelConfig::from_json(j, "round trip") == c);
  // A text-only config stays flat.
  const json t = parse(kMicroK3).to_json();
  EXPECT_FALSE(t.contains("text_config"));
  EXPECT_FALSE(t.contains("vision_config"));
  EXPECT_EQ(t.at("hidden_size"), 16);

  json bad = multimodal_json();
  bad["vision_config"]["media_placeholder_token_id"] = 38;
  EXPECT_ERROR(ModelConfig::from_json(bad, "cfg"), "media_placeholder_token_id", "disagree");
  bad = multimodal_json();
  bad["media_placeholder_token_id"] = 40;
  EXPECT_ERROR(ModelConfig::from_json(bad, "cfg"), "media_placeholder_token_id", "outside the vocabulary");
}

TEST(Multimodal, K3ConfigsParseAndCountTheTower) {
  LM_REQUIRE_GOLDEN(dir);
  const std::string shared = dir + "/../configs/kimi-k3.json";
  const fs::path shipped = fs::path(LONGMOE_SOURCE_DIR) / "configs" / "kimi-k3-vision.json";
  if (!fs::exists(shared) || !fs::exists(shipped)) GTEST_SKIP() << "kimi-k3.json or kimi-k3-vision.json not found";
  const ModelConfig text = ModelConfig::load(shared);
  EXPECT_FALSE(text.vision.has_value());
  // configs/kimi-k3-vision.json is K3's layout: the shared text model under text_config, the tower beside it.
  EXPECT_TRUE(lm::io::load_json_file(shipped.string()).contains("text_config"));
  ModelConfig mm = ModelConfig::load(shipped.string());
  ASSERT_TRUE(mm.vision.has_value());
  EXPECT_EQ(mm.vision->media_placeholder_token_id.value_or(-1), 163605);
  const VisionParamCounts vp = count_vision_params(*mm.vision);
  EXPECT_EQ(vp.tower, 401'214'464);  // ≈ 0.4B (SPEC §9)
  EXPECT_EQ(vp.projector, 46'144'512);
  mm.vision.reset();
  EXPECT_TRUE(mm == text);  // the same language model

  // `longmoe params` on both.
  if (!fs::exists(LONGMOE_BINARY)) GTEST_SKIP() << LONGMOE_BINARY << " is not built";
  auto run = [](const std::string& args) {
    const lm::testing::CliRun r = lm::testing::run_longmoe("params " + args);
    EXPECT_EQ(r.rc, 0) << r.out;
    return r.out;
  };
  const json jv = json::parse(run("--json --config '" + shipped.string() + "'"));
  EXPECT_EQ(jv.at("vision").at("tower"), 401'214'464);
  EXPECT_EQ(jv.at("vision").at("projector"), 46'144'512);
  EXPECT_EQ(jv.at("params").at("total"), count_params(text).total);  // text totals unchanged
  EXPECT_EQ(jv.at("vision").at("checkpoint_total"), count_params(text).total + vp.total());
  const std::string human = run("--config '" + shipped.string() + "'");
  EXPECT_NE(human.find("vision_tower"), std::string::npos) << human;
  EXPECT_NE(human.find("401214464 tower"), std::string::npos) << human;
  EXPECT_FALSE(json::parse(run("--json --config '" + shared + "'")).contains("vision"));
}

// ---- checkpoints -------------------------------------------------------------------------------------------

TEST(Multimodal, CheckpointRoundTripInK3Layout) {
  const ModelConfig c = multimodal();
  Model<float> m(c);
  m.params().init(7);
  for (uint64_t shard : {uint64_t{1} << 30, uint64_t{4096}}) {  // one file, and an index over several shards
    TmpDir tmp("rt");
    save(m, tmp.path, shard);
    const io::Checkpoint ck = io::Checkpoint::open(tmp.path.string());
    EXPECT_EQ(ck.size(), model_param_specs(c).size());
    EXPECT_EQ(ck.shards().size() > 1, shard < 1024 * 1024);
    for (const std::string& n : ck.names())
      EXPECT_TRUE(n.rfind("language_model.", 0) == 0 || n.rfind("vision_tower.", 0) == 0 ||
                  n.rfind("mm_projector.", 0) == 0)
          << n;
    for (const char* n : {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                          "language_model.model.layers.2.self_attn.kv_b_proj.weight",
                          "vision_tower.encoder.blocks.1.wqkv.weight", "mm_projector.proj.2.weight"})
      EXPECT_TRUE(ck.contains(n)) << n;
    EXPECT_TRUE(lm::io::load_json_file((tmp.path / "config.json").string()).contains("text_config"));
    // Loaded back through the generator's loader (header checks first, then the weights): bit-exact.
    const infer::LoadedModel lm = infer::load_model_dir(tmp.path.string(), /*need_tokenizer=*/false);
    EXPECT_TRUE(lm.config == c);
    ASSERT_EQ(lm.model->params().all().size(), m.params().all().size());
    for (size_t i = 0; i < m.params().all().size(); ++i) {
      const auto& a = m.params().all()[i];
      const auto& b = lm.model->params().all()[i];
      ASSERT_EQ(a.spec.name, b.spec.name);
      EXPECT_EQ(std::memcmp(a.w(), b.w(), size_t(a.value.numel()) * sizeof(float)), 0) << a.spec.name;
    }
  }
}

TEST(Multimodal, CheckpointsOfTheOtherLayoutOrIncompleteAreClearErrors) {
  const ModelConfig mm = multimodal(), text = parse(kMicroK3);
  Model<float> mmm(mm), tm(text);
  mmm.params().init(1), tm.params().init(2);
  TmpDir a("text"), b("mm"), c("partial");
  save(tm, a.path);
  save(mmm, b.path);
  Model<float> fresh(mm);
  const float before = fresh.params().all().front().w()[0];
  EXPECT_ERROR(fresh.params().load(io::Checkpoint::open(a.path.string())),
               "lacks tensor 'language_model.model.embed_tokens.weight'", "text-only layout");
  Model<float> fresh_text(text);
  EXPECT_ERROR(fresh_text.params().load(io::Checkpoint::open(b.path.string())), "lacks tensor 'model.embed_tokens.weight'",
               "no vision_config");
  EXPECT_ERROR(check_checkpoint(checkpoint_specs(text), io::Checkpoint::open(b.path.string())), "no vision_config");
  // A tensor missing, and one the config does not use.
  io::NamedTensors t = mmm.params().named();
  t.erase(std::find_if(t.begin(), t.end(), [](const auto& nt) { return nt.first == "mm_projector.post_norm.weight"; }));
  io::save_checkpoint(c.path.string(), t, uint64_t{1} << 30);
  EXPECT_ERROR(fresh.params().load(io::Checkpoint::open(c.path.string())), "lacks tensor 'mm_projector.post_norm.weight'");
  t = mmm.params().named();
  t.emplace_back("vision_tower.encoder.blocks.2.wqkv.weight", Tensor::zeros({48, 8}, DType::F32));
  io::save_checkpoint(c.path.string(), t, uint64_t{1} << 30);
  EXPECT_ERROR(fresh.params().load(io::Checkpoint::open(c.path.string())), "'vision_tower.encoder.blocks.2.wqkv.weight'",
               "does not use");
  EXPECT_EQ(fresh.params().all().front().w()[0], before);  // nothing was changed
}

TEST(Multimodal, TextOnlyModelsKeepTheirNamesAndInit) {
  const ModelConfig text = parse(kMicroK3), mm = multimodal();
  ParamStore<float> t(text), m(mm);
  EXPECT_FALSE(t.multimodal());
  EXPECT_TRUE(m.multimodal());
  const auto specs = param_specs(text);
  const io::NamedTensors named = t.named();
  ASSERT_EQ(named.size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) EXPECT_EQ(named[i].first, specs[i].name);  // unprefixed
  // The text tensors of a multimodal model draw the same initial values as the text-only model's.
  t.init(3), m.init(3);
  for (const auto& p : t.all())
    EXPECT_EQ(std::memcmp(p.w(), m.at(p.spec.name).w(), size_t(p.value.numel()) * sizeof(float)), 0) << p.spec.name;
}

// ---- the splice --------------------------------------------------------------------------------------------

// The spliced forward equals a text-only model whose vocabulary has one extra token per feature row, embedded as
// that row (features computed by the float64 reference tower), with those tokens in place of the placeholders.
TEST(Multimodal, SpliceReplacesThePlaceholderEmbeddings) {
  const ModelConfig c = multimodal();
  Model<double> m(c);
  randomise(m.params(), 21);
  const Media<double> media = two_images<double>(5);
  const auto ids = prompt();
  const Seqs s = Seqs::packed({0, 7, 16});  // two sequences, an image in each
  ForwardResult<double> out;
  m.forward(ids.data(), s, ForwardOptions{false, true, false}, &out, &media);

  const VisionConfig& v = *c.vision;
  ParamStore<double> vps(vision_param_specs(v));
  for (auto& p : vps.all()) p.value.copy_from(m.params().at(p.spec.name).value);
  const VisionBatch b = VisionBatch::make(v, media.grids, 28);
  ASSERT_EQ(b.merged(), kFeatureRows);
  const VisionTrace<double> ref = vision_reference_forward(v, vps, media.pixel_values.data(), b);

  ModelConfig tc = c;
  tc.vision.reset();
  const int64_t V = c.vocab_size, d = c.hidden_size;
  tc.vocab_size = V + kFeatureRows;
  Model<double> t(tc);
  for (auto& p : t.params().all()) {
    const auto& src = m.params().at(p.spec.name);
    if (p.spec.name == "model.embed_tokens.weight" || p.spec.name == "lm_head.weight") {
      p.value.zero();
      std::copy_n(src.w(), V * d, p.w());
    } else {
      p.value.copy_from(src.value);
    }
  }
  double* E = t.params().w("model.embed_tokens.weight");
  std::copy_n(ref.features.data(), kFeatureRows * d, E + V * d);
  auto manual_ids = ids;
  const auto rows = placeholder_rows();
  for (size_t j = 0; j < rows.size(); ++j) manual_ids[size_t(rows[j])] = static_cast<int32_t>(V + int64_t(j));
  ForwardResult<double> want;
  t.forward(manual_ids.data(), s, ForwardOptions{false, true, false}, &want);
  EXPECT_LT(lm::testing::rel_rms_vec(want.final_hidden, out.final_hidden), 1e-10);
  for (int64_t r = 0; r < s.rows(); ++r)
    for (int64_t k = 0; k < V; ++k)
      ASSERT_NEAR(out.logits[size_t(r * V + k)], want.logits[size_t(r * tc.vocab_size + k)], 1e-9) << r << " " << k;

  // The placeholder's own embedding row never reaches the decoder.
  double* Em = m.params().w("model.embed_tokens.weight");
  for (int64_t k = 0; k < d; ++k) Em[kPh * d + k] += 10.0;
  ForwardResult<double> again;
  m.forward(ids.data(), s, ForwardOptions{false, true, false}, &again, &media);
  EXPECT_EQ(again.final_hidden, out.final_hidden);
}

// Central differences of the loss through the splice: every trainable tensor of the tower, the projector and the
// decoder (a few entries each), and no gradient into the placeholder's embedding row.
TEST(Multimodal, GradientsThroughTheSpliceMatchFiniteDifferences) {
  const ModelConfig c = multimodal();
  Model<double> m(c);
  randomise(m.params(), 31);
  m.params().enable_grads();
  const Media<double> media = two_images<double>(9);
  const auto ids = prompt();
  const Seqs s = Seqs::batch(1, 16);
  auto targets = random_ids(16, c.vocab_size - 1, 33);
  for (int64_t r : placeholder_rows()) targets[size_t(r - 1)] = kPh;  // the shifted labels: predict the next token
  m.forward_backward(ids.data(), targets.data(), s, 0, &media);
  auto loss = [&] {
    const auto st = m.loss(ids.data(), targets.data(), s, &media);
    return st.loss_sum / static_cast<double>(st.n_valid);
  };
  int tower = 0, text = 0;
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
    ++(is_vision_component(p.spec.component) ? tower : text);
  }
  EXPECT_EQ(tower, 18);  // patch embed, position table, 2 x 6 per block, final norm, 3 projector tensors
  EXPECT_GT(text, 40);
  // The tower did get a gradient (a splice that dropped it would leave zeros, which central differences reject
  // above); the placeholder's embedding row got none.
  const double* gE = m.params().g("model.embed_tokens.weight");
  const int64_t d = c.hidden_size;
  for (int64_t k = 0; k < d; ++k) EXPECT_EQ(gE[kPh * d + k], 0.0) << k;
  double tower_norm = 0;
  for (int64_t i = 0; i < m.params().at("vision_tower.patch_embed.proj.weight").value.numel(); ++i)
    tower_norm += std::abs(m.params().g("vision_tower.patch_embed.proj.weight")[i]);
  EXPECT_GT(tower_norm, 0);
}

TEST(Multimodal, PlaceholderCountMustEqualTheFeatureRows) {
  const ModelConfig c = multimodal();
  Model<float> m(c);
  m.params().init(4);
  const Media<float> media = two_images<float>(2);
  auto ids = prompt();
  const Seqs s = Seqs::batch(1, 16);
  ForwardResult<float> out;
  EXPECT_NO_THROW(m.forward(ids.data(), s, ForwardOptions{}, &out, &media));
  ids[10] = 3;  // one placeholder short
  EXPECT_ERROR(m.forward(ids.data(), s, ForwardOptions{}, &out, &media), "6 media placeholder token(s) (id 39)",
               "7 feature rows");
  ids[10] = kPh, ids[12] = kPh;  // one too many
  EXPECT_ERROR(m.forward(ids.data(), s, ForwardOptions{}, &out, &media), "8 media placeholder", "7 feature rows");
  ids = prompt();
  EXPECT_ERROR(m.forward(ids.data(), s, ForwardOptions{}, &out), "7 media placeholder token(s)", "no image");
  Media<float> torn = media;
  torn.pixel_values.pop_back();
  EXPECT_ERROR(m.forward(ids.data(), s, ForwardOptions{}, &out, &torn), "pixel_values", "whole number of patches");
  torn = media;
  torn.grids[1].w = 8;  // the grid no longer matches the pixels
  EXPECT_ERROR(m.forward(ids.data(), s, ForwardOptions{}, &out, &torn), "grids");
  // A text-only model takes no images, and reads the id as an ordinary token.
  Model<float> t(parse(kMicroK3));
  EXPECT_ERROR(t.forward(ids.data(), s, ForwardOptions{}, &out, &media), "no vision tower");
  EXPECT_NO_THROW(t.forward(ids.data(), s, ForwardOptions{}, &out));
}

TEST(Multimodal, PlaceholderTargetsCarryNoLoss) {
  const ModelConfig c = multimodal();
  Model<double> m(c);
  randomise(m.params(), 41);
  m.params().enable_grads();
  const Media<double> media = two_images<double>(3);
  const auto ids = prompt();
  const Seqs s = Seqs::batch(1, 16);
  std::vector<int32_t> labelled(ids.begin() + 1, ids.end());  // next-token targets: 7 of them name the placeholder
  labelled.push_back(-100);
  auto masked = labelled;
  std::replace(masked.begin(), masked.end(), kPh, -1);
  EXPECT_EQ(m.count_targets(labelled.data(), 16), 15 - kFeatureRows);
  const auto a = m.loss(ids.data(), labelled.data(), s, &media);
  const auto b = m.loss(ids.data(), masked.data(), s, &media);
  EXPECT_EQ(a.n_valid, 15 - kFeatureRows);  // the last placeholder of each image still predicts the text after it
  EXPECT_EQ(a.n_valid, b.n_valid);
  EXPECT_EQ(a.loss_sum, b.loss_sum);
  // The same gradients as with the placeholders' targets ignored by hand.
  m.params().zero_grads();
  m.forward_backward(ids.data(), labelled.data(), s, 0, &media);
  std::vector<std::vector<double>> ga;
  for (const auto& p : m.params().all())
    if (p.g()) ga.emplace_back(p.g(), p.g() + p.value.numel());
  m.params().zero_grads();
  m.forward_backward(ids.data(), masked.data(), s, 0, &media);
  size_t i = 0;
  for (const auto& p : m.params().all())
    if (p.g()) {
      EXPECT_EQ(std::vector<double>(p.g(), p.g() + p.value.numel()), ga[i++]) << p.spec.name;
    }
}

// The inference session's prefill with images equals the model's forward on the same spliced input: the features
// attached to the sequence (Model::media_features) take the placeholders' rows, in order, across prefill chunks that
// cut an image (chunk 5: the 16 tokens run as 5 + 5 + 5 + 1), and continue into decode.
TEST(Multimodal, SessionPrefillWithImagesEqualsTheForward) {
  const ModelConfig c = multimodal();
  Model<float> m(c);
  randomise(m.params(), 51);
  const Media<float> media = two_images<float>(13);
  const auto ids = prompt();
  ForwardResult<float> want;
  m.forward(ids.data(), Seqs::batch(1, 16), ForwardOptions{false, true, false}, &want, &media);

  infer::Session s(m, infer::SessionOptions{5, 0, 1 << 20});
  infer::Sequence seq = s.new_sequence();
  int64_t rows = 0;
  const std::vector<float> f = m.media_features(media, &rows);
  ASSERT_EQ(rows, kFeatureRows);
  s.attach_media(seq, f);
  std::vector<float> got;
  s.prefill(seq, ids, &got);
  const int64_t V = c.vocab_size;
  ASSERT_EQ(got.size(), want.logits.size());
  EXPECT_LT(lm::testing::rel_rms_vec(want.logits, got), 1e-5);
  EXPECT_EQ(seq.media_taken, kFeatureRows);
  EXPECT_FALSE(seq.on_grid);  // never a prefix snapshot: the cache is keyed on tokens alone
  EXPECT_EQ(s.prefix_stats().entries, 0);

  // A decode step after it equals the forward over the 17 tokens.
  auto ids17 = ids;
  ids17.push_back(6);
  ForwardResult<float> want17;
  m.forward(ids17.data(), Seqs::batch(1, 17), ForwardOptions{false, true, false}, &want17, &media);
  const std::vector<float> step = s.decode({&seq}, std::vector<int32_t>{6});
  const std::vector<float> last(want17.logits.end() - V, want17.logits.end());
  EXPECT_LT(lm::testing::rel_rms_vec(last, step), 1e-5);

  // Text before an image in one call, the image in a later one (images attached in between): the same logits.
  infer::Sequence seq3 = s.new_sequence();
  s.prefill(seq3, std::span(ids).first(2));
  s.attach_media(seq3, std::span(f).first(4 * c.hidden_size));
  s.prefill(seq3, std::span(ids).subspan(2, 6));
  s.attach_media(seq3, std::span(f).subspan(4 * c.hidden_size));
  const std::vector<float> tail = s.prefill(seq3, std::span(ids).subspan(8));
  const std::vector<float> last16(want.logits.end() - V, want.logits.end());
  EXPECT_LT(lm::testing::rel_rms_vec(last16, tail), 1e-5);
}

// Placeholders beyond the attached rows, in decode, or for a model without a tower are clear errors that change
// nothing; the engine attaches through the model's tower.
TEST(Multimodal, SessionRefusesPlaceholdersWithoutImages) {
  Model<float> m(multimodal());
  m.params().init(8);
  infer::Session s(m);
  infer::Sequence seq = s.new_sequence();
  const std::vector<int32_t> text = {5, 7, 9, 3};
  EXPECT_EQ(s.prefill(seq, text).size(), 40u);
  infer::Sequence seq2 = s.new_sequence();
  const std::vector<int32_t> with_image = {5, kPh, kPh, kPh, kPh, 3};
  EXPECT_ERROR(s.prefill(seq2, with_image), "media placeholder", "0 image feature row(s) are attached");
  s.attach_media(seq2, std::vector<float>(3 * 16, 0.5f));
  EXPECT_ERROR(s.prefill(seq2, with_image), "media placeholder", "3 image feature row(s)");
  EXPECT_EQ(seq2.pos(), 0);
  EXPECT_EQ(seq2.media_taken, 0);
  EXPECT_ERROR(s.decode({&seq}, std::vector<int32_t>{kPh}), "media placeholder");
  EXPECT_EQ(seq.pos(), 4);
  EXPECT_ERROR(s.attach_media(seq2, std::vector<float>(7, 0.f)), "not whole feature rows");

  infer::CpuEngine e(s);
  const auto id = e.open();
  EXPECT_EQ(e.attach_media(id, two_images<float>(3)), kFeatureRows);
  EXPECT_ERROR(e.attach_media(id, Media<float>{{1.f, 2.f}, {{1, 2, 2}}}), "pixel_values");

  Model<float> t(ModelConfig::from_json(json::parse(kMicroK3), "text"));
  t.params().init(8);
  EXPECT_ERROR(t.media_features(two_images<float>(3)), "no vision tower");
}

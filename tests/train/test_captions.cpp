// Images through the trainer (issue 22 item 4): captioned Fashion-MNIST-style documents (train/captions.hpp) hold
// whole documents whose placeholders match their images and whose captions name the image's class; a tiny joint run
// trains the tower and resumes exactly.
#include <gtest/gtest.h>

#include <zlib.h>

#include <algorithm>
#include <regex>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "infer/generate.hpp"
#include "io/idx.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "model/model.hpp"
#include "train/captions.hpp"
#include "train/tiny_run.hpp"
#include "train/trainer.hpp"
#include "testing.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;

namespace {

// A 2-block tower into the tiny model's d = 32: 14 px patches, a 2x2 position table (28 px images: 1 feature row;
// 56 px: 4).
const char* kTowerJson = R"({
  "patch_size": 14, "init_pos_emb_height": 2, "init_pos_emb_width": 2, "init_pos_emb_time": 1,
  "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
  "vt_intermediate_size": 24, "qkv_hidden_size": 16, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
  "mm_projector_type": "patchmergerv2", "mm_hidden_size": 16, "projector_hidden_act": "gelu",
  "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": 32 })";

io::json multimodal_model() {
  return {{"architectures", {"KimiK3ForConditionalGeneration"}},
          {"model_type", "kimi_k3"},
          {"text_config", io::json::parse(tiny::kTinyModel)},
          {"vision_config", io::json::parse(kTowerJson)}};
}

void write_gz(const fs::path& p, const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims)
    for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((d >> (8 * k)) & 0xFF));
  s.append(data.begin(), data.end());
  gzFile f = gzopen(p.string().c_str(), "wb");
  gzwrite(f, s.data(), static_cast<unsigned>(s.size()));
  gzclose(f);
}

// `n` 28x28 items whose grey level tells their label: item i has label i % 10 and every pixel 20·label + 30.
void write_fashion(const fs::path& dir, const std::string& split, uint32_t n) {
  fs::create_directories(dir);
  std::vector<uint8_t> px, lb;
  for (uint32_t i = 0; i < n; ++i) {
    lb.push_back(static_cast<uint8_t>(i % 10));
    px.insert(px.end(), 784, static_cast<uint8_t>(20 * (i % 10) + 30));
  }
  write_gz(dir / (split + "-images-idx3-ubyte.gz"), {n, 28, 28}, px);
  write_gz(dir / (split + "-labels-idx1-ubyte.gz"), {n}, lb);
}

int label_of_pixel(float v) { return static_cast<int>(std::lround(((v * 0.5 + 0.5) * 255.0 - 30.0) / 20.0)); }

struct Fixture {
  const lm::testing::ScratchDir scratch{"lm_captions"};
  const fs::path& root = scratch.path;
  io::Tokenizer tok;
  model::ModelConfig cfg;
  Fixture() : tok(make_tok()) {
    cfg = model::ModelConfig::from_json(multimodal_model(), "test");
    cfg.vocab_size = tok.vocab_size();
    cfg.vision->media_placeholder_token_id = tok.special("<|image|>");
  }
  io::Tokenizer make_tok() {
    fs::create_directories(root);
    std::vector<std::string> texts;
    for (const auto& t : CaptionData::templates())
      for (const auto& c : io::fashion_mnist_classes()) texts.push_back(t + " " + c + " the cat sat on the mat.");
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 320;
    o.image = true;
    return io::Tokenizer::train(texts, (root / "tok.model").string(), o);
  }
};

}  // namespace

TEST(Captions, ParseClass) {
  EXPECT_EQ(CaptionData::parse_class(" a sneaker."), 7);
  EXPECT_EQ(CaptionData::parse_class(" a shirt. And"), 6);
  EXPECT_EQ(CaptionData::parse_class(" a t-shirt."), 0);
  EXPECT_EQ(CaptionData::parse_class(" an ankle boot."), 9);
  EXPECT_EQ(CaptionData::parse_class(" a bag"), 8);
  EXPECT_EQ(CaptionData::parse_class(" a bagel."), -1);
  EXPECT_EQ(CaptionData::parse_class(" sneaker."), -1);
  EXPECT_EQ(CaptionData::parse_class(""), -1);
  EXPECT_EQ(with_article("ankle boot"), "an ankle boot");
}

// Sequences of whole documents: <s>, one placeholder per feature row of the document's image, a caption naming that
// image's class, <|doc|>; the images in placeholder order; padding without targets; a pure function of the step.
TEST(Captions, BatchHoldsWholeCaptionedDocuments) {
  Fixture f;
  write_fashion(f.root / "fm", "train", 40);
  const CaptionData cd(io::read_fashion_mnist((f.root / "fm").string(), "train"), f.tok, f.cfg, 56, 7);
  ASSERT_EQ(cd.rows_per_image(), 4);
  const int64_t T = 96, n = 3;
  const ImageBatch b = cd.batch(5, n, T);
  ASSERT_EQ(b.batch.tokens(), n * T);
  ASSERT_EQ(b.batch.targets.size(), b.batch.ids.size());
  const int32_t ph = f.tok.special("<|image|>"), doc = f.tok.special("<|doc|>");
  const auto placeholders = std::count(b.batch.ids.begin(), b.batch.ids.end(), ph);
  EXPECT_EQ(placeholders, 4 * b.images());
  EXPECT_EQ(infer::media_rows(*f.cfg.vision, b.media), placeholders);
  EXPECT_GE(b.images(), n);  // at least one document per sequence
  const int64_t P = f.cfg.vision->patch_dim();
  ASSERT_EQ(static_cast<int64_t>(b.media.pixel_values.size()), b.images() * 16 * P);
  // Each segment: a document (checked) or the padding at a sequence's end.
  const auto& cu = b.batch.cu_seqlens;
  ASSERT_EQ(cu.back(), n * T);
  int64_t image = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const std::vector<int32_t> ids(b.batch.ids.begin() + cu[s], b.batch.ids.begin() + cu[s + 1]);
    EXPECT_EQ(cu[s] / T, (cu[s + 1] - 1) / T) << "a segment crosses a sequence boundary";
    EXPECT_EQ(b.batch.targets[size_t(cu[s + 1] - 1)], kIgnore);
    if (ids[0] == f.tok.pad()) {
      for (size_t k = 0; k < ids.size(); ++k) EXPECT_EQ(b.batch.targets[size_t(cu[s]) + k], kIgnore);
      continue;
    }
    ASSERT_EQ(ids[0], f.tok.bos());
    ASSERT_EQ(ids.back(), doc);
    for (int k = 1; k <= 4; ++k) ASSERT_EQ(ids[size_t(k)], ph);
    for (size_t k = 0; k + 1 < ids.size(); ++k) EXPECT_EQ(b.batch.targets[size_t(cu[s]) + k], ids[k + 1]);
    const std::string text = f.tok.decode(std::vector<int32_t>(ids.begin() + 5, ids.end() - 1));
    const int label = label_of_pixel(b.media.pixel_values[size_t(image * 16 * P)]);
    const std::string name = with_article(io::fashion_mnist_classes()[size_t(label)]);
    EXPECT_NE(text.find(" " + name + "."), std::string::npos) << text << " for label " << label;
    ++image;
  }
  EXPECT_EQ(image, b.images());
  const ImageBatch again = cd.batch(5, n, T), other = cd.batch(6, n, T);
  EXPECT_EQ(again.batch.ids, b.batch.ids);
  EXPECT_EQ(again.media.pixel_values, b.media.pixel_values);
  EXPECT_NE(other.batch.ids, b.batch.ids);
  EXPECT_THROW(cd.batch(5, 1, 12), Error);  // a document does not fit
  int64_t longest = 0;
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t i = 0; i < 10; ++i) longest = std::max<int64_t>(longest, std::ssize(cd.document(i, t)));
  EXPECT_EQ(cd.longest_document(), longest);
  // The evaluation prompt: <s>, the image's rows, the first template's opening.
  const auto prompt = cd.class_prompt();
  EXPECT_EQ(std::count(prompt.begin(), prompt.end(), ph), 4);
  EXPECT_EQ(f.tok.decode(std::vector<int32_t>(prompt.begin() + 5, prompt.end())), " This is a picture of");
}

// A tiny joint run: the tower's weights move (its gradient arrives through the splice), the checkpoint is the
// multimodal layout with the tokenizer's <|image|> as placeholder, and a resumed run repeats the losses exactly.
TEST(Captions, JointRunTrainsTheTowerAndResumesExactly) {
  const lm::testing::ScratchDir scratch("lm_captions_run");
  const fs::path& root = scratch.path;
  fs::create_directories(root);
  write_fashion(root / "fm", "train", 50);
  std::ofstream(root / "mm.json") << multimodal_model().dump();
  tiny::make_corpus(root / "corpus");
  auto config = [&](const std::string& out) {
    io::json j = io::json::parse(R"({
      "model": "", "data": {"path": "", "format": "folder", "heldout_fraction": 0.1,
                             "images": {"path": "", "size": 28, "fraction": 0.25}},
      "tokenizer": {"vocab_size": 320}, "seed": 3,
      "optimizer": {"kind": "muon", "lr_adamw": 3e-3, "lr_muon": 3e-3},
      "balance": {"kind": "qb"},
      "stages": [{"seq_len": 96, "tokens": 6144, "batch_seqs": 8, "micro_seqs": 2}],
      "eval_every": 0, "eval_batches": 1, "save_every": 3 })");
    j["model"] = (root / "mm.json").string();
    j["data"]["path"] = (root / "corpus").string();
    j["data"]["images"]["path"] = (root / "fm").string();
    j["out"] = (root / out).string();
    return RunConfig::from_json(j, "tiny joint run");
  };
  TrainOptions quiet;
  quiet.quiet = true;
  const TrainResult full = train::train(config("full"), quiet);
  ASSERT_EQ(full.steps, 8);
  EXPECT_LT(full.losses.back(), full.losses.front());
  const model::ModelConfig mc = model::ModelConfig::load((root / "full").string());
  ASSERT_TRUE(mc.vision && mc.vision->media_placeholder_token_id);
  const io::Tokenizer tok = io::Tokenizer::load((root / "full" / "tokenizer.model").string());
  EXPECT_EQ(*mc.vision->media_placeholder_token_id, tok.special("<|image|>"));
  // The tower moved from its initialisation.
  model::Model<float> init(mc), trained(mc);
  init.params().init(3);
  trained.params().load(io::Checkpoint::open(full.checkpoint));
  for (const char* n : {"vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.proj.weight",
                        "mm_projector.proj.0.weight"}) {
    const auto& a = init.params().at(n);
    const auto& b = trained.params().at(n);
    EXPECT_NE(std::vector<float>(a.w(), a.w() + a.value.numel()), std::vector<float>(b.w(), b.w() + b.value.numel()))
        << n;
  }
  // `longmoe eval --classify` on the trained checkpoint: every test image answered and counted once.
  if (fs::exists(LONGMOE_BINARY)) {
    write_fashion(root / "fm", "t10k", 20);
    const auto eval = [&](const std::string& images, int* rc) {
      const lm::testing::CliRun r = lm::testing::run_longmoe("eval --model '" + (root / "full").string() +
                                                             "' --classify '" + (root / "fm").string() +
                                                             "' --image-size 28 --images " + images);
      *rc = r.rc;
      return r.out;
    };
    int rc = 0;
    const std::string out = eval("20", &rc);
    ASSERT_EQ(rc, 0) << out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(accuracy [0-9.]+% \(([0-9]+) / 20; chance 10%\))"))) << out;
    EXPECT_LE(std::stoi(m[1]), 20);
    int per_class = 0;  // the class lines: "  <name>  x% of N"
    const std::regex of(R"(% of ([0-9]+))");
    for (std::sregex_iterator i(out.begin(), out.end(), of), e; i != e; ++i)
      per_class += std::stoi((*i)[1]);
    EXPECT_EQ(per_class, 20) << out;
    EXPECT_NE(eval("21", &rc).find("--images 21 outside [1, 20]"), std::string::npos);
    EXPECT_NE(rc, 0);
  }

  RunConfig part = config("part");
  part.max_steps = 5;
  const TrainResult first = train::train(part, quiet);
  part.max_steps = 0;
  TrainOptions resume = quiet;
  resume.resume = true;
  const TrainResult rest = train::train(part, resume);
  std::vector<double> joined = first.losses;
  joined.insert(joined.end(), rest.losses.begin(), rest.losses.end());
  ASSERT_EQ(joined.size(), full.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;

  // Sequences too short for an image document, and a text-only model config with images, are refused before
  // training.
  RunConfig short_seq = config("short");
  short_seq.stages[0].seq_len = 24;
  short_seq.stages[0].tokens = 24 * 8;
  EXPECT_THROW(train::train(short_seq, quiet), Error);
  EXPECT_FALSE(fs::exists(root / "short" / "metrics.jsonl"));
  RunConfig text = config("text");
  text.model = (root / "tiny.json").string();
  std::ofstream(root / "tiny.json") << tiny::kTinyModel;
  EXPECT_THROW(train::train(text, quiet), Error);
}

// Generation helpers (see generate.hpp).
#include "infer/generate.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.hpp"
#include "io/checkpoint.hpp"
#include "io/image.hpp"

namespace lm::infer {

LoadedModel load_model_dir(const std::string& path, bool need_tokenizer) {
  namespace fs = std::filesystem;
  LM_CHECK(fs::is_directory(path), "checkpoint directory {} does not exist", path);
  LoadedModel lm;
  lm.name = fs::path(path).lexically_normal().filename().string();
  if (lm.name.empty() || lm.name == ".") lm.name = fs::path(path).lexically_normal().parent_path().filename().string();
  const std::string dir = io::resolve_checkpoint(path);
  lm.dir = dir;
  lm.config = model::ModelConfig::load(dir);
  // The weights' shapes and dtypes against the config from the headers, before the model is allocated.
  const io::Checkpoint ckpt = io::Checkpoint::open(dir);
  model::check_checkpoint(model::checkpoint_specs(lm.config), ckpt);
  lm.model = std::make_unique<model::Model<float>>(lm.config);
  lm.model->params().load(ckpt);
  const std::string tp = (fs::path(dir) / "tokenizer.model").string();
  if (fs::exists(tp)) {
    lm.tokenizer = std::make_shared<io::Tokenizer>(io::Tokenizer::load(tp));
    LM_CHECK(lm.tokenizer->vocab_size() <= lm.config.vocab_size,
             "{}: the tokenizer has {} tokens but the model's vocabulary is {}", tp, lm.tokenizer->vocab_size(),
             lm.config.vocab_size);
  } else {
    LM_CHECK(!need_tokenizer, "{} is missing (a checkpoint directory needs config.json, model.safetensors and "
             "tokenizer.model)", tp);
  }
  return lm;
}

LoadedModel random_model(const std::string& config, const std::string& tokenizer_path, uint64_t seed,
                         bool host_weights) {
  LoadedModel lm;
  lm.dir = config;
  lm.name = "random";
  lm.config = model::ModelConfig::load(config);
  if (host_weights) {
    lm.model = std::make_unique<model::Model<float>>(lm.config);
    lm.model->params().init(seed);
  }
  lm.tokenizer = std::make_shared<io::Tokenizer>(io::Tokenizer::load(tokenizer_path));
  LM_CHECK(lm.tokenizer->vocab_size() <= lm.config.vocab_size,
           "{}: the tokenizer has {} tokens but the model's vocabulary is {}", tokenizer_path,
           lm.tokenizer->vocab_size(), lm.config.vocab_size);
  return lm;
}

Generation::Generation(const io::Tokenizer* tok, SamplingParams p, std::vector<int32_t> history, uint64_t stream)
    : tok_(tok), sampler_(p, stream), stream_(p.stop), history_(std::move(history)) {}

std::string Generation::decoded() const { return tok_ ? tok_->decode(generated_) : std::string(); }

Generation::Step Generation::next(const float* logits, int64_t V) {
  Step st;
  if (done()) return st;
  // A model vocabulary larger than the tokenizer's (padded embeddings): only the tokenizer's ids.
  if (tok_) V = std::min<int64_t>(V, tok_->vocab_size());
  const int32_t t = sampler_.sample(logits, V, history_, sampler_.params().top_logprobs >= 0 ? &st.lp : nullptr);
  if (sampler_.is_stop_token(t)) {
    st.text = stream_.finish(decoded());
    finish_reason_ = "stop";
    st.done = true;
    return st;
  }
  generated_.push_back(t);
  history_.push_back(t);
  st.emitted = t;
  st.text = stream_.update(decoded());
  if (stream_.stopped()) {
    finish_reason_ = "stop";
    st.done = true;
    return st;
  }
  if (static_cast<int64_t>(generated_.size()) >= sampler_.params().max_tokens) {
    st.text += stream_.finish(decoded());
    finish_reason_ = "length";
    st.done = true;
  }
  // The last token is never fed back: nothing needs its logits. A stop string ends it as well.
  st.token = st.done ? -1 : t;
  return st;
}

std::string Generation::finish(const std::string& reason) {
  if (done()) return {};
  finish_reason_ = reason;
  return stream_.finish(decoded());
}

model::Media<float> image_media(std::string_view bytes, const std::string& ctx, const model::VisionConfig& v,
                                const ImageLimits& lim) {
  LM_CHECK(v.merge_h == v.merge_w, "{}: merge kernel {}x{} is not square (images are cut for square merges)", ctx,
           v.merge_h, v.merge_w);
  io::Image img = io::decode_image(bytes, ctx, lim.max_pixels);
  if (const int64_t side = std::min(img.width, img.height); lim.min_side > 0 && side < lim.min_side) {
    const double s = double(lim.min_side) / double(side);
    img = io::resize_image(img, std::max<int64_t>(lim.min_side, std::llround(double(img.width) * s)),
                           std::max<int64_t>(lim.min_side, std::llround(double(img.height) * s)));
  }
  io::ImagePatches p = io::image_patches(img, v.patch_size, v.merge_h, lim.max_patches);
  model::Media<float> m;
  m.grids.push_back({p.t, p.h, p.w});
  m.pixel_values = std::move(p.pixel_values);
  return m;
}

int32_t image_token(const model::ModelConfig& c, const io::Tokenizer& tok) {
  LM_CHECK(c.vision.has_value(), "this model has no vision tower (its config has no vision_config); it takes no images");
  LM_CHECK(c.vision->media_placeholder_token_id.has_value(),
           "this model's config sets no media_placeholder_token_id; it cannot take images");
  LM_CHECK(tok.has_special("<|image|>"), "the model's tokenizer has no <|image|> token; it cannot take images");
  const int32_t id = tok.special("<|image|>");
  LM_CHECK(id == *c.vision->media_placeholder_token_id,
           "the tokenizer's <|image|> is id {} but the model's media_placeholder_token_id is {}", id,
           *c.vision->media_placeholder_token_id);
  return id;
}

std::vector<int32_t> expand_placeholders(std::span<const int32_t> ids, int32_t placeholder,
                                         std::span<const int64_t> rows) {
  const auto markers = std::count(ids.begin(), ids.end(), placeholder);
  LM_CHECK(markers == std::ssize(rows), "the prompt has {} <|image|> marker(s) for {} image(s)", markers, rows.size());
  std::vector<int32_t> out;
  size_t k = 0;
  for (const int32_t t : ids) {
    if (t == placeholder) out.insert(out.end(), static_cast<size_t>(rows[k++]), placeholder);
    else out.push_back(t);
  }
  return out;
}

void place_images(std::vector<int32_t>& ids, int32_t after, int32_t placeholder, int64_t n) {
  if (n == 0 || std::find(ids.begin(), ids.end(), placeholder) != ids.end()) return;
  auto at = ids.begin();
  if (after >= 0)
    if (auto r = std::find(ids.rbegin(), ids.rend(), after); r != ids.rend()) at = r.base();
  ids.insert(at, static_cast<size_t>(n), placeholder);
}

std::vector<int32_t> attach_images(SequenceEngine& seq, std::span<const int32_t> ids, int32_t placeholder,
                                   const std::vector<model::Media<float>>& images) {
  const auto markers = std::count(ids.begin(), ids.end(), placeholder);
  LM_CHECK(markers == std::ssize(images), "the prompt has {} <|image|> marker(s) for {} image(s)", markers,
           images.size());
  std::vector<int64_t> rows;
  for (const auto& m : images) rows.push_back(seq.attach_media(m));
  return expand_placeholders(ids, placeholder, rows);
}

int64_t media_rows(const model::VisionConfig& v, const model::Media<float>& media) {
  int64_t M = 0;
  for (const auto& g : media.grids) M += (g.h / v.merge_h) * (g.w / v.merge_w);
  return M;
}

Generation generate(SequenceEngine& seq, const io::Tokenizer& tok, const std::vector<int32_t>& prompt,
                    const SamplingParams& p, const std::function<void(const std::string&)>& on_text) {
  std::vector<int32_t> history = seq.tokens();
  history.insert(history.end(), prompt.begin(), prompt.end());
  Generation g(&tok, p, std::move(history));
  std::vector<float> logits = seq.prefill(prompt);
  while (true) {
    const Generation::Step st = g.next(logits.data(), seq.vocab_size());
    if (!st.text.empty()) on_text(st.text);
    if (st.done) break;
    if (seq.pos() >= seq.max_context()) {
      const std::string rest = g.finish("length");
      if (!rest.empty()) on_text(rest);
      break;
    }
    logits = seq.decode(st.token);
  }
  return g;
}

}  // namespace lm::infer

// Captioned images as training documents (see captions.hpp).
#include "train/captions.hpp"

#include <algorithm>
#include <cctype>
#include <string_view>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace lm::train {

namespace {
constexpr uint64_t kCaptionStream = 0x43415054;  // "CAPT"
constexpr int64_t kClasses = 10;
}  // namespace

std::string with_article(const std::string& name) {
  const bool vowel = !name.empty() && std::string_view("aeiou").find(name[0]) != std::string_view::npos;
  return fmt::format("{} {}", vowel ? "an" : "a", name);
}

const std::vector<std::string>& CaptionData::templates() {
  static const std::vector<std::string> t = {
      " This is a picture of {}.",
      " A photo of {}.",
      " Question: What is shown in the image? Answer: {}.",
      " Q: What kind of clothing is this? A: {}.",
  };
  return t;
}

CaptionData::CaptionData(io::LabelledImages images, const io::Tokenizer& tok, const model::ModelConfig& c,
                         int64_t size, uint64_t seed)
    : images_(std::move(images)), tok_(tok), size_(size), seed_(seed) {
  LM_CHECK(c.vision.has_value(), "images: the model config has no vision_config (a multimodal model is needed)");
  v_ = *c.vision;
  LM_CHECK(v_.media_placeholder_token_id.has_value(), "images: the model config has no media_placeholder_token_id");
  ph_ = static_cast<int32_t>(*v_.media_placeholder_token_id);
  LM_CHECK(tok.has_special("<|image|>") && tok.special("<|image|>") == ph_,
           "images: the tokenizer's <|image|> must be the model's media_placeholder_token_id {}", ph_);
  const int64_t unit = v_.patch_size * std::max(v_.merge_h, v_.merge_w);
  LM_CHECK(size_ >= unit && size_ % unit == 0, "images: size {} px is not a multiple of patch x merge = {}", size_,
           unit);
  LM_CHECK(images_.n >= 1, "images: no images");
  for (uint8_t l : images_.labels)
    LM_CHECK(l < kClasses, "images: label {} is not one of the {} classes", l, kClasses);
  rows_ = (size_ / v_.patch_size / v_.merge_h) * (size_ / v_.patch_size / v_.merge_w);
  for (const std::string& t : templates())
    for (int64_t k = 0; k < kClasses; ++k) {
      const size_t at = t.find("{}");
      const std::string s = fmt::format("{}{}{}", t.substr(0, at), with_article(io::fashion_mnist_classes()[size_t(k)]),
                                        t.substr(at + 2));
      text_.push_back(tok_.encode_text(s));
    }
}

std::vector<int32_t> CaptionData::class_prompt() const {
  std::vector<int32_t> ids;
  if (tok_.bos() >= 0) ids.push_back(tok_.bos());
  ids.insert(ids.end(), static_cast<size_t>(rows_), ph_);
  const auto e = tok_.encode_text(" This is a picture of");
  ids.insert(ids.end(), e.begin(), e.end());
  return ids;
}

int CaptionData::parse_class(const std::string& text) {
  // The longest name that the text spells out: "shirt" is not "t-shirt".
  int best = -1;
  size_t best_len = 0;
  for (int k = 0; k < kClasses; ++k) {
    const std::string want = fmt::format(" {}", with_article(io::fashion_mnist_classes()[static_cast<size_t>(k)]));
    if (text.rfind(want, 0) == 0 && (text.size() == want.size() || !std::isalpha(static_cast<unsigned char>(text[want.size()]))) &&
        want.size() > best_len)
      best = k, best_len = want.size();
  }
  return best;
}

model::Media<float> CaptionData::media(int64_t i) const {
  const io::ImagePatches p = io::image_patches(images_.rgb(i, size_), v_.patch_size, v_.merge_h, 1 << 20);
  model::Media<float> m;
  m.grids.push_back({p.t, p.h, p.w});
  m.pixel_values = p.pixel_values;
  return m;
}

std::vector<int32_t> CaptionData::document(int64_t i, int64_t t) const {
  std::vector<int32_t> d;
  if (tok_.bos() >= 0) d.push_back(tok_.bos());
  d.insert(d.end(), static_cast<size_t>(rows_), ph_);
  const auto& text = text_[static_cast<size_t>(t * kClasses + images_.labels[static_cast<size_t>(i)])];
  d.insert(d.end(), text.begin(), text.end());
  d.push_back(tok_.special("<|doc|>"));
  return d;
}

int64_t CaptionData::longest_document() const {
  size_t text = 0;
  for (const auto& t : text_) text = std::max(text, t.size());
  return (tok_.bos() >= 0 ? 1 : 0) + rows_ + static_cast<int64_t>(text) + 1;
}

ImageBatch CaptionData::batch(uint64_t step, int64_t n, int64_t T) const {
  LM_CHECK(n >= 1, "images: no image sequences asked for");
  const Rng rng = Rng{seed_, kCaptionStream}.fork(step);
  ImageBatch out;
  Batch& b = out.batch;
  b.seqs = n, b.seq_len = T;
  uint64_t draw = 0;
  for (int64_t s = 0; s < n; ++s) {
    int64_t used = 0;
    while (true) {
      const Philox4 r = rng.bits(draw++);
      const int64_t i = static_cast<int64_t>(r.v[0] % static_cast<uint32_t>(images_.n));
      const int64_t t = static_cast<int64_t>(r.v[1] % templates().size());
      const std::vector<int32_t> d = document(i, t);
      const auto len = static_cast<int64_t>(d.size());
      LM_CHECK(used > 0 || len <= T, "images: seq_len {} cannot hold one image document of {} tokens", T, len);
      if (used + len > T) break;
      b.cu_seqlens.push_back(s * T + used);
      for (int64_t k = 0; k < len; ++k) {
        b.ids.push_back(d[static_cast<size_t>(k)]);
        b.targets.push_back(k + 1 < len ? d[static_cast<size_t>(k + 1)] : kIgnore);
      }
      used += len;
      const model::Media<float> m = media(i);
      out.media.grids.push_back(m.grids[0]);
      out.media.pixel_values.insert(out.media.pixel_values.end(), m.pixel_values.begin(), m.pixel_values.end());
    }
    if (used < T) {  // the padding: a segment of its own, nothing predicted
      b.cu_seqlens.push_back(s * T + used);
      b.ids.insert(b.ids.end(), static_cast<size_t>(T - used), tok_.pad() >= 0 ? tok_.pad() : 0);
      b.targets.insert(b.targets.end(), static_cast<size_t>(T - used), kIgnore);
    }
  }
  b.cu_seqlens.push_back(n * T);
  return out;
}

}  // namespace lm::train

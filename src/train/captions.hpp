#pragma once
// Image-text training data from labelled images (issue 22 item 4): Fashion-MNIST items captioned from their labels,
// packed into sequences beside the corpus' (RunConfig::images).
//
// Legend: T seq_len, n image sequences of a step, M = (S/p/mh)·(S/p/mw) feature rows per image of S×S px.
//
// A document is one image and one caption or question about it, as the corpus' documents are tokenised:
//   <s> <|image|>×M text <|doc|>      text one of templates(), e.g. " This is a picture of a sneaker."
// The M placeholders take the image's feature rows (the model's splice) and carry no loss; the caption after them is
// what the model learns to write. Sequences hold whole documents (never cut) and are padded at the end (<pad>, no
// target, a segment of its own); each document is a segment (cu_seqlens), like the corpus' documents in a batch.
// Which image and template fill a place is a pure function of (seed, step, sequence, document), so a resumed run
// draws the same batches without any saved state.
#include <cstdint>
#include <string>
#include <vector>

#include "io/idx.hpp"
#include "io/tokenizer.hpp"
#include "model/config.hpp"
#include "model/model.hpp"
#include "train/data.hpp"

namespace lm::train {

struct ImageBatch {
  Batch batch;                 // n sequences of T tokens
  model::Media<float> media;   // the images in placeholder order
  int64_t images() const { return static_cast<int64_t>(media.grids.size()); }
};

// The class names in captions: io::fashion_mnist_classes with their article ("a sneaker", "an ankle boot").
std::string with_article(const std::string& name);

class CaptionData {
 public:
  // `images` a labelled split (its labels index io::fashion_mnist_classes); `size` px per side, a multiple of
  // patch·merge of `c`'s vision_config; `tok` has <|image|> (= c's media_placeholder_token_id).
  CaptionData(io::LabelledImages images, const io::Tokenizer& tok, const model::ModelConfig& c, int64_t size,
              uint64_t seed);

  // The caption and question templates ({} is the class with its article); the first is the evaluation's.
  static const std::vector<std::string>& templates();
  // The evaluation's prompt: <s> <|image|>×M " This is a picture of" (the answer: " a sneaker." and so on).
  std::vector<int32_t> class_prompt() const;
  // The class a generated continuation of class_prompt() names (" a coat." → 4), or -1 for none.
  static int parse_class(const std::string& text);

  // Item i's tower input (one image of size² px).
  model::Media<float> media(int64_t i) const;
  // The tokens of item i's document with template t.
  std::vector<int32_t> document(int64_t i, int64_t t) const;
  // Step `step`'s n image sequences of T tokens (a pure function of seed, step, n, T). lm::Error when T cannot hold
  // one document.
  ImageBatch batch(uint64_t step, int64_t n, int64_t T) const;

  // The most tokens a document can take (any class, any template): what a sequence must hold.
  int64_t longest_document() const;
  const io::LabelledImages& images() const { return images_; }
  int64_t rows_per_image() const { return rows_; }

 private:
  io::LabelledImages images_;
  const io::Tokenizer& tok_;
  model::VisionConfig v_;
  int64_t size_, rows_;
  int32_t ph_;
  uint64_t seed_;
  std::vector<std::vector<int32_t>> text_;  // [template · 10 + class] the text's tokens
};

}  // namespace lm::train

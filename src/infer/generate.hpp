#pragma once
// Text generation on top of Session and Sampler, shared by `longmoe generate`, `chat`, `eval` and the
// server: loading a checkpoint directory, the chat template, and the per-request generation state
// (sampling, stop tokens / strings, incremental detokenisation).
//
// The chat template is io::chat_tokens (io/chat.hpp, one for chat, serve and training); the assistant's turn ends
// with <|end|>, which is a stop token of chat generation.
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "infer/engine.hpp"
#include "infer/sampler.hpp"
#include "infer/session.hpp"
#include "io/chat.hpp"
#include "io/tokenizer.hpp"
#include "model/model.hpp"

namespace lm::infer {

// A checkpoint directory: config.json, model.safetensors (HF names, one file or sharded) and
// tokenizer.model. The tokenizer's vocabulary must fit the model's.
struct LoadedModel {
  std::string dir, name;  // name: the directory's last component
  model::ModelConfig config;
  std::unique_ptr<model::Model<float>> model;  // null: random weights to be drawn on the GPU (random_model)
  std::shared_ptr<io::Tokenizer> tokenizer;  // null when the directory has no tokenizer.model
};
// `path`: a checkpoint directory, or a training run folder (its `latest` checkpoint).
LoadedModel load_model_dir(const std::string& path, bool need_tokenizer = true);
// A model with random weights (ParamStore::init(seed)) and a tokenizer file, for benchmarks and load tests. Without
// `host_weights` no model is allocated on the host (a 48B shape's fp32 weights would not fit there): the GPU engine
// draws its bf16 weights on the device (GpuModel::init_random).
LoadedModel random_model(const std::string& config, const std::string& tokenizer_path, uint64_t seed = 1,
                         bool host_weights = true);

class SequenceEngine;

// ---- images in prompts (SPEC §9) ------------------------------------------------------------------------------
// A prompt names an image by one "<|image|>" token (the tokenizer's special, which is the model's
// media_placeholder_token_id); before prefill each such marker becomes one placeholder per feature row of its image.

// Limits on one image of a prompt: decoded pixels (checked from the header, before decoding) and the patches it is
// resized into (the larger side shrinks until (H/p)·(W/p) fits).
struct ImageLimits {
  int64_t max_pixels = int64_t(1) << 24;  // 16.7M: 4096 x 4096
  int64_t max_patches = 1024;
  int64_t min_side = 0;  // px: a smaller image is first upscaled (aspect kept) so its shorter side is this (training's size)
};
// One image (PNG or JPEG bytes) as the input of the tower `v`. lm::Error naming `ctx` for an empty, corrupt or
// truncated image, another format, or one over `lim.max_pixels`.
model::Media<float> image_media(std::string_view bytes, const std::string& ctx, const model::VisionConfig& v,
                                const ImageLimits& lim = {});
// The placeholder id prompts use with this model and tokenizer: the model's media_placeholder_token_id, which must be
// the tokenizer's <|image|>. lm::Error naming what is missing (a text-only model, a tokenizer without <|image|>, ids
// that disagree).
int32_t image_token(const model::ModelConfig& c, const io::Tokenizer& tok);
// `ids` with its k-th `placeholder` repeated rows[k] times. lm::Error when the markers and images differ in number.
std::vector<int32_t> expand_placeholders(std::span<const int32_t> ids, int32_t placeholder,
                                         std::span<const int64_t> rows);
// Images placed in front of a prompt that names none: `n` markers after the last `after` token in `ids` (<s> for
// plain prompts, <|user|> for a chat turn; the start when there is none). A prompt that has markers is kept as is.
void place_images(std::vector<int32_t>& ids, int32_t after, int32_t placeholder, int64_t n);
// Attaches `images` to `seq` in order and returns `ids` with each marker expanded to its image's feature rows (what
// prefill then takes). lm::Error when markers and images differ in number (nothing is attached then).
std::vector<int32_t> attach_images(SequenceEngine& seq, std::span<const int32_t> ids, int32_t placeholder,
                                   const std::vector<model::Media<float>>& images);
// The feature rows `media` gives with tower `v` (one placeholder each): Σ (h/mh)·(w/mw).
int64_t media_rows(const model::VisionConfig& v, const model::Media<float>& media);

// One generation: feed it the logits after each token, it picks the next token and tells what text is
// new. Stop tokens end generation without being emitted; stop strings cut the text before them.
class Generation {
 public:
  Generation(const io::Tokenizer* tok, SamplingParams p, std::vector<int32_t> history, uint64_t stream = 0);
  struct Step {
    int32_t token = -1;    // the token to feed next (-1 once finished)
    int32_t emitted = -1;  // the token this step added to the output (-1: a stop token ended it)
    std::string text;      // newly released text
    bool done = false;
    TokenLogprobs lp;      // of `emitted`, when the parameters ask for top_logprobs >= 0
  };
  Step next(const float* logits, int64_t V);
  // Ends early (context limit, timeout, shutdown): releases held-back text.
  std::string finish(const std::string& reason);
  bool done() const { return !finish_reason_.empty(); }
  const std::string& finish_reason() const { return finish_reason_; }  // "stop", "length", ...
  const std::vector<int32_t>& generated() const { return generated_; }
  const std::string& text() const { return stream_.text(); }

 private:
  std::string decoded() const;
  const io::Tokenizer* tok_;
  Sampler sampler_;
  TextStream stream_;
  std::vector<int32_t> history_, generated_;
  std::string finish_reason_;
};

// One sequence, what generate() drives: a sequence of an Engine (EngineSequence), or a Session's own Sequence
// (SessionSequence).
class SequenceEngine {
 public:
  virtual ~SequenceEngine() = default;
  // Runs `tokens` after what the sequence holds; the logits after the last one [V].
  virtual std::vector<float> prefill(std::span<const int32_t> tokens) = 0;
  virtual std::vector<float> decode(int32_t token) = 0;
  // Queues images for the placeholders of the next prefill (Engine::attach_media); returns their feature rows.
  virtual int64_t attach_media(const model::Media<float>& media) = 0;
  virtual const std::vector<int32_t>& tokens() const = 0;  // consumed so far
  virtual int64_t max_context() const = 0;
  virtual int64_t vocab_size() const = 0;
  int64_t pos() const { return static_cast<int64_t>(tokens().size()); }
};

class SessionSequence final : public SequenceEngine {
 public:
  SessionSequence(Session& s, Sequence& seq) : s_(s), seq_(seq) {}
  std::vector<float> prefill(std::span<const int32_t> t) override { return s_.prefill(seq_, t); }
  std::vector<float> decode(int32_t t) override { return s_.decode({&seq_}, std::span(&t, 1)); }
  int64_t attach_media(const model::Media<float>& media) override {
    int64_t rows = 0;
    const std::vector<float> f = s_.model().media_features(media, &rows);
    s_.attach_media(seq_, f);
    return rows;
  }
  const std::vector<int32_t>& tokens() const override { return seq_.tokens; }
  int64_t max_context() const override { return s_.max_context(); }
  int64_t vocab_size() const override { return s_.vocab_size(); }

 private:
  Session& s_;
  Sequence& seq_;
};

// A sequence of an engine, opened here and closed with this object; reset() starts it over.
class EngineSequence final : public SequenceEngine {
 public:
  explicit EngineSequence(Engine& e) : e_(e), id_(e.open()) {}
  ~EngineSequence() override { e_.close(id_); }
  EngineSequence(const EngineSequence&) = delete;
  EngineSequence& operator=(const EngineSequence&) = delete;
  std::vector<float> prefill(std::span<const int32_t> t) override { return e_.prefill(id_, t); }
  std::vector<float> decode(int32_t t) override { return e_.decode(std::span(&id_, 1), std::span(&t, 1)); }
  int64_t attach_media(const model::Media<float>& media) override { return e_.attach_media(id_, media); }
  const std::vector<int32_t>& tokens() const override { return e_.tokens(id_); }
  int64_t max_context() const override { return e_.max_context(); }
  int64_t vocab_size() const override { return e_.vocab_size(); }
  void reset() {
    e_.close(id_);
    id_ = e_.open();
  }
  Engine::Id id() const { return id_; }

 private:
  Engine& e_;
  Engine::Id id_;
};

// Prefill `prompt` into the sequence and generate until a stop condition, calling `on_text` with each piece of
// released text. Returns the finished Generation.
Generation generate(SequenceEngine& seq, const io::Tokenizer& tok, const std::vector<int32_t>& prompt,
                    const SamplingParams& p, const std::function<void(const std::string&)>& on_text);
inline Generation generate(Session& s, Sequence& seq, const io::Tokenizer& tok, const std::vector<int32_t>& prompt,
                           const SamplingParams& p, const std::function<void(const std::string&)>& on_text) {
  SessionSequence e(s, seq);
  return generate(e, tok, prompt, p, on_text);
}

}  // namespace lm::infer

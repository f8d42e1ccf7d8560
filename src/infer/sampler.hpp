#pragma once
// Token sampling from logits: repetition penalty, temperature, top-k, top-p, and a counter-based draw.
//
// Legend: V vocabulary, i the index of the token being drawn in this generation.
//   penalty  (CTRL): for every token already in the history, logit > 0 ? logit / r : logit · r
//   greedy   temperature == 0: the argmax (lowest id on ties)
//   sampling p = softmax(logit / temperature), restricted to the top_k most likely tokens (0: all), then to
//            the smallest most-likely set whose mass reaches top_p (1: all), renormalised; the draw is
//            u = Rng{seed, stream}.uniform(i) against the cumulative sum in descending-probability order
//            (ties by lower id), so a (seed, stream) pair reproduces the same tokens on any machine.
// Stop conditions: max_tokens, stop token ids, stop strings (on the detokenised text; see TextStream).
// Log-probabilities (on request): of the distribution the token was drawn from (after penalty,
// temperature, top-k, top-p, renormalised), so the sampled token's is finite and tokens outside the
// top-k / top-p set are never listed; greedy decoding (whose own distribution is one-hot) reports the
// penalised model distribution at temperature 1.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/rng.hpp"

namespace lm::infer {

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy; must be in [0, 100]
  int64_t top_k = 0;                // 0: no limit
  float top_p = 1.0f;               // (0, 1]
  float repetition_penalty = 1.0f;  // > 0; 1: off
  uint64_t seed = 0;
  int64_t max_tokens = 256;
  int64_t top_logprobs = -1;        // -1: no log-probabilities; else the sampled token's and this many alternatives
  std::vector<int32_t> stop_tokens;
  std::vector<std::string> stop;    // stop strings
  void validate() const;            // throws lm::Error naming the bad field
};

// Log-probabilities of one drawn token: its own and the most likely alternatives (most likely first).
struct TokenLogprobs {
  int32_t token = -1;
  double logprob = 0;
  std::vector<std::pair<int32_t, double>> top;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams p, uint64_t stream = 0);
  const SamplingParams& params() const { return p_; }

  // Draws the next token from logits [V]; `history` (prompt + generated so far) feeds the repetition
  // penalty. Advances the draw counter.
  // With `lp`, also its log-probabilities (and params().top_logprobs alternatives).
  int32_t sample(const float* logits, int64_t V, const std::vector<int32_t>& history, TokenLogprobs* lp = nullptr);
  bool is_stop_token(int32_t t) const;
  int64_t drawn() const { return i_; }
  // Continue as if `i` tokens had been drawn: the draw counter is the sampler's whole state, so a generation
  // paused after i tokens resumes exactly (RL partial rollouts, rl/rollout.hpp).
  void seek(int64_t i) { i_ = i; }

  // The distribution sample() draws from (after penalty, temperature, top-k, top-p): probabilities [V]
  // with zeros for masked tokens. Greedy gives a one-hot vector. For tests and tools.
  std::vector<float> distribution(const float* logits, int64_t V, const std::vector<int32_t>& history) const;

 private:
  SamplingParams p_;
  Rng rng_;
  int64_t i_ = 0;
};

// Incremental detokenisation for streaming: give it the decoded text of everything generated so far;
// it returns the new text that is safe to emit: complete UTF-8 characters that cannot be the start of a
// stop string. Once a stop string appears, `stopped()` turns true and the text before it is released.
class TextStream {
 public:
  explicit TextStream(std::vector<std::string> stop = {}) : stop_(std::move(stop)) {}
  std::string update(std::string_view full);
  // End of generation: whatever is held back (except a partial UTF-8 character at the very end).
  std::string finish(std::string_view full);
  bool stopped() const { return stopped_; }
  const std::string& text() const { return emitted_; }  // everything emitted so far

 private:
  std::vector<std::string> stop_;
  std::string emitted_;
  bool stopped_ = false;
};

// Length of the longest prefix of `s` made of complete UTF-8 sequences (an incomplete tail is held back;
// invalid bytes count as complete single bytes so they never stall a stream).
size_t utf8_complete_prefix(std::string_view s);

}  // namespace lm::infer

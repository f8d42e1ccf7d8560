#pragma once
// Retrieval prompts (passkey and multi-needle): one template each, shared by the trainer's synthetic
// documents (train/synthetic) and `longmoe eval --passkey / --multi-needle`.
// Why shared: a curriculum run that mixes passkey documents into its data is then evaluated on
// prompts of exactly the same distribution (intro, filler, needle, question, and the tokens the answer
// is made of); training and evaluation differ only in the keys, lengths and depths they draw, from
// different Philox streams. Why here, in io: the template needs only the tokenizer, and io is the
// lowest layer that both the trainer (src/train) and the inference side (apps, src/infer) build on.
//
// A passkey prompt, as text:
//   kRetrievalIntro  filler sentences with the needle "The pass key is N. Remember it. N is the pass
//   key. " between two of them  "\n"  kPasskeyQuestion
// and as tokens: [<s>] encode(prompt), then the answer encode(N + "."): the prompt is encoded on its
// own (as eval encodes what it feeds the model) and the answer after it (as greedy decoding produces
// it), so the tokens a training document ends with are the ones eval expects to be generated.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/json.hpp"
#include "io/tokenizer.hpp"

namespace lm::io {

inline constexpr std::string_view kRetrievalIntro =
    "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. ";
inline constexpr std::string_view kPasskeyQuestion = "What is the pass key? The pass key is ";

// The filler, one sentence (with its trailing space) at a time, cycled: "The grass is green. ",
// "The sky is blue. ", "The sun is yellow. ", "Here we go. ", "There and back again. ".
const std::vector<std::string>& filler_sentences();
// `n` filler sentences, cycling.
std::string filler_text(int64_t n);
// Filler of about `tokens` tokens (whole sentences; at least none).
std::string retrieval_filler(const Tokenizer& tok, int64_t tokens);
// `body` with `needle` inserted at the sentence boundary (". ") at or before fraction `depth` of it.
std::string with_needle(const std::string& body, double depth, const std::string& needle);

// A five-digit key 10000..99999 from 32 random bits.
std::string passkey_key(uint32_t bits);
std::string passkey_needle(const std::string& key);  // "The pass key is N. Remember it. N is the pass key. "

struct RetrievalPrompt {
  std::string prompt;                // intro, filler with the needle(s), "\n", question
  std::string key;                   // the answer, e.g. "12345"
  std::vector<int32_t> ids;          // [<s>] encode(prompt) (no <s> when the tokenizer has none)
  std::vector<int32_t> answer_ids;   // encode(key + ".")
  int64_t filler_sentences = 0, needle_at = 0;  // sentences of filler; the passkey precedes sentence needle_at
  int64_t tokens() const { return static_cast<int64_t>(ids.size() + answer_ids.size()); }
};
using PasskeyPrompt = RetrievalPrompt;

// The longest passkey prompt whose ids + answer_ids hold at most `tokens` tokens (whole filler
// sentences; within about one sentence of `tokens`), the needle at fraction `depth` in [0, 1] of the
// filler (0: before the first sentence, 1: after the last). Throws when even the prompt without filler
// (passkey_min_tokens) does not fit.
PasskeyPrompt passkey_prompt(const Tokenizer& tok, int64_t tokens, double depth, const std::string& key);
// ids + answer_ids of a prompt without filler (the smallest passkey prompt with this tokenizer).
int64_t passkey_min_tokens(const Tokenizer& tok);

// Multi-needle: facts "The special magic number for <word j> is: <number j>. " inserted one after another
// (with_needle, needle j at fraction depths[j] of the text so far) into `sentences` filler sentences, and the
// question about fact `ask`:
//   kRetrievalIntro  filler with the facts  "\n"  "What is the special magic number for <w>? The special magic
//   number for <w> is: "
// ids and answer_ids as a passkey prompt's (key = numbers[ask]); needle_at is -1. `longmoe eval --multi-needle`
// asks these prompts, and the trainer's multi-needle sequences (data.multi_needle_fraction) are answered ones.
struct MultiNeedle {
  std::vector<std::string> numbers;  // one per fact (multi_needle_number)
  std::vector<double> depths;        // one per fact, in [0, 1]
  int64_t ask = 0;                   // the fact asked for
};
std::string multi_needle_word(int64_t j);        // apple, river, candle, falcon, marble, violet, harbor, quartz,
                                                 // then apple1, river1, ...
std::string multi_needle_number(uint32_t bits);  // seven digits, 1000000..9999999
RetrievalPrompt multi_needle_prompt(const Tokenizer& tok, int64_t sentences, const MultiNeedle& m);
// The longest such prompt (whole filler sentences, within about one sentence) whose ids + answer_ids hold at most
// `tokens` tokens; throws when even the one without filler does not fit.
RetrievalPrompt multi_needle_fit(const Tokenizer& tok, int64_t tokens, const MultiNeedle& m);
// The filler sentences of retrieval_filler(tok, tokens).
int64_t retrieval_filler_sentences(const Tokenizer& tok, int64_t tokens);

// What a retrieval evaluation asks (infer/retrieval_eval.hpp runs it): `longmoe eval --passkey/--multi-needle`
// and the run config's "eval_retrieval" (the trainer evaluates each curriculum stage's checkpoint).
struct RetrievalOptions {
  std::vector<int64_t> passkey;       // context lengths
  std::vector<int64_t> multi_needle;  // context lengths
  int64_t trials = 5;                 // prompts per length
  int64_t needles = 4;                // facts per multi-needle prompt
  uint64_t seed = 1;

  bool empty() const { return passkey.empty() && multi_needle.empty(); }
  int64_t longest() const;  // the longest length asked for (0 when empty)
  // lm::Error naming `ctx` for trials or needles out of range or a length below the smallest prompt;
  // validate also checks the passkey lengths against what this tokenizer needs.
  void check(const std::string& ctx) const;
  void validate(const io::Tokenizer& tok, const std::string& ctx) const;
  // Run config form: {"passkey": [...], "multi_needle": [...], "trials": N, "needles": N, "seed": N}.
  static RetrievalOptions from_json(const io::json& j, const std::string& ctx);
  io::json to_json() const;
};

}  // namespace lm::io

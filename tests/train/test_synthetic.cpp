// Synthetic passkey and multi-needle documents (train/synthetic) and the retrieval templates they share with
// `longmoe eval --passkey / --multi-needle` (io/retrieval): lengths, template, answer tokens, determinism, and
// that a document without its answer is exactly the prompt eval builds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iterator>

#include "core/parallel.hpp"
#include "io/retrieval.hpp"
#include "train/synthetic.hpp"

namespace {

using namespace lm;
using namespace lm::train;
namespace fs = std::filesystem;

// A small BPE tokenizer trained on text with the template's words (as a real corpus has them).
const io::Tokenizer& tokenizer() {
  static const io::Tokenizer tok = [] {
    const fs::path dir = fs::temp_directory_path() / ("lm_synth_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const char* words[] = {"the", "grass", "is", "green", "sky", "blue", "sun", "yellow", "here", "we", "go",
                           "there", "and", "back", "again", "pass", "key", "remember", "it", "what", "find",
                           "important", "information", "hidden", "inside", "a", "lot", "of", "irrelevant", "text",
                           "special", "magic", "number", "for", "apple", "river", "candle", "falcon", "marble",
                           "violet", "harbor", "quartz"};
    constexpr int kWords = static_cast<int>(std::size(words));
    std::vector<std::string> docs;
    for (int d = 0; d < 40; ++d) {
      std::string s;
      for (int w = 0; w < 60; ++w) s += std::string(w ? (w % 7 ? " " : ". ") : "") + words[(d * 11 + w * w) % kWords];
      docs.push_back(s + ". The pass key is " + std::to_string(10000 + d * 997) + ".\n");
    }
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 512;
    auto t = io::Tokenizer::train(docs, (dir / "t.model").string(), o);
    auto loaded = io::Tokenizer::load((dir / "t.model").string());
    fs::remove_all(dir);
    return loaded;
  }();
  return tok;
}

// A window-filling synthetic sequence (passkey_sequence, multi_needle_sequence) of bits `b`: a function of them,
// [<s>] ... <|doc|> within [T / 2, T] tokens (within a filler sentence below its drawn length). Returns its text
// between the two and widens [shortest, longest].
template <class Make>
std::string window_text(const io::Tokenizer& tok, int64_t T, const Philox4& b, const Make& make, int64_t& shortest,
                        int64_t& longest) {
  const SynthSeq q = make(tok, T, b);
  EXPECT_EQ(q, make(tok, T, b));
  const std::vector<int32_t>& s = q.ids;
  const auto n = static_cast<int64_t>(s.size());
  // the answer (digits and ".") just before <|doc|>
  EXPECT_EQ(q.answer_to, n - 1);
  EXPECT_GT(q.answer_to, q.answer_from);
  const std::string answer = tok.decode({s.begin() + q.answer_from, s.begin() + q.answer_to});
  EXPECT_GE(answer.size(), 6u) << answer;
  EXPECT_TRUE(answer.ends_with(".")) << answer;
  EXPECT_TRUE(std::all_of(answer.begin(), answer.end() - 1, [](char c) { return c >= '0' && c <= '9'; })) << answer;
  shortest = std::min(shortest, n), longest = std::max(longest, n);
  EXPECT_LE(n, T);
  EXPECT_GE(n + 12, T / 2);
  EXPECT_EQ(s.front(), tok.bos());
  EXPECT_EQ(s.back(), tok.special("<|doc|>"));
  return n < 2 ? std::string() : tok.decode({s.begin() + 1, s.end() - 1});
}

}  // namespace

TEST(Retrieval, PasskeyPromptFitsAndEndsWithTheQuestion) {
  const io::Tokenizer& tok = tokenizer();
  const int64_t lo = io::passkey_min_tokens(tok);
  for (const int64_t L : {lo, lo + 3, int64_t{200}, int64_t{511}, int64_t{1024}}) {
    for (const double depth : {0.0, 0.37, 1.0}) {
      const io::PasskeyPrompt p = io::passkey_prompt(tok, L, depth, "48213");
      EXPECT_LE(p.tokens(), L);
      // Whole sentences: one more would not fit.
      EXPECT_GT(p.tokens() + 12, L) << L;  // a sentence is well under 12 tokens here
      EXPECT_EQ(p.ids.front(), tok.bos());
      EXPECT_EQ(tok.decode({p.ids.begin() + 1, p.ids.end()}), p.prompt);  // the prompt exactly
      EXPECT_EQ(p.prompt.rfind(io::kRetrievalIntro, 0), 0u);
      EXPECT_TRUE(p.prompt.ends_with(std::string("\n") + std::string(io::kPasskeyQuestion)));
      EXPECT_NE(p.prompt.find(io::passkey_needle("48213")), std::string::npos);
      EXPECT_EQ(tok.decode(p.answer_ids), "48213.");
      EXPECT_EQ(p.needle_at, std::llround(depth * static_cast<double>(p.filler_sentences)));
    }
  }
  EXPECT_THROW(io::passkey_prompt(tok, lo - 1, 0.5, "48213"), Error);
  EXPECT_EQ(io::passkey_key(0), "10000");
  EXPECT_EQ(io::passkey_key(89999), "99999");
  EXPECT_EQ(io::passkey_key(90000), "10000");
  EXPECT_EQ(io::with_needle("A b. C d. E f. ", 0.5, "N. "), "A b. N. C d. E f. ");
}

TEST(Synthetic, PasskeyDocumentsSpanTheStageContext) {
  const io::Tokenizer& tok = tokenizer();
  const int32_t sep = tok.special("<|doc|>");
  const int64_t T = 256, target = 20000;
  const int64_t lo = passkey_min_doc_tokens(tok, T);
  EXPECT_EQ(lo, std::max<int64_t>(T / 4, io::passkey_min_tokens(tok) + 3));
  const Rng rng = passkey_rng(7, 1).fork(0);
  lm::set_num_threads(1);
  const TokenizedDocs a = passkey_documents(tok, T, target, rng);
  lm::set_num_threads(2);
  const TokenizedDocs b = passkey_documents(tok, T, target, rng);
  EXPECT_EQ(a.ids, b.ids);  // deterministic, whatever the thread count
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_NE(passkey_documents(tok, T, target, passkey_rng(7, 1).fork(1)).ids, a.ids);  // another epoch
  EXPECT_NE(passkey_documents(tok, T, target, passkey_rng(7, 2).fork(0)).ids, a.ids);  // another stage
  // Enough documents for the target, not one more than needed (each is at most T tokens).
  EXPECT_GE(a.tokens() + a.num_docs() * 12, target);
  EXPECT_LT(a.tokens() - static_cast<int64_t>(a.doc(a.num_docs() - 1).size()), target);
  int64_t shortest = T, longest = 0;
  double depth_sum = 0;
  for (int64_t d = 0; d < a.num_docs(); ++d) {
    const auto s = a.doc(d);
    const auto n = static_cast<int64_t>(s.size());
    shortest = std::min(shortest, n), longest = std::max(longest, n);
    EXPECT_LE(n, T);
    EXPECT_GE(n + 12, lo);
    ASSERT_EQ(s.front(), tok.bos());
    ASSERT_EQ(s.back(), sep);
    const std::string text = tok.decode({s.begin() + 1, s.end() - 1});
    // "... The pass key is N." with the needle's N.
    const size_t q = text.rfind(io::kPasskeyQuestion);
    ASSERT_NE(q, std::string::npos);
    const std::string key = text.substr(q + io::kPasskeyQuestion.size(), 5);
    EXPECT_EQ(text.substr(q + io::kPasskeyQuestion.size()), key + ".");
    const size_t needle = text.find(io::passkey_needle(key));
    ASSERT_NE(needle, std::string::npos);
    depth_sum += static_cast<double>(needle) / static_cast<double>(q);
    // [<s>] encode(prompt) encode(N + ".") <|doc|>: without its answer the document is what eval feeds
    // the model for such a prompt, and the answer is what greedy decoding has to produce after it.
    std::vector<int32_t> want{tok.bos()};
    for (const std::string& piece : {text.substr(0, q + io::kPasskeyQuestion.size()), key + "."}) {
      const auto e = tok.encode(piece);
      want.insert(want.end(), e.begin(), e.end());
    }
    want.push_back(sep);
    EXPECT_EQ(std::vector<int32_t>(s.begin(), s.end()), want);
  }
  // Lengths spread over [lo, T], depths over [0, 1].
  EXPECT_LT(shortest, lo + (T - lo) / 4);
  EXPECT_GT(longest, T - (T - lo) / 4);
  EXPECT_NEAR(depth_sum / static_cast<double>(a.num_docs()), 0.5, 0.15);
  // The share of the training tokens.
  EXPECT_EQ(passkey_target_tokens(900, 0.1), 100);
  EXPECT_EQ(passkey_target_tokens(900, 0), 0);
  EXPECT_THROW(passkey_target_tokens(900, 0.95), Error);
  EXPECT_THROW(passkey_min_doc_tokens(tok, lo / 2), Error);
}

// A long-context stage's passkey sequence (passkey_sequence): one document of [T / 2, T] tokens (within a filler
// sentence below its drawn length), ending with the question, the answer and <|doc|>; a function of its bits.
TEST(Synthetic, PasskeySequencesFillTheWindow) {
  const io::Tokenizer& tok = tokenizer();
  const int64_t T = 2048;
  const Rng rng = passkey_rng(3, 0);
  int64_t shortest = T, longest = 0;
  for (uint64_t i = 0; i < 20; ++i) {
    const std::string text = window_text(tok, T, rng.bits(i), passkey_sequence, shortest, longest);
    const size_t q = text.rfind(io::kPasskeyQuestion);
    ASSERT_NE(q, std::string::npos);
    EXPECT_NE(text.find(io::passkey_needle(text.substr(q + io::kPasskeyQuestion.size(), 5))), std::string::npos);
  }
  EXPECT_LT(shortest, T * 3 / 4);
  EXPECT_GT(longest, T * 3 / 4);
}

// The multi-needle template: the longest prompt within the length, every fact once at its place, the question
// about the asked one, its number as the answer; the eval's prompt (a filler sentence count) is the same text.
TEST(Retrieval, MultiNeedlePromptFitsAndAsksOneFact) {
  const io::Tokenizer& tok = tokenizer();
  io::MultiNeedle m;
  m.numbers = {io::multi_needle_number(0), io::multi_needle_number(8999999), io::multi_needle_number(12345),
               io::multi_needle_number(4000000)};
  m.depths = {0.9, 0.0, 0.5, 1.0};
  m.ask = 2;
  EXPECT_EQ(m.numbers[0], "1000000");
  EXPECT_EQ(m.numbers[1], "9999999");
  EXPECT_EQ(io::multi_needle_word(0), "apple");
  EXPECT_EQ(io::multi_needle_word(7), "quartz");
  EXPECT_EQ(io::multi_needle_word(9), "river1");
  const int64_t lo = io::multi_needle_prompt(tok, 0, m).tokens();
  for (const int64_t L : {lo, lo + 5, int64_t{400}, int64_t{1500}}) {
    const io::RetrievalPrompt p = io::multi_needle_fit(tok, L, m);
    EXPECT_LE(p.tokens(), L);
    EXPECT_GT(p.tokens() + 12, L) << L;  // one more sentence would not fit
    EXPECT_EQ(p.ids, io::multi_needle_prompt(tok, p.filler_sentences, m).ids);
    EXPECT_EQ(p.ids.front(), tok.bos());
    EXPECT_EQ(tok.decode({p.ids.begin() + 1, p.ids.end()}), p.prompt);
    EXPECT_EQ(p.prompt.rfind(io::kRetrievalIntro, 0), 0u);
    for (int64_t j = 0; j < 4; ++j) {
      const std::string fact = "The special magic number for " + io::multi_needle_word(j) + " is: " +
                               m.numbers[size_t(j)] + ". ";
      const size_t at = p.prompt.find(fact);
      ASSERT_NE(at, std::string::npos) << j;
      EXPECT_EQ(p.prompt.find(fact, at + 1), std::string::npos) << j;
    }
    // depth 0: right after the intro; depth 1 (inserted last): after every filler sentence
    EXPECT_EQ(p.prompt.find("The special magic number for river"), io::kRetrievalIntro.size());
    EXPECT_TRUE(p.prompt.ends_with("\nWhat is the special magic number for candle? The special magic number for "
                                   "candle is: "));
    EXPECT_EQ(p.key, m.numbers[2]);
    EXPECT_EQ(tok.decode(p.answer_ids), m.numbers[2] + ".");
  }
  EXPECT_THROW(io::multi_needle_fit(tok, lo - 1, m), Error);
  m.ask = 4;
  EXPECT_THROW(io::multi_needle_prompt(tok, 3, m), Error);
}

// A long-context stage's multi-needle sequence: [T / 2, T] tokens, the answered question and <|doc|>, a function of
// its bits; retrieval_sequence mixes them with passkey sequences at the asked share and leaves the passkey
// sequences those of a stage without multi-needle documents.
TEST(Synthetic, MultiNeedleSequencesAndTheirShare) {
  const io::Tokenizer& tok = tokenizer();
  const int64_t T = 2048;
  const Rng rng = passkey_rng(5, 1);
  const std::string q = "? The special magic number for ";
  int64_t shortest = T, longest = 0;
  for (uint64_t i = 0; i < 20; ++i) {
    const std::string text = window_text(tok, T, rng.bits(i), multi_needle_sequence, shortest, longest);
    // "... for <w>? The special magic number for <w> is: N." and the fact "<w> is: N. " in the text
    const size_t a = text.rfind(q);
    ASSERT_NE(a, std::string::npos);
    const std::string tail = text.substr(a + q.size());  // "<w> is: N."
    const size_t is = tail.find(" is: ");
    ASSERT_NE(is, std::string::npos);
    const std::string word = tail.substr(0, is), number = tail.substr(is + 5, 7);
    EXPECT_EQ(tail, word + " is: " + number + ".");
    EXPECT_NE(text.find("The special magic number for " + word + " is: " + number + ". "), std::string::npos);
    int facts = 0;  // (before the question, whose answer part reads like a fact)
    for (size_t at = text.find("The special magic number for "); at < a;
         at = text.find("The special magic number for ", at + 1))
      ++facts;
    EXPECT_EQ(facts, kTrainNeedles);
  }
  EXPECT_LT(shortest, T * 3 / 4);
  EXPECT_GT(longest, T * 3 / 4);
  int multi = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    EXPECT_EQ(retrieval_sequence(tok, 512, 0.0, rng.bits(i)), passkey_sequence(tok, 512, rng.bits(i)));
    const SynthSeq s = retrieval_sequence(tok, 512, 0.4, rng.bits(i));
    const bool is_multi = tok.decode(s.ids).find("special magic") != std::string::npos;
    multi += is_multi;
    EXPECT_EQ(s, is_multi ? multi_needle_sequence(tok, 512, rng.bits(i)) : passkey_sequence(tok, 512, rng.bits(i)));
  }
  EXPECT_GT(multi, 50);
  EXPECT_LT(multi, 110);
  EXPECT_THROW(multi_needle_min_doc_tokens(tok, 128), Error);
}

#pragma once
// Retrieval accuracy per context length (`longmoe eval --passkey / --multi-needle`, and the trainer's evaluation of
// each curriculum stage, run config "eval_retrieval"):
//   passkey       one five-digit key hidden in filler (io/retrieval.hpp, the template of the trainer's synthetic
//                 passkey documents); prompt + answer hold at most L tokens, the needle depths of the `trials`
//                 prompts spread evenly over [0, 1].
//   multi-needle  `needles` "special magic number for <word>" facts at random depths, one of them asked for.
// A prompt is answered by greedy decoding (up to 12 tokens, stopping at <|doc|> or </s>) and counts as correct when
// the answer contains the expected number. Keys, depths and questions are a pure function of (seed, task, L, trial).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "infer/engine.hpp"
#include "io/json.hpp"
#include "io/retrieval.hpp"
#include "io/tokenizer.hpp"

namespace lm::infer {

using io::RetrievalOptions;

struct RetrievalPoint {
  std::string task;  // "passkey" or "multi_needle"
  int64_t length = 0, correct = 0, trials = 0;
  double seconds = 0;
  // The first wrong trial: the number asked for and the greedy answer given (empty when every trial was right), so
  // a score of 0 says whether the model copied another needle, a few digits, or nothing like a number.
  std::string miss_expected, miss_answer;
  double accuracy() const { return trials > 0 ? static_cast<double>(correct) / static_cast<double>(trials) : 0; }
  // One metrics line: {"length": L, "<task>": accuracy, "<task>_correct": n, "trials": N, "seconds": s} (and
  // "first_miss": {"expected", "answer"} after a wrong trial)
  // (so that `longmoe plot FILES --x length --y passkey --log-x` draws accuracy against length, one file a series).
  io::json to_json() const;
};

// Evaluates every length of `o` (passkey first) on `engine`, calling `on_point` after each; lengths over the
// engine's context are an error (before any prompt runs).
std::vector<RetrievalPoint> eval_retrieval(Engine& engine, const io::Tokenizer& tok, const RetrievalOptions& o,
                                           const std::function<void(const RetrievalPoint&)>& on_point = {});

// The printed form of one point: "passkey     length    8192: accuracy  95.0% (19 / 20)  [1.2 s]".
std::string describe(const RetrievalPoint& p, int64_t needles);

}  // namespace lm::infer

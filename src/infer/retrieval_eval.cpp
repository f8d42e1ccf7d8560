// Retrieval accuracy per context length (retrieval_eval.hpp).
#include "infer/retrieval_eval.hpp"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "infer/generate.hpp"
#include "io/retrieval.hpp"

namespace lm::infer {

namespace {

constexpr int64_t kAnswerTokens = 12;

std::string greedy_answer(Engine& e, const io::Tokenizer& tok, const std::vector<int32_t>& prompt) {
  SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = kAnswerTokens;
  if (tok.eos() >= 0) sp.stop_tokens.push_back(tok.eos());
  sp.stop_tokens.push_back(tok.special("<|doc|>"));  // a trained document ends there
  EngineSequence seq(e);
  return generate(seq, tok, prompt, sp, [](const std::string&) {}).text();
}

// Trial k's prompt at length L and the number its answer must contain.
std::pair<std::vector<int32_t>, std::string> make_prompt(const io::Tokenizer& tok, bool multi, int64_t L, int64_t k,
                                                         const RetrievalOptions& o) {
  const Rng rng{o.seed, multi ? 2u : 1u};
  const uint64_t i = static_cast<uint64_t>(L * 1000 + k);
  if (!multi) {
    const std::string key = io::passkey_key(rng.bits(i).v[0]);
    const double depth = o.trials > 1 ? static_cast<double>(k) / static_cast<double>(o.trials - 1) : 0.5;
    return {io::passkey_prompt(tok, L, depth, key).ids, key};
  }
  io::MultiNeedle m;
  m.ask = static_cast<int64_t>(rng.bits(i).v[1] % static_cast<uint32_t>(o.needles));
  for (int64_t j = 0; j < o.needles; ++j) {
    const uint64_t ij = i * 64 + static_cast<uint64_t>(j);
    m.numbers.push_back(io::multi_needle_number(rng.bits(ij).v[2]));
    m.depths.push_back(rng.uniform_f64(ij));
  }
  const io::RetrievalPrompt p =
      io::multi_needle_prompt(tok, io::retrieval_filler_sentences(tok, L - 60 - 25 * o.needles), m);
  return {p.ids, p.key};
}

}  // namespace

io::json RetrievalPoint::to_json() const {
  io::json j = {{"length", length}, {task, accuracy()}, {task + "_correct", correct}, {"trials", trials},
                {"seconds", seconds}};
  if (!miss_expected.empty()) j["first_miss"] = {{"expected", miss_expected}, {"answer", miss_answer}};
  return j;
}

std::string describe(const RetrievalPoint& p, int64_t needles) {
  const bool multi = p.task == "multi_needle";
  std::string miss;
  if (!p.miss_expected.empty()) {
    std::string a;
    for (char ch : p.miss_answer) a += ch == '\n' ? std::string("\\n") : std::string(1, ch);
    miss = fmt::format("; first miss: wanted {}, got \"{}\"", p.miss_expected, a);
  }
  return fmt::format("{:<11} length {:>7}: accuracy {:5.1f}% ({} / {}){}  [{:.1f} s]{}",
                     multi ? "multi-needle" : "passkey", p.length, 100 * p.accuracy(), p.correct, p.trials,
                     multi ? fmt::format(", {} needles", needles) : std::string(), p.seconds, miss);
}

std::vector<RetrievalPoint> eval_retrieval(Engine& engine, const io::Tokenizer& tok, const RetrievalOptions& o,
                                           const std::function<void(const RetrievalPoint&)>& on_point) {
  o.validate(tok, "retrieval evaluation");
  LM_CHECK(o.longest() <= engine.max_context(), "retrieval evaluation: length {} is over the engine's context ({})",
           o.longest(), engine.max_context());
  std::vector<RetrievalPoint> out;
  for (const bool multi : {false, true})
    for (int64_t L : multi ? o.multi_needle : o.passkey) {
      RetrievalPoint p;
      p.task = multi ? "multi_needle" : "passkey", p.length = L, p.trials = o.trials;
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t k = 0; k < o.trials; ++k) {
        auto [ids, expect] = make_prompt(tok, multi, L, k, o);
        // Room for the answer: a prompt that reaches the context loses filler right after <s>.
        const int64_t over = static_cast<int64_t>(ids.size()) + kAnswerTokens - engine.max_context();
        if (over > 0) ids.erase(ids.begin() + 1, ids.begin() + 1 + over);
        const std::string answer = greedy_answer(engine, tok, ids);
        const bool right = answer.find(expect) != std::string::npos;
        p.correct += right;
        if (!right && p.miss_expected.empty()) {
          p.miss_expected = expect, p.miss_answer = answer;
          for (char& ch : p.miss_answer)  // (12 tokens may end inside a UTF-8 sequence: JSON wants valid text)
            if (static_cast<unsigned char>(ch) >= 0x80 || (ch < 0x20 && ch != '\n')) ch = '?';
        }
      }
      p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      out.push_back(p);
      if (on_point) on_point(p);
    }
  return out;
}

}  // namespace lm::infer

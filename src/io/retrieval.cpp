#include "io/retrieval.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace lm::io {

namespace {

// Tokens per filler sentence in running text (the first sentence of a text may differ by a token).
double tokens_per_sentence(const Tokenizer& tok) {
  const auto n = static_cast<int64_t>(filler_sentences().size());
  const auto a = static_cast<double>(tok.encode(filler_text(n)).size());
  const auto b = static_cast<double>(tok.encode(filler_text(2 * n)).size());
  return std::max(1.0, (b - a) / static_cast<double>(n));
}

PasskeyPrompt build(const Tokenizer& tok, int64_t n, double depth, const std::string& key) {
  PasskeyPrompt p;
  p.key = key;
  p.filler_sentences = n;
  p.needle_at = std::clamp<int64_t>(std::llround(depth * static_cast<double>(n)), 0, n);
  const auto& s = filler_sentences();
  p.prompt = std::string(kRetrievalIntro);
  for (int64_t i = 0; i <= n; ++i) {
    if (i == p.needle_at) p.prompt += passkey_needle(key);
    if (i < n) p.prompt += s[static_cast<size_t>(i) % s.size()];
  }
  p.prompt += "\n";
  p.prompt += kPasskeyQuestion;
  if (tok.bos() >= 0) p.ids.push_back(tok.bos());
  const auto e = tok.encode(p.prompt);
  p.ids.insert(p.ids.end(), e.begin(), e.end());
  p.answer_ids = tok.encode(key + ".");
  return p;
}

}  // namespace

const std::vector<std::string>& filler_sentences() {
  static const std::vector<std::string> s = {"The grass is green. ", "The sky is blue. ", "The sun is yellow. ",
                                             "Here we go. ", "There and back again. "};
  return s;
}

std::string filler_text(int64_t n) {
  const auto& s = filler_sentences();
  std::string out;
  for (int64_t i = 0; i < n; ++i) out += s[static_cast<size_t>(i) % s.size()];
  return out;
}

std::string retrieval_filler(const Tokenizer& tok, int64_t tokens) {
  if (tokens <= 0) return {};
  return filler_text(static_cast<int64_t>(static_cast<double>(tokens) / tokens_per_sentence(tok)));
}

std::string with_needle(const std::string& body, double depth, const std::string& needle) {
  const auto at = static_cast<size_t>(std::clamp(depth, 0.0, 1.0) * static_cast<double>(body.size()));
  const size_t dot = body.rfind(". ", at);
  const size_t cut = dot == std::string::npos ? 0 : dot + 2;
  return body.substr(0, cut) + needle + body.substr(cut);
}

std::string passkey_key(uint32_t bits) { return std::to_string(10000 + bits % 90000); }

std::string passkey_needle(const std::string& key) {
  return "The pass key is " + key + ". Remember it. " + key + " is the pass key. ";
}

int64_t passkey_min_tokens(const Tokenizer& tok) { return build(tok, 0, 0.0, "10000").tokens(); }

PasskeyPrompt passkey_prompt(const Tokenizer& tok, int64_t tokens, double depth, const std::string& key) {
  LM_CHECK(depth >= 0.0 && depth <= 1.0, "passkey prompt: depth {} outside [0, 1]", depth);
  PasskeyPrompt p = build(tok, 0, depth, key);
  LM_CHECK(p.tokens() <= tokens,
           "passkey prompt: {} tokens do not hold even the prompt without filler ({} tokens with this tokenizer)",
           tokens, p.tokens());
  const double per = tokens_per_sentence(tok);
  // Whole sentences: start from the estimate, step down until it fits, then up while it still fits.
  int64_t n = static_cast<int64_t>(static_cast<double>(tokens - p.tokens()) / per);
  while (n > 0) {
    PasskeyPrompt q = build(tok, n, depth, key);
    if (q.tokens() <= tokens) {
      p = std::move(q);
      break;
    }
    n -= std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(q.tokens() - tokens) / per)));
  }
  n = std::max<int64_t>(n, 0);
  for (int64_t step = 1;;) {
    step = std::max<int64_t>(step, static_cast<int64_t>(static_cast<double>(tokens - p.tokens()) / per));
    PasskeyPrompt q = build(tok, n + step, depth, key);
    if (q.tokens() <= tokens) {
      p = std::move(q);
      n += step;
      step = 1;
    } else if (step > 1) {
      step = 1;  // the estimate overshot: try one sentence more
      q = build(tok, n + 1, depth, key);
      if (q.tokens() > tokens) break;
      p = std::move(q);
      ++n;
    } else {
      break;
    }
  }
  return p;
}

namespace {
// The smallest multi-needle length: the intro, the question and `needles` facts of about 25 tokens each.
int64_t min_multi_needle(int64_t needles) { return 128 + 25 * needles; }
}  // namespace

void RetrievalOptions::check(const std::string& ctx) const {
  LM_CHECK(trials >= 1 && trials <= 100000, "{}: trials must be in [1, 100000], got {}", ctx, trials);
  LM_CHECK(needles >= 1 && needles <= 64, "{}: needles must be in [1, 64], got {}", ctx, needles);
  for (int64_t L : passkey)
    LM_CHECK(L >= 128, "{}: passkey length {} is below 128 tokens", ctx, L);
  for (int64_t L : multi_needle)
    LM_CHECK(L >= min_multi_needle(needles), "{}: multi-needle length {} is below {} (128 + 25 per needle)", ctx, L,
             min_multi_needle(needles));
}

void RetrievalOptions::validate(const io::Tokenizer& tok, const std::string& ctx) const {
  check(ctx);
  const int64_t pmin = io::passkey_min_tokens(tok);
  for (int64_t L : passkey)
    LM_CHECK(L >= pmin, "{}: passkey length {} is shorter than the smallest passkey prompt of this tokenizer ({} tokens)",
             ctx, L, pmin);
}

int64_t RetrievalOptions::longest() const {
  int64_t n = 0;
  for (const auto* v : {&passkey, &multi_needle})
    for (int64_t t : *v) n = std::max(n, t);
  return n;
}

RetrievalOptions RetrievalOptions::from_json(const io::json& j, const std::string& ctx) {
  io::check_known_fields(j, {"passkey", "multi_needle", "trials", "needles", "seed"}, ctx);
  RetrievalOptions o;
  o.passkey = io::get_or<std::vector<int64_t>>(j, "passkey", {}, ctx);
  o.multi_needle = io::get_or<std::vector<int64_t>>(j, "multi_needle", {}, ctx);
  o.trials = io::get_or<int64_t>(j, "trials", 10, ctx);
  o.needles = io::get_or<int64_t>(j, "needles", 4, ctx);
  o.seed = io::get_or<uint64_t>(j, "seed", 1, ctx);
  LM_CHECK(!o.empty(), "{}: give passkey and/or multi_needle lengths", ctx);
  o.check(ctx);
  return o;
}

io::json RetrievalOptions::to_json() const {
  return {{"passkey", passkey}, {"multi_needle", multi_needle}, {"trials", trials}, {"needles", needles},
          {"seed", seed}};
}

}  // namespace lm::io

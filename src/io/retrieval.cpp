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

// ids = [<s>] encode(prompt) and answer_ids = encode(key + "."), from p.prompt and p.key.
void encode(const Tokenizer& tok, RetrievalPrompt& p) {
  if (tok.bos() >= 0) p.ids.push_back(tok.bos());
  const auto e = tok.encode(p.prompt);
  p.ids.insert(p.ids.end(), e.begin(), e.end());
  p.answer_ids = tok.encode(p.key + ".");
}

RetrievalPrompt build(const Tokenizer& tok, int64_t n, double depth, const std::string& key) {
  RetrievalPrompt p;
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
  encode(tok, p);
  return p;
}

// The longest prompt build(n) with ids + answer_ids within `tokens` (whole sentences n >= 0): from the estimate,
// step down until it fits, then up while it still fits. p: build_n(0), which fits.
template <class Build>
RetrievalPrompt fit(const Tokenizer& tok, int64_t tokens, RetrievalPrompt p, const Build& build_n) {
  const double per = tokens_per_sentence(tok);
  int64_t n = static_cast<int64_t>(static_cast<double>(tokens - p.tokens()) / per);
  while (n > 0) {
    RetrievalPrompt q = build_n(n);
    if (q.tokens() <= tokens) {
      p = std::move(q);
      break;
    }
    n -= std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(q.tokens() - tokens) / per)));
  }
  n = std::max<int64_t>(n, 0);
  for (int64_t step = 1;;) {
    step = std::max<int64_t>(step, static_cast<int64_t>(static_cast<double>(tokens - p.tokens()) / per));
    RetrievalPrompt q = build_n(n + step);
    if (q.tokens() <= tokens) {
      p = std::move(q);
      n += step;
      step = 1;
    } else if (step > 1) {
      step = 1;  // the estimate overshot: try one sentence more
      q = build_n(n + 1);
      if (q.tokens() > tokens) break;
      p = std::move(q);
      ++n;
    } else {
      break;
    }
  }
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
  return filler_text(retrieval_filler_sentences(tok, tokens));
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

RetrievalPrompt passkey_prompt(const Tokenizer& tok, int64_t tokens, double depth, const std::string& key) {
  LM_CHECK(depth >= 0.0 && depth <= 1.0, "passkey prompt: depth {} outside [0, 1]", depth);
  RetrievalPrompt p = build(tok, 0, depth, key);
  LM_CHECK(p.tokens() <= tokens,
           "passkey prompt: {} tokens do not hold even the prompt without filler ({} tokens with this tokenizer)",
           tokens, p.tokens());
  return fit(tok, tokens, std::move(p), [&](int64_t n) { return build(tok, n, depth, key); });
}

std::string multi_needle_word(int64_t j) {
  static const char* const kWords[] = {"apple", "river", "candle", "falcon", "marble", "violet", "harbor", "quartz"};
  return kWords[j % 8] + (j >= 8 ? std::to_string(j / 8) : std::string());
}

std::string multi_needle_number(uint32_t bits) { return std::to_string(1000000 + bits % 9000000); }

RetrievalPrompt multi_needle_prompt(const Tokenizer& tok, int64_t sentences, const MultiNeedle& m) {
  const auto n = static_cast<int64_t>(m.numbers.size());
  LM_CHECK(n >= 1 && m.depths.size() == m.numbers.size() && m.ask >= 0 && m.ask < n,
           "multi-needle prompt: {} numbers, {} depths, fact {} asked", n, m.depths.size(), m.ask);
  std::string body = filler_text(std::max<int64_t>(sentences, 0));
  for (int64_t j = 0; j < n; ++j)
    body = with_needle(body, m.depths[size_t(j)],
                       "The special magic number for " + multi_needle_word(j) + " is: " + m.numbers[size_t(j)] + ". ");
  const std::string w = multi_needle_word(m.ask);
  RetrievalPrompt p;
  p.key = m.numbers[size_t(m.ask)];
  p.filler_sentences = std::max<int64_t>(sentences, 0), p.needle_at = -1;
  p.prompt = std::string(kRetrievalIntro) + body + "\n" + "What is the special magic number for " + w +
             "? The special magic number for " + w + " is: ";
  encode(tok, p);
  return p;
}

RetrievalPrompt multi_needle_fit(const Tokenizer& tok, int64_t tokens, const MultiNeedle& m) {
  RetrievalPrompt p = multi_needle_prompt(tok, 0, m);
  LM_CHECK(p.tokens() <= tokens,
           "multi-needle prompt: {} tokens do not hold even the prompt without filler ({} tokens with this tokenizer)",
           tokens, p.tokens());
  return fit(tok, tokens, std::move(p), [&](int64_t n) { return multi_needle_prompt(tok, n, m); });
}

int64_t retrieval_filler_sentences(const Tokenizer& tok, int64_t tokens) {
  return tokens <= 0 ? 0 : static_cast<int64_t>(static_cast<double>(tokens) / tokens_per_sentence(tok));
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

#include "train/synthetic.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/retrieval.hpp"

namespace lm::train {

namespace {
constexpr uint64_t kPasskeyStream = 0x504153534B45ull;  // "PASSKE"
}

Rng passkey_rng(uint64_t seed, int64_t stage) { return Rng{seed, kPasskeyStream}.fork(static_cast<uint64_t>(stage)); }

int64_t passkey_target_tokens(int64_t corpus_tokens, double fraction) {
  LM_CHECK(fraction >= 0.0 && fraction <= 0.9, "passkey fraction {} outside [0, 0.9]", fraction);
  return std::llround(fraction / (1.0 - fraction) * static_cast<double>(corpus_tokens));
}

int64_t passkey_min_doc_tokens(const io::Tokenizer& tok, int64_t seq_len) {
  // + 2: slack for keys whose digits tokenize longer than the probe's; + 1: the <|doc|> separator.
  const int64_t need = io::passkey_min_tokens(tok) + 2 + 1;
  LM_CHECK(need <= seq_len,
           "passkey documents need at least {} tokens with this tokenizer (intro, needle, question, answer), more "
           "than seq_len {}: use longer stages or data.passkey_fraction 0",
           need, seq_len);
  return std::max<int64_t>(need, (seq_len + 3) / 4);
}

namespace {

struct Draw {
  int64_t len;
  std::string key;
  double depth;
};
// A document's length in [lo, lo + span), key and depth from one Philox draw.
Draw draw(const Philox4& b, int64_t lo, int64_t span) {
  const double depth = static_cast<double>(((static_cast<uint64_t>(b.v[2]) << 32) | b.v[3]) >> 11) *
                       (1.0 / 9007199254740992.0);  // [0, 1)
  return {lo + static_cast<int64_t>(b.v[0] % static_cast<uint32_t>(span)), io::passkey_key(b.v[1]), depth};
}
// [<s>] prompt, answer, <|doc|>: at most d.len tokens.
std::vector<int32_t> document(const io::Tokenizer& tok, const Draw& d) {
  const io::PasskeyPrompt p = io::passkey_prompt(tok, d.len - 1, d.depth, d.key);
  std::vector<int32_t> ids = p.ids;
  ids.insert(ids.end(), p.answer_ids.begin(), p.answer_ids.end());
  ids.push_back(tok.special("<|doc|>"));
  return ids;
}

}  // namespace

std::vector<int32_t> passkey_sequence(const io::Tokenizer& tok, int64_t seq_len, const Philox4& bits) {
  const int64_t lo = std::max(passkey_min_doc_tokens(tok, seq_len), seq_len / 2);
  return document(tok, draw(bits, lo, seq_len - lo + 1));
}

TokenizedDocs passkey_documents(const io::Tokenizer& tok, int64_t seq_len, int64_t target_tokens, const Rng& rng) {
  const int64_t lo = passkey_min_doc_tokens(tok, seq_len), span = seq_len - lo + 1;
  std::vector<Draw> draws;
  for (int64_t total = 0; total < target_tokens;) {
    draws.push_back(draw(rng.bits(draws.size()), lo, span));
    total += draws.back().len;
  }
  const auto n = static_cast<int64_t>(draws.size());
  std::vector<std::vector<int32_t>> docs(draws.size());
  parallel_for_dynamic(n, [&](int64_t j) { docs[static_cast<size_t>(j)] = document(tok, draws[static_cast<size_t>(j)]); });
  TokenizedDocs out;
  for (const auto& ids : docs) {
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
  }
  return out;
}

}  // namespace lm::train

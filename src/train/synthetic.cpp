#include "train/synthetic.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/retrieval.hpp"

namespace lm::train {

namespace {
constexpr uint64_t kPasskeyStream = 0x504153534B45ull;  // "PASSKE"
constexpr uint64_t kMultiNeedleStream = 0x4D554C5449ull;  // "MULTI"
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
// [<s>] prompt, answer, <|doc|>, the answer's span marked.
SynthSeq answered(const io::Tokenizer& tok, const io::RetrievalPrompt& p) {
  SynthSeq s;
  s.ids = p.ids;
  s.answer_from = static_cast<int64_t>(s.ids.size());
  s.ids.insert(s.ids.end(), p.answer_ids.begin(), p.answer_ids.end());
  s.answer_to = static_cast<int64_t>(s.ids.size());
  s.ids.push_back(tok.special("<|doc|>"));
  return s;
}
// A passkey document of at most d.len tokens.
SynthSeq document(const io::Tokenizer& tok, const Draw& d) {
  return answered(tok, io::passkey_prompt(tok, d.len - 1, d.depth, d.key));
}

}  // namespace

SynthSeq passkey_sequence(const io::Tokenizer& tok, int64_t seq_len, const Philox4& bits) {
  const int64_t lo = std::max(passkey_min_doc_tokens(tok, seq_len), seq_len / 2);
  return document(tok, draw(bits, lo, seq_len - lo + 1));
}

int64_t multi_needle_min_doc_tokens(const io::Tokenizer& tok, int64_t seq_len) {
  io::MultiNeedle m;
  for (int64_t j = 0; j < kTrainNeedles; ++j) m.numbers.push_back("1000000"), m.depths.push_back(0.0);
  // + 2 per fact: slack for numbers whose digits tokenize longer than the probe's; + 1: the <|doc|> separator.
  const int64_t need = io::multi_needle_prompt(tok, 0, m).tokens() + 2 * kTrainNeedles + 1;
  LM_CHECK(need <= seq_len / 2,
           "multi-needle documents need at least {} tokens with this tokenizer, more than half of seq_len {}: use "
           "longer stages or data.multi_needle_fraction 0",
           need, seq_len);
  return need;
}

SynthSeq multi_needle_sequence(const io::Tokenizer& tok, int64_t seq_len, const Philox4& bits) {
  const uint64_t hi = (uint64_t(bits.v[0]) << 32) | bits.v[1], lo64 = (uint64_t(bits.v[2]) << 32) | bits.v[3];
  const Rng rng{hi, kMultiNeedleStream ^ lo64};
  const int64_t lo = std::max(multi_needle_min_doc_tokens(tok, seq_len), seq_len / 2);
  const Philox4 b0 = rng.bits(0);
  io::MultiNeedle m;
  m.ask = static_cast<int64_t>(b0.v[1] % static_cast<uint32_t>(kTrainNeedles));
  for (int64_t j = 0; j < kTrainNeedles; ++j) {
    m.numbers.push_back(io::multi_needle_number(rng.bits(1 + uint64_t(j)).v[0]));
    m.depths.push_back(rng.uniform_f64(1 + uint64_t(j)));
  }
  const int64_t len = lo + static_cast<int64_t>(b0.v[0] % static_cast<uint32_t>(seq_len - lo + 1));
  return answered(tok, io::multi_needle_fit(tok, len - 1, m));
}

SynthSeq retrieval_sequence(const io::Tokenizer& tok, int64_t seq_len, double multi_share, const Philox4& bits) {
  if (multi_share <= 0) return passkey_sequence(tok, seq_len, bits);
  // The choice from a draw of its own: the passkey documents keep the bits they had without multi-needle ones.
  const Rng pick{(uint64_t(bits.v[2]) << 32) | bits.v[3], kMultiNeedleStream};
  return pick.uniform_f64((uint64_t(bits.v[0]) << 32) | bits.v[1]) < multi_share
             ? multi_needle_sequence(tok, seq_len, bits)
             : passkey_sequence(tok, seq_len, bits);
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
  parallel_for_dynamic(n, [&](int64_t j) {
    docs[static_cast<size_t>(j)] = document(tok, draws[static_cast<size_t>(j)]).ids;
  });
  TokenizedDocs out;
  for (const auto& ids : docs) {
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
  }
  return out;
}

}  // namespace lm::train

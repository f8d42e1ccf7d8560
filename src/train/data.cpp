#include "train/data.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"

namespace lm::train {

namespace {

// Philox stream ids ("SPLIT", "SHUFF") so the split and the epoch orders never share draws.
constexpr uint64_t kSplitStream = 0x53504C4954ull, kShuffleStream = 0x5348554646ull;

// Fisher-Yates with draw i deciding position i: the same permutation on every machine.
std::vector<int64_t> permutation(int64_t n, const Rng& r) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  for (int64_t i = n - 1; i > 0; --i) {
    const Philox4 b = r.bits(static_cast<uint64_t>(i));
    const uint64_t x = (static_cast<uint64_t>(b.v[0]) << 32) | b.v[1];
    const auto j = static_cast<int64_t>(x % static_cast<uint64_t>(i + 1));  // bias < n / 2^64
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* s = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ s[i]) * 0x100000001B3ull;
  return h;
}

// A document's tokens and its loss mask (empty: every token a target).
struct DocRef {
  std::span<const int32_t> ids;
  std::span<const uint8_t> mask;
};
using DocSpan = std::optional<DocRef>;

DocRef doc_ref(const TokenizedDocs& docs, int64_t d) { return {docs.doc(d), docs.doc_mask(d)}; }

// Fills rows [0, B*T) of `b` from the stream: document `doc` (nullopt: the stream has ended) from its
// token `p` on, then whatever next_doc() yields (nullopt when there is no more). Rows past the end get
// `pad`. On return p is the next unread token of the document next_doc() last yielded (p < its length).
// A masked document loses its targets from a sequence start inside it on (its prompt is not in that sequence).
// concat: no segment boundary where a document starts inside a sequence (only at sequence starts and the padding).
template <class NextDoc>
void fill_rows(Batch& b, DocSpan doc, int64_t& p, NextDoc&& next_doc, int32_t pad, bool concat = false) {
  const int64_t B = b.seqs, T = b.seq_len, R = B * T;
  b.ids.resize(static_cast<size_t>(R));
  b.targets.resize(static_cast<size_t>(R));
  std::vector<int64_t> starts;  // rows where a document (or the padding) begins, increasing
  int64_t r = 0;
  while (r < R && doc) {
    const auto len = static_cast<int64_t>(doc->ids.size());
    const int64_t take = std::min(len - p, R - r);
    if (p == 0 && !concat) starts.push_back(r);
    const int32_t* src = doc->ids.data();
    const uint8_t* mask = doc->mask.empty() ? nullptr : doc->mask.data();
    bool cut = false;  // a sequence started inside this (masked) document
    for (int64_t i = 0; i < take; ++i) {
      const int64_t q = p + i;
      if ((r + i) % T == 0 && q > 0) cut = true;
      const bool target = q + 1 < len && (!mask || (!cut && mask[q + 1]));
      b.ids[static_cast<size_t>(r + i)] = src[q];
      b.targets[static_cast<size_t>(r + i)] = target ? src[q + 1] : kIgnore;
    }
    r += take, p += take;
    if (p == len) doc = next_doc(), p = 0;
  }
  if (r < R) {
    starts.push_back(r);
    std::fill(b.ids.begin() + r, b.ids.end(), pad);
    std::fill(b.targets.begin() + r, b.targets.end(), kIgnore);
  }
  b.cu_seqlens.clear();
  b.cu_seqlens.reserve(static_cast<size_t>(B) + starts.size() + 1);
  size_t j = 0;
  for (int64_t s = 0; s < B; ++s) {
    b.cu_seqlens.push_back(s * T);
    for (; j < starts.size() && starts[j] < (s + 1) * T; ++j)
      if (starts[j] != s * T) b.cu_seqlens.push_back(starts[j]);
  }
  b.cu_seqlens.push_back(R);
}

}  // namespace

std::span<const int32_t> TokenizedDocs::doc(int64_t d) const {
  LM_CHECK(d >= 0 && d < num_docs(), "document {} out of range [0, {})", d, num_docs());
  const auto b = static_cast<size_t>(offsets[static_cast<size_t>(d)]);
  const auto e = static_cast<size_t>(offsets[static_cast<size_t>(d) + 1]);
  return {ids.data() + b, e - b};
}

std::span<const uint8_t> TokenizedDocs::doc_mask(int64_t d) const {
  if (loss_mask.empty()) return {};
  LM_CHECK(loss_mask.size() == ids.size(), "loss mask of {} tokens for {} tokens", loss_mask.size(), ids.size());
  const auto s = doc(d);
  return {loss_mask.data() + (s.data() - ids.data()), s.size()};
}

uint64_t TokenizedDocs::fingerprint() const {
  uint64_t h = 0xCBF29CE484222325ull;
  h = fnv1a(h, ids.data(), ids.size() * sizeof(int32_t));
  h = fnv1a(h, offsets.data(), offsets.size() * sizeof(int64_t));
  return loss_mask.empty() ? h : fnv1a(h, loss_mask.data(), loss_mask.size());  // (unmasked data: as before masks)
}

TokenizedDocs tokenize_documents(const io::Tokenizer& tok, const std::vector<std::string>& docs, bool bos) {
  const auto n = static_cast<int64_t>(docs.size());
  const int32_t sep = tok.special("<|doc|>");
  const int64_t extra = bos ? 2 : 1;
  std::vector<std::vector<int32_t>> enc(docs.size());
  parallel_for_dynamic(n, [&](int64_t i) { enc[static_cast<size_t>(i)] = tok.encode(docs[static_cast<size_t>(i)]); });
  TokenizedDocs out;
  out.offsets.assign(docs.size() + 1, 0);
  for (size_t i = 0; i < docs.size(); ++i)
    out.offsets[i + 1] = out.offsets[i] + static_cast<int64_t>(enc[i].size()) + extra;
  out.ids.resize(static_cast<size_t>(out.offsets.back()));
  parallel_for(n, [&](int64_t i) {
    const auto k = static_cast<size_t>(i);
    auto at = out.ids.begin() + out.offsets[k];
    if (bos) *at++ = tok.bos();
    std::copy(enc[k].begin(), enc[k].end(), at);
    out.ids[static_cast<size_t>(out.offsets[k + 1] - 1)] = sep;
  });
  return out;
}

TokenizedDocs tokenize_conversations(const io::Tokenizer& tok, const std::vector<io::Conversation>& convs) {
  const auto n = static_cast<int64_t>(convs.size());
  std::vector<std::vector<int32_t>> ids(convs.size());
  std::vector<std::vector<uint8_t>> masks(convs.size());
  parallel_for_dynamic(n, [&](int64_t i) {
    const auto k = static_cast<size_t>(i);
    ids[k] = io::chat_tokens(tok, convs[k], false, true, -1, &masks[k]);
  });
  TokenizedDocs out;
  for (size_t k = 0; k < convs.size(); ++k) {
    out.ids.insert(out.ids.end(), ids[k].begin(), ids[k].end());
    out.loss_mask.insert(out.loss_mask.end(), masks[k].begin(), masks[k].end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
  }
  return out;
}

TokenizedDocs select_documents(const TokenizedDocs& all, const std::vector<int64_t>& which) {
  TokenizedDocs out;
  out.offsets.reserve(which.size() + 1);
  for (const int64_t d : which) {
    const auto s = all.doc(d);
    out.ids.insert(out.ids.end(), s.begin(), s.end());
    out.offsets.push_back(static_cast<int64_t>(out.ids.size()));
    const auto m = all.doc_mask(d);
    out.loss_mask.insert(out.loss_mask.end(), m.begin(), m.end());
  }
  return out;
}

DataSplit split_documents(const TokenizedDocs& all, double heldout_fraction, uint64_t seed) {
  LM_CHECK(heldout_fraction >= 0.0 && heldout_fraction < 1.0, "held-out fraction {} must lie in [0, 1)",
           heldout_fraction);
  const int64_t n = all.num_docs();
  int64_t k = std::llround(heldout_fraction * static_cast<double>(n));
  if (heldout_fraction > 0 && n >= 2) k = std::clamp<int64_t>(k, 1, n - 1);
  k = std::clamp<int64_t>(k, 0, n);
  const std::vector<int64_t> perm = permutation(n, Rng{seed, kSplitStream});
  DataSplit s;
  s.heldout_docs.assign(perm.begin(), perm.begin() + k);
  s.train_docs.assign(perm.begin() + k, perm.end());
  std::sort(s.heldout_docs.begin(), s.heldout_docs.end());
  std::sort(s.train_docs.begin(), s.train_docs.end());
  s.train = select_documents(all, s.train_docs);
  s.heldout = select_documents(all, s.heldout_docs);
  return s;
}

int64_t Batch::predicted() const {
  return static_cast<int64_t>(std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t != kIgnore; }));
}

Batch Batch::sequences(int64_t first, int64_t n) const {
  LM_CHECK(first >= 0 && n > 0 && first + n <= seqs, "batch: sequences [{}, {}) outside [0, {})", first, first + n,
           seqs);
  const int64_t lo = first * seq_len, hi = (first + n) * seq_len;
  Batch out;
  out.seqs = n, out.seq_len = seq_len;
  out.ids.assign(ids.begin() + lo, ids.begin() + hi);
  out.targets.assign(targets.begin() + lo, targets.begin() + hi);
  if (!weights.empty()) out.weights.assign(weights.begin() + lo, weights.begin() + hi);
  for (const int64_t c : cu_seqlens)  // every sequence start is a boundary, so lo and hi are in it
    if (c >= lo && c <= hi) out.cu_seqlens.push_back(c - lo);
  return out;
}

Batch Batch::segment(int64_t rank, int64_t ranks) const {
  LM_CHECK(ranks >= 1 && rank >= 0 && rank < ranks && seq_len % ranks == 0,
           "batch: segment {} of {} of sequences of {} tokens (cp must divide seq_len)", rank, ranks, seq_len);
  bool whole = cu_seqlens.size() == static_cast<size_t>(seqs) + 1;
  for (size_t i = 0; whole && i < cu_seqlens.size(); ++i) whole = cu_seqlens[i] == static_cast<int64_t>(i) * seq_len;
  LM_CHECK(whole, "batch: context parallel splits whole sequences, but this batch has {} segments in {} sequences (a "
           "document boundary or padding inside a sequence; packed batches are not split over ranks)",
           cu_seqlens.size() - 1, seqs);
  const int64_t T = seq_len / ranks;
  Batch out;
  out.seqs = seqs, out.seq_len = T;
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t lo = b * seq_len + rank * T;
    out.ids.insert(out.ids.end(), ids.begin() + lo, ids.begin() + lo + T);
    out.targets.insert(out.targets.end(), targets.begin() + lo, targets.begin() + lo + T);
    if (!weights.empty()) out.weights.insert(out.weights.end(), weights.begin() + lo, weights.begin() + lo + T);
    out.cu_seqlens.push_back(b * T);
  }
  out.cu_seqlens.push_back(seqs * T);
  return out;
}

void to_json(io::json& j, const Position& p) { j = io::json{{"epoch", p.epoch}, {"offset", p.offset}}; }

void from_json(const io::json& j, Position& p) {
  LM_CHECK(j.is_object(), "data position: expected an object {{\"epoch\", \"offset\"}}, got {}", j.type_name());
  for (const char* key : {"epoch", "offset"})
    LM_CHECK(j.contains(key) && j[key].is_number_unsigned(),
             "data position: field '{}' is missing or not a non-negative integer", key);
  p.epoch = j["epoch"].get<uint64_t>();
  p.offset = j["offset"].get<uint64_t>();
}

Loader::Loader(std::shared_ptr<const TokenizedDocs> docs, int64_t seq_len, uint64_t seed, Position start,
               ExtraDocs extra)
    : docs_(std::move(docs)), seq_len_(seq_len), seed_(seed), extra_(std::move(extra)) {
  LM_CHECK(docs_ && docs_->num_docs() > 0, "data loader: the training split holds no documents");
  set_seq_len(seq_len);
  seek(start);
}

void Loader::set_seq_len(int64_t seq_len) {
  LM_CHECK(seq_len > 0, "data loader: seq_len {} must be positive", seq_len);
  seq_len_ = seq_len;
}

void Loader::seek(Position p) {
  LM_CHECK(p.offset < static_cast<uint64_t>(epoch_tokens(p.epoch)),
           "data position offset {} is outside an epoch of {} tokens (was the position saved for other data?)",
           p.offset, epoch_tokens(p.epoch));
  pos_ = p;
}

void Loader::set_extra(ExtraDocs extra) {
  const CorpusPoint c = corpus_point();
  extra_ = std::move(extra);
  plans_.clear();
  pos_ = position_of(c);
}

Loader::CorpusPoint Loader::corpus_point() const {
  const Plan& pl = plan(pos_.epoch);
  const auto off = static_cast<int64_t>(pos_.offset);
  const auto s = std::upper_bound(pl.cum.begin(), pl.cum.end(), off) - pl.cum.begin() - 1;  // entry
  const auto k = std::lower_bound(pl.corpus_at.begin(), pl.corpus_at.end(), s) - pl.corpus_at.begin();
  const auto N = docs_->num_docs();
  if (k < N && pl.corpus_at[static_cast<size_t>(k)] == s) return {pos_.epoch, k, off - pl.cum[static_cast<size_t>(s)]};
  if (k < N) return {pos_.epoch, k, 0};  // inside an extra document: the corpus document after it
  return {pos_.epoch + 1, 0, 0};
}

Position Loader::position_of(CorpusPoint c) const {
  const Plan& pl = plan(c.epoch);
  const auto N = docs_->num_docs();
  LM_CHECK(c.slot >= 0 && c.slot < N, "data loader: corpus position {} outside [0, {})", c.slot, N);
  const auto s = static_cast<size_t>(pl.corpus_at[static_cast<size_t>(c.slot)]);
  LM_CHECK(c.token >= 0 && c.token < pl.cum[s + 1] - pl.cum[s], "data loader: token {} outside document of {}",
           c.token, pl.cum[s + 1] - pl.cum[s]);
  return Position{c.epoch, static_cast<uint64_t>(pl.cum[s] + c.token)};
}

int64_t Loader::epoch_tokens(uint64_t epoch) const { return plan(epoch).cum.back(); }

int64_t Loader::epoch_extra_tokens(uint64_t epoch) const {
  const Plan& pl = plan(epoch);
  return pl.extra ? pl.extra->tokens() : 0;
}

double Loader::epochs_done() const {
  return static_cast<double>(pos_.epoch) + static_cast<double>(pos_.offset) / static_cast<double>(epoch_tokens());
}

uint64_t Loader::fingerprint() const {
  const uint64_t h = docs_->fingerprint();
  return fnv1a(h, &seed_, sizeof(seed_));
}

std::vector<int64_t> Loader::epoch_order(uint64_t epoch) const {
  return permutation(docs_->num_docs(), Rng{seed_, kShuffleStream}.fork(epoch));
}

std::span<const int32_t> Loader::Plan::doc(const TokenizedDocs& corpus, int64_t entry) const {
  const int64_t d = order[static_cast<size_t>(entry)], N = corpus.num_docs();
  return d < N ? corpus.doc(d) : extra->doc(d - N);
}

std::span<const uint8_t> Loader::Plan::mask(const TokenizedDocs& corpus, int64_t entry) const {
  const int64_t d = order[static_cast<size_t>(entry)], N = corpus.num_docs();
  return d < N ? corpus.doc_mask(d) : extra->doc_mask(d - N);
}

const Loader::Plan& Loader::plan(uint64_t epoch) const {
  auto it = plans_.find(epoch);
  if (it != plans_.end()) return it->second;
  while (!plans_.empty() && plans_.begin()->first + 1 < epoch) plans_.erase(plans_.begin());  // keep e-1 and e
  Plan pl;
  const std::vector<int64_t> corpus = epoch_order(epoch);
  const auto N = static_cast<int64_t>(corpus.size());
  int64_t M = 0;
  if (extra_) {
    pl.extra = std::make_shared<const TokenizedDocs>(extra_(epoch));
    M = pl.extra->num_docs();
  }
  pl.order.reserve(static_cast<size_t>(N + M));
  pl.corpus_at.resize(static_cast<size_t>(N) + 1);
  for (int64_t k = 0, j = 0; k < N; ++k) {
    for (; j < M && j * N / M == k; ++j) pl.order.push_back(N + j);  // extra j before corpus position j*N/M
    pl.corpus_at[static_cast<size_t>(k)] = static_cast<int64_t>(pl.order.size());
    pl.order.push_back(corpus[static_cast<size_t>(k)]);
  }
  pl.corpus_at[static_cast<size_t>(N)] = static_cast<int64_t>(pl.order.size());
  pl.cum.assign(pl.order.size() + 1, 0);
  for (size_t s = 0; s < pl.order.size(); ++s)
    pl.cum[s + 1] = pl.cum[s] + static_cast<int64_t>(pl.doc(*docs_, static_cast<int64_t>(s)).size());
  return plans_.emplace(epoch, std::move(pl)).first->second;
}

Batch Loader::next(int64_t B) {
  LM_CHECK(B > 0, "data loader: batch of {} sequences", B);
  const int64_t T = seq_len_;
  uint64_t e = pos_.epoch;
  int64_t Lg = epoch_tokens(e) / B;
  if (Lg < T) return next_consecutive(B);
  // Lane offset: offset = B*o after a batch; another B (or a re-mixed position) rounds up.
  auto o = static_cast<int64_t>((pos_.offset + static_cast<uint64_t>(B) - 1) / static_cast<uint64_t>(B));
  if (o + T > Lg) {  // the epoch is done
    ++e, o = 0;
    Lg = epoch_tokens(e) / B;
    if (Lg < T) {
      pos_ = Position{e, 0};
      return next_consecutive(B);
    }
  }
  const Plan& pl = plan(e);
  const auto n = static_cast<int64_t>(pl.order.size());
  Batch b;
  b.seqs = B, b.seq_len = T;
  b.ids.resize(static_cast<size_t>(B * T));
  b.targets.resize(static_cast<size_t>(B * T));
  b.cu_seqlens.reserve(static_cast<size_t>(B) + 1);
  const bool weighted = concat_ && answer_weight_ != 1;  // (answer_weight_ is 1 without synth_)
  if (weighted) b.weights.assign(static_cast<size_t>(B * T), 1.f);
  Batch row;  // sequence r: T tokens of lane r from lane offset o, with its document boundaries
  row.seqs = 1, row.seq_len = T;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t s = r * Lg + o;  // its stream offset; s + T <= B*Lg <= L
    auto k = static_cast<int64_t>(std::upper_bound(pl.cum.begin(), pl.cum.end(), s) - pl.cum.begin()) - 1;
    int64_t p = s - pl.cum[static_cast<size_t>(k)];
    const uint64_t draw = 2 * static_cast<uint64_t>(o * B + r);  // (the choice, then the document's bits)
    if (concat_ && synth_ && synth_rng_.fork(e).uniform_f64(draw) < synth_fraction_) {
      const SynthSeq d = synth_(synth_rng_.fork(e).bits(draw + 1));
      const auto len = static_cast<int64_t>(d.ids.size());
      LM_CHECK(len > 0 && len <= T, "data loader: a synthetic sequence of {} tokens for seq_len {}", len, T);
      LM_CHECK(d.answer_from >= 0 && d.answer_from <= d.answer_to && d.answer_to <= len,
               "data loader: a synthetic sequence's answer [{}, {}) outside its {} tokens", d.answer_from,
               d.answer_to, len);
      int64_t q = 0;
      fill_rows(row, DocRef{std::span<const int32_t>(d.ids), {}}, q, []() -> DocSpan { return std::nullopt; }, 0);
      if (weighted)  // position t predicts token t + 1
        for (int64_t t = std::max<int64_t>(d.answer_from, 1); t < d.answer_to; ++t)
          b.weights[static_cast<size_t>(r * T + t - 1)] = static_cast<float>(answer_weight_);
    } else {
      fill_rows(row, DocRef{pl.doc(*docs_, k), pl.mask(*docs_, k)}, p, [&]() -> DocSpan {
        if (++k == n) return std::nullopt;  // only after the row's last token: the row never passes L
        return DocRef{pl.doc(*docs_, k), pl.mask(*docs_, k)};
      }, 0, concat_);
    }
    std::copy(row.ids.begin(), row.ids.end(), b.ids.begin() + r * T);
    std::copy(row.targets.begin(), row.targets.end(), b.targets.begin() + r * T);
    for (size_t i = 0; i + 1 < row.cu_seqlens.size(); ++i) b.cu_seqlens.push_back(r * T + row.cu_seqlens[i]);
  }
  b.cu_seqlens.push_back(B * T);
  const auto done = static_cast<uint64_t>(B * (o + T));
  pos_ = done < static_cast<uint64_t>(epoch_tokens(e)) ? Position{e, done} : Position{e + 1, 0};
  return b;
}

void Loader::set_concat(bool on, double fraction, Synth synth, Rng rng, double answer_weight) {
  LM_CHECK(fraction >= 0 && fraction <= 1, "data loader: synthetic fraction {} outside [0, 1]", fraction);
  LM_CHECK(answer_weight > 0 && std::isfinite(answer_weight), "data loader: answer weight {} must be positive",
           answer_weight);
  concat_ = on, synth_fraction_ = fraction, synth_ = std::move(synth), synth_rng_ = rng;
  answer_weight_ = synth_ ? answer_weight : 1;
}

Batch Loader::next_consecutive(int64_t B) {
  Batch b;
  b.seqs = B, b.seq_len = seq_len_;
  uint64_t e = pos_.epoch;
  const Plan* pl = &plan(e);
  auto n = static_cast<int64_t>(pl->order.size());
  auto k = static_cast<int64_t>(std::upper_bound(pl->cum.begin(), pl->cum.end(), static_cast<int64_t>(pos_.offset)) -
                                pl->cum.begin()) - 1;
  int64_t p = static_cast<int64_t>(pos_.offset) - pl->cum[static_cast<size_t>(k)];
  // The plan whose document is being read stays cached: plan(e + 1) drops only epochs before e.
  fill_rows(b, DocRef{pl->doc(*docs_, k), pl->mask(*docs_, k)}, p, [&]() -> DocSpan {
    if (++k == n) k = 0, pl = &plan(++e), n = static_cast<int64_t>(pl->order.size());
    return DocRef{pl->doc(*docs_, k), pl->mask(*docs_, k)};
  }, 0, concat_);
  pos_ = Position{e, static_cast<uint64_t>(pl->cum[static_cast<size_t>(k)] + p)};
  return b;
}

std::vector<Batch> eval_batches(const TokenizedDocs& heldout, int64_t seq_len, int64_t B, int32_t pad_id,
                                int64_t max_batches) {
  LM_CHECK(seq_len > 0 && B > 0, "held-out batches: seq_len {} and batch {} must be positive", seq_len, B);
  std::vector<Batch> out;
  const int64_t n = heldout.num_docs();
  int64_t d = 0, p = 0;
  while (d < n && (max_batches <= 0 || static_cast<int64_t>(out.size()) < max_batches)) {
    Batch b;
    b.seqs = B, b.seq_len = seq_len;
    fill_rows(b, doc_ref(heldout, d), p, [&]() -> DocSpan {
      if (++d < n) return doc_ref(heldout, d);
      return std::nullopt;
    }, pad_id);
    out.push_back(std::move(b));
  }
  return out;
}

Unigram Unigram::fit(const TokenizedDocs& train, int32_t vocab_size) {
  LM_CHECK(vocab_size > 0, "unigram baseline: vocab_size {} must be positive", vocab_size);
  std::vector<int64_t> count(static_cast<size_t>(vocab_size), 0);
  int64_t n = 0;
  for (int64_t d = 0; d < train.num_docs(); ++d) {
    const auto s = train.doc(d);
    const auto m = train.doc_mask(d);
    for (size_t i = 1; i < s.size(); ++i) {
      if (!m.empty() && !m[i]) continue;
      ++n;
      LM_CHECK(s[i] >= 0 && s[i] < vocab_size, "unigram baseline: token id {} outside the vocabulary [0, {})", s[i],
               vocab_size);
      ++count[static_cast<size_t>(s[i])];
    }
  }
  Unigram u;
  u.log_prob.resize(count.size());
  const double denom = std::log(static_cast<double>(n) + vocab_size);
  for (size_t v = 0; v < count.size(); ++v) u.log_prob[v] = std::log(static_cast<double>(count[v]) + 1.0) - denom;
  return u;
}

double Unigram::cross_entropy(const std::vector<Batch>& batches) const {
  double nll = 0;
  int64_t n = 0;
  for (const auto& b : batches)
    for (const int32_t t : b.targets) {
      if (t == kIgnore) continue;
      LM_CHECK(t >= 0 && static_cast<size_t>(t) < log_prob.size(), "unigram baseline: target {} outside [0, {})", t,
               log_prob.size());
      nll -= log_prob[static_cast<size_t>(t)], ++n;
    }
  LM_CHECK(n > 0, "unigram baseline: no targets to evaluate");
  return nll / static_cast<double>(n);
}

double Unigram::cross_entropy(const TokenizedDocs& heldout) const {
  double nll = 0;
  int64_t n = 0;
  for (int64_t d = 0; d < heldout.num_docs(); ++d) {
    const auto s = heldout.doc(d);
    const auto m = heldout.doc_mask(d);
    for (size_t i = 1; i < s.size(); ++i) {
      if (!m.empty() && !m[i]) continue;
      LM_CHECK(s[i] >= 0 && static_cast<size_t>(s[i]) < log_prob.size(), "unigram baseline: token {} outside [0, {})",
               s[i], log_prob.size());
      nll -= log_prob[static_cast<size_t>(s[i])], ++n;
    }
  }
  LM_CHECK(n > 0, "unigram baseline: the held-out split has no targets");
  return nll / static_cast<double>(n);
}

}  // namespace lm::train

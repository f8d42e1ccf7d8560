// Training data: tokenizing documents, the held-out split, packing invariants (targets, boundaries,
// every token once per epoch), resume and re-pack positions, held-out batches, the unigram baseline.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "core/parallel.hpp"
#include "model/seqs.hpp"
#include "testing.hpp"
#include "train/data.hpp"

namespace {

using namespace lm::train;
namespace fs = std::filesystem;

// N documents of lengths 1..max_len (the last token plays the separator); token values encode
// (document, position) so a test can tell where every row came from.
std::shared_ptr<TokenizedDocs> toy_docs(int64_t n, int64_t max_len, uint64_t seed) {
  auto d = std::make_shared<TokenizedDocs>();
  lm::Rng r{seed, 11};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = 1 + static_cast<int64_t>(r.bits(static_cast<uint64_t>(i)).v[0] % static_cast<uint32_t>(max_len));
    for (int64_t p = 0; p < len; ++p) d->ids.push_back(static_cast<int32_t>(i * 1000 + p));
    d->offsets.push_back(static_cast<int64_t>(d->ids.size()));
  }
  return d;
}

struct Where {
  int64_t doc, pos, len;
};

// The reference stream: epochs' documents in the loader's order, with (doc, pos, len) per token.
std::vector<Where> reference_stream(const TokenizedDocs& D, const Loader& L, uint64_t epochs) {
  std::vector<Where> s;
  for (uint64_t e = 0; e < epochs; ++e)
    for (const int64_t d : L.epoch_order(e)) {
      const int64_t len = static_cast<int64_t>(D.doc(d).size());
      for (int64_t p = 0; p < len; ++p) s.push_back({d, p, len});
    }
  return s;
}

// Checks a batch against the reference stream: sequence r from reference index starts[r] on.
void check_rows(const Batch& b, const TokenizedDocs& D, const std::vector<Where>& ref, const std::vector<size_t>& starts) {
  const int64_t B = b.seqs, T = b.seq_len, R = B * T;
  EXPECT_EQ(b.tokens(), R);
  EXPECT_EQ(static_cast<int64_t>(b.targets.size()), R);
  ASSERT_EQ(static_cast<int64_t>(starts.size()), B);
  std::vector<int64_t> want_cu;
  for (int64_t r = 0; r < R; ++r) {
    const Where& w = ref.at(starts[static_cast<size_t>(r / T)] + static_cast<size_t>(r % T));
    const auto doc = D.doc(w.doc);
    EXPECT_EQ(b.ids[static_cast<size_t>(r)], doc[static_cast<size_t>(w.pos)]) << "row " << r;
    const int32_t want_t = w.pos + 1 < w.len ? doc[static_cast<size_t>(w.pos + 1)] : kIgnore;
    EXPECT_EQ(b.targets[static_cast<size_t>(r)], want_t) << "row " << r;
    if (r % T == 0 || w.pos == 0) want_cu.push_back(r);
  }
  want_cu.push_back(R);
  EXPECT_EQ(b.cu_seqlens, want_cu);
  // And what the model will make of it.
  const auto seqs = lm::model::Seqs::packed(b.cu_seqlens);
  EXPECT_EQ(seqs.rows(), R);
  for (int64_t n = 0; n < seqs.num_seqs(); ++n) EXPECT_GT(seqs.seq_len(n), 0);
}

// Consecutive sequences from reference index `at` (held-out batches); returns the index after them.
size_t check_batch(const Batch& b, const TokenizedDocs& D, const std::vector<Where>& ref, size_t at) {
  std::vector<size_t> starts;
  for (int64_t r = 0; r < b.seqs; ++r) starts.push_back(at + static_cast<size_t>(r * b.seq_len));
  check_rows(b, D, ref, starts);
  return at + static_cast<size_t>(b.seqs * b.seq_len);
}

// The lane layout written out independently of the loader: where each sequence of the next batch
// starts in the reference stream (epochs back to back, epoch e of L[e] tokens), and the position after.
struct LaneModel {
  std::vector<int64_t> L;  // tokens of epoch e
  Position pos;
  size_t base(uint64_t e) const {
    size_t s = 0;
    for (uint64_t i = 0; i < e; ++i) s += static_cast<size_t>(L.at(i));
    return s;
  }
  std::vector<size_t> next(int64_t B, int64_t T) {
    std::vector<size_t> starts;
    int64_t Lg = L.at(pos.epoch) / B;
    if (Lg < T) {  // small epoch: consecutive
      size_t at = base(pos.epoch) + pos.offset;
      for (int64_t r = 0; r < B; ++r) starts.push_back(at + static_cast<size_t>(r * T));
      at += static_cast<size_t>(B * T);
      pos = {};
      while (at >= base(pos.epoch + 1)) ++pos.epoch;
      pos.offset = at - base(pos.epoch);
      return starts;
    }
    int64_t o = (static_cast<int64_t>(pos.offset) + B - 1) / B;
    if (o + T > Lg) {
      ++pos.epoch, o = 0;
      Lg = L.at(pos.epoch) / B;
      EXPECT_GE(Lg, T) << "the model covers a small epoch only at the start of a batch";
    }
    for (int64_t r = 0; r < B; ++r) starts.push_back(base(pos.epoch) + static_cast<size_t>(r * Lg + o));
    pos.offset = static_cast<uint64_t>(B * (o + T));
    if (pos.offset >= static_cast<uint64_t>(L[pos.epoch])) ++pos.epoch, pos.offset = 0;
    return starts;
  }
};

LaneModel lane_model(const Loader& L, uint64_t epochs) {
  LaneModel m;
  for (uint64_t e = 0; e < epochs; ++e) m.L.push_back(L.epoch_tokens(e));
  return m;
}

TEST(Data, PackingInvariantsOverEpochs) {
  for (const auto& [n, max_len, T, B] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {37, 50, 16, 3}, {5, 400, 32, 2}, {3, 4, 64, 4} /* an epoch is smaller than a batch */, {1, 1, 1, 1},
           {60, 90, 8, 7}}) {
    auto D = toy_docs(n, max_len, static_cast<uint64_t>(n));
    Loader L(D, T, 1234);
    const int64_t Lt = D->tokens(), Lg = Lt / B;
    const bool lanes = Lg >= T;
    // At least 3 epochs and 20 batches.
    const int64_t per_epoch = lanes ? Lg / T : 0;
    const int64_t batches = std::max<int64_t>(20, lanes ? 3 * per_epoch + 1 : 3 * Lt / (B * T) + 1);
    const auto epochs = static_cast<uint64_t>(lanes ? batches / per_epoch + 2 : batches * B * T / Lt + 2);
    const auto ref = reference_stream(*D, L, epochs);
    LaneModel model = lane_model(L, epochs);
    std::vector<int64_t> seen(static_cast<size_t>(Lt), 0);  // epoch-0 tokens by stream offset
    for (int64_t i = 0; i < batches; ++i) {
      const Batch b = L.next(B);
      const auto starts = model.next(B, T);
      for (const size_t s : starts)
        for (size_t t = s; t < s + static_cast<size_t>(T) && t < static_cast<size_t>(Lt); ++t) ++seen[t];
      check_rows(b, *D, ref, starts);
      EXPECT_EQ(L.position(), model.pos) << "batch " << i;
      // The position is always normalised into its epoch.
      EXPECT_LT(L.position().offset, static_cast<uint64_t>(Lt));
    }
    // Epoch 0: consecutive, every token exactly once; lanes, every token of the lanes' first
    // floor(Lg / T) * T exactly once, the rest (lane tails, the last L - B*Lg) never.
    for (int64_t t = 0; t < Lt; ++t) {
      const bool read = !lanes || (t / Lg < B && t % Lg < per_epoch * T);
      EXPECT_EQ(seen[static_cast<size_t>(t)], read ? 1 : 0) << "stream offset " << t;
    }
    EXPECT_GE(L.position().epoch, 2u);
  }
}

TEST(Data, BatchRowsComeFromBLanes) {
  auto D = toy_docs(200, 40, 8);  // ~4000 tokens, documents of at most 40
  const int64_t B = 8, T = 16;
  Loader L(D, T, 31);
  const auto ref = reference_stream(*D, L, 3);
  const int64_t Lt = D->tokens(), Lg = Lt / B, per_epoch = Lg / T;
  ASSERT_GE(per_epoch, 3);
  for (uint64_t e = 0; e < 2; ++e) {
    std::vector<int64_t> seen(static_cast<size_t>(Lt), 0);
    for (int64_t i = 0; i < per_epoch; ++i) {
      EXPECT_EQ(L.position(), (Position{e, static_cast<uint64_t>(B * T * i)})) << "offset = B * lane offset";
      const Batch b = L.next(B);
      std::set<int64_t> docs;
      for (int64_t r = 0; r < B; ++r) {
        // Sequence r starts at stream offset r*Lg + i*T of epoch e.
        const size_t s = e * static_cast<size_t>(Lt) + static_cast<size_t>(r * Lg + i * T);
        const Where& w = ref[s];
        EXPECT_EQ(b.ids[static_cast<size_t>(r * T)], D->doc(w.doc)[static_cast<size_t>(w.pos)]) << "row " << r;
        for (int64_t t = 0; t < T; ++t) ++seen[static_cast<size_t>(r * Lg + i * T + t)];
        docs.insert(w.doc);
      }
      EXPECT_EQ(static_cast<int64_t>(docs.size()), B) << "documents are at most 40 tokens, lanes ~500 apart";
    }
    // Every token of the epoch's lanes exactly once; the rest of the epoch never.
    for (int64_t t = 0; t < Lt; ++t)
      EXPECT_EQ(seen[static_cast<size_t>(t)], t / Lg < B && t % Lg < per_epoch * T ? 1 : 0) << "offset " << t;
    // Dropping the remainder: the next batch starts the next epoch.
    EXPECT_EQ(L.next(B).ids[0], D->doc(L.epoch_order(e + 1)[0])[0]);
    L.seek(Position{e + 1, 0});
  }
}

// A long-context stage (Loader::set_concat): the same ids and targets as without it, but segments only at sequence
// starts; with a synthetic fraction, the chosen sequences hold the synthetic document alone (padded, its own segment),
// about `fraction` of them, the others their lanes' tokens as before; a resumed loader reads the same batches.
TEST(Data, ConcatenatedDocumentsAndWholeWindowSequences) {
  auto D = toy_docs(300, 40, 21);
  const int64_t B = 4, T = 32;
  Loader plain(D, T, 5), cat(D, T, 5);
  cat.set_concat(true);
  for (int i = 0; i < 10; ++i) {
    const Batch a = plain.next(B), b = cat.next(B);
    EXPECT_EQ(a.ids, b.ids) << i;
    EXPECT_EQ(a.targets, b.targets) << i;
    EXPECT_GT(a.cu_seqlens.size(), size_t(B + 1)) << "documents of at most 40 tokens start inside the sequences";
    EXPECT_EQ(b.cu_seqlens, (std::vector<int64_t>{0, T, 2 * T, 3 * T, 4 * T})) << i;
  }
  // Synthetic sequences: a document of 7..T tokens (value 1000000 + length at every place).
  auto synth = [](const lm::Philox4& bits) {
    const int64_t n = 7 + int64_t(bits.v[0] % 26);
    return SynthSeq{std::vector<int32_t>(size_t(n), int32_t(1000000 + n)), n - 4, n - 1};
  };
  const lm::Rng rng{3, 77};
  Loader with(D, T, 5), ref(D, T, 5);
  with.set_concat(true, 0.3, synth, rng);
  ref.set_concat(true);
  int64_t chosen = 0, total = 0;
  std::vector<Batch> straight;
  Position mid;
  for (int i = 0; i < 60; ++i) {
    if (i == 25) mid = with.position();
    const Batch b = with.next(B), r = ref.next(B);
    straight.push_back(b);
    std::vector<int64_t> want_cu;
    for (int64_t s = 0; s < B; ++s, ++total) {
      want_cu.push_back(s * T);
      const int32_t first = b.ids[size_t(s * T)];
      if (first < 1000000) {  // the lane's tokens, as without synthetic sequences
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(b.ids[size_t(s * T + t)], r.ids[size_t(s * T + t)]);
          EXPECT_EQ(b.targets[size_t(s * T + t)], r.targets[size_t(s * T + t)]);
        }
        continue;
      }
      ++chosen;
      const int64_t n = first - 1000000;
      ASSERT_LE(n, T);
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(b.ids[size_t(s * T + t)], t < n ? first : 0) << "padded after the document";
        EXPECT_EQ(b.targets[size_t(s * T + t)], t + 1 < n ? first : kIgnore);
      }
      if (n < T) want_cu.push_back(s * T + n);  // the padding is a segment of its own
    }
    want_cu.push_back(B * T);
    EXPECT_EQ(b.cu_seqlens, want_cu) << i;
    EXPECT_EQ(with.position(), ref.position()) << "a chosen sequence skips its lane's tokens";
  }
  std::printf("synthetic sequences: %ld of %ld (fraction 0.3)\n", long(chosen), long(total));
  EXPECT_GT(chosen, total / 5);
  EXPECT_LT(chosen, total * 2 / 5);
  Loader resumed(D, T, 5, mid);
  resumed.set_concat(true, 0.3, synth, rng);
  for (int i = 25; i < 60; ++i) {
    const Batch b = resumed.next(B);
    EXPECT_EQ(b.ids, straight[size_t(i)].ids) << i;
    EXPECT_EQ(b.cu_seqlens, straight[size_t(i)].cu_seqlens) << i;
  }
  EXPECT_TRUE(straight[0].weights.empty()) << "answer weight 1: no weights";
  auto too_long = [](const lm::Philox4&) { return SynthSeq{std::vector<int32_t>(40, 1)}; };
  Loader bad(D, T, 5);
  bad.set_concat(true, 1.0, too_long, rng);
  EXPECT_THROW(bad.next(B), lm::Error);
  EXPECT_THROW(bad.set_concat(true, 1.5, synth, rng), lm::Error);
  auto bad_span = [](const lm::Philox4&) { return SynthSeq{std::vector<int32_t>(10, 1), 4, 11}; };
  bad.set_concat(true, 1.0, bad_span, rng);
  EXPECT_THROW(bad.next(B), lm::Error);
  EXPECT_THROW(bad.set_concat(true, 0.3, synth, rng, 0.0), lm::Error);
  EXPECT_THROW(bad.set_concat(true, 0.3, synth, rng, -2.0), lm::Error);
}

// data.answer_weight (Loader::set_concat's answer_weight): the targets that predict a synthetic sequence's answer span
// weigh that much, every other target 1 (the corpus rows, the rest of the synthetic rows, the padding); micro-batches
// and context-parallel segments carry their share of the weights.
TEST(Data, AnswerSpansOfSyntheticSequencesAreWeighted) {
  auto D = toy_docs(300, 40, 21);
  const int64_t B = 4, T = 32;
  auto synth = [](const lm::Philox4& bits) {  // n tokens 1000000 + n; the answer: tokens [n - 4, n - 1)
    const int64_t n = 7 + int64_t(bits.v[0] % 26);
    return SynthSeq{std::vector<int32_t>(size_t(n), int32_t(1000000 + n)), n - 4, n - 1};
  };
  const lm::Rng rng{3, 77};
  Loader L(D, T, 5), same(D, T, 5);
  L.set_concat(true, 0.5, synth, rng, 7.5);
  same.set_concat(true, 0.5, synth, rng);
  int64_t weighted_rows = 0;
  for (int i = 0; i < 20; ++i) {
    const Batch b = L.next(B), u = same.next(B);
    EXPECT_EQ(b.ids, u.ids) << "the weight changes no token";
    EXPECT_EQ(b.targets, u.targets);
    ASSERT_EQ(b.weights.size(), b.targets.size());
    for (int64_t s = 0; s < B; ++s) {
      const int32_t first = b.ids[size_t(s * T)];
      const int64_t n = first >= 1000000 ? first - 1000000 : 0;
      weighted_rows += n > 0;
      for (int64_t t = 0; t < T; ++t)  // position t predicts token t + 1
        EXPECT_EQ(b.weights[size_t(s * T + t)], n > 0 && t + 1 >= n - 4 && t + 1 < n - 1 ? 7.5f : 1.f)
            << "row " << s << " position " << t;
    }
    const Batch m = b.sequences(1, 2);
    EXPECT_EQ(m.weights, std::vector<float>(b.weights.begin() + T, b.weights.begin() + 3 * T));
  }
  EXPECT_GT(weighted_rows, 20);
  Batch whole;  // context parallel: segment 1 of 2 of one whole sequence
  whole.seqs = 1, whole.seq_len = 4, whole.ids = {1, 2, 3, 4}, whole.targets = {2, 3, 4, -1};
  whole.weights = {1, 2, 3, 1}, whole.cu_seqlens = {0, 4};
  EXPECT_EQ(whole.segment(1, 2).weights, (std::vector<float>{3, 1}));
}

TEST(Data, MicroBatchesSplitABatch) {
  auto D = toy_docs(50, 30, 12);
  Loader L(D, 16, 2);
  const Batch b = L.next(6);
  Batch joined;
  for (int64_t s = 0; s < 6; s += 2) {
    const Batch m = b.sequences(s, 2);
    EXPECT_EQ(m.seqs, 2);
    EXPECT_EQ(m.seq_len, 16);
    EXPECT_EQ(lm::model::Seqs::packed(m.cu_seqlens).rows(), 32);
    for (const int64_t c : std::vector<int64_t>(m.cu_seqlens.begin(), m.cu_seqlens.end() - 1))
      joined.cu_seqlens.push_back(c + s * 16);
    joined.ids.insert(joined.ids.end(), m.ids.begin(), m.ids.end());
    joined.targets.insert(joined.targets.end(), m.targets.begin(), m.targets.end());
  }
  joined.cu_seqlens.push_back(96);
  EXPECT_EQ(joined.ids, b.ids);
  EXPECT_EQ(joined.targets, b.targets);
  EXPECT_EQ(joined.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(b.sequences(0, 6).ids, b.ids);
  EXPECT_THROW(b.sequences(5, 2), lm::Error);
}

TEST(Data, EpochsAreShuffledDifferentlyAndDeterministically) {
  auto D = toy_docs(50, 20, 3);
  Loader a(D, 8, 77), b(D, 8, 77), c(D, 8, 78);
  EXPECT_EQ(a.epoch_order(0), b.epoch_order(0));
  EXPECT_NE(a.epoch_order(0), a.epoch_order(1));
  EXPECT_NE(a.epoch_order(0), c.epoch_order(0));
  auto sorted = a.epoch_order(3);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);
  for (int i = 0; i < 20; ++i) {
    const Batch x = a.next(2), y = b.next(2);
    EXPECT_EQ(x.ids, y.ids);
    EXPECT_EQ(x.targets, y.targets);
    EXPECT_EQ(x.cu_seqlens, y.cu_seqlens);
  }
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_NE(a.fingerprint(), c.fingerprint());
}

TEST(Data, ResumeReproducesTheBatches) {
  auto D = toy_docs(40, 60, 5);
  Loader a(D, 24, 9);
  std::vector<Batch> straight;
  Position saved;
  for (int i = 0; i < 30; ++i) {
    if (i == 13) saved = a.position();
    straight.push_back(a.next(3));
  }
  // Through JSON, as a checkpoint stores it.
  const lm::io::json j = saved;
  const std::string text = j.dump();
  const Position back = lm::io::json::parse(text).get<Position>();
  EXPECT_EQ(back, saved);
  Loader b(D, 24, 9, back);
  for (int i = 13; i < 30; ++i) {
    const Batch x = b.next(3);
    EXPECT_EQ(x.ids, straight[static_cast<size_t>(i)].ids) << i;
    EXPECT_EQ(x.targets, straight[static_cast<size_t>(i)].targets) << i;
    EXPECT_EQ(x.cu_seqlens, straight[static_cast<size_t>(i)].cu_seqlens) << i;
  }
  EXPECT_EQ(b.position(), a.position());
  // seek() on a live loader does the same.
  a.seek(saved);
  EXPECT_EQ(a.next(3).ids, straight[13].ids);
  // Bad positions are clear errors.
  EXPECT_THROW(a.seek(Position{0, static_cast<uint64_t>(D->tokens())}), lm::Error);
  EXPECT_THROW(lm::io::json::parse(R"({"epoch": 1})").get<Position>(), lm::Error);
  EXPECT_THROW(lm::io::json::parse(R"({"epoch": -1, "offset": 0})").get<Position>(), lm::Error);
  EXPECT_THROW(lm::io::json::parse(R"([1, 2])").get<Position>(), lm::Error);
}

TEST(Data, RepackAtAnotherSeqLenContinuesTheStream) {
  auto D = toy_docs(30, 80, 6);
  Loader a(D, 16, 4);
  const auto ref = reference_stream(*D, a, 12);
  LaneModel model = lane_model(a, 12);
  for (int i = 0; i < 5; ++i) check_rows(a.next(2), *D, ref, model.next(2, 16));
  a.set_seq_len(64);  // curriculum stage: same position, longer sequences
  for (int i = 0; i < 5; ++i) check_rows(a.next(2), *D, ref, model.next(2, 64));
  // Another B: the same position, lanes of the new B (at lane offset ceil(offset / B)).
  for (int i = 0; i < 8; ++i) {
    check_rows(a.next(3), *D, ref, model.next(3, 64));
    EXPECT_EQ(a.position(), model.pos);
  }
  // A fresh loader at the saved position with the new length gives the same batches.
  Loader b(D, 16, 4);
  for (int i = 0; i < 5; ++i) b.next(2);
  const Position p = b.position();
  Loader c(D, 64, 4, p);
  b.set_seq_len(64);
  EXPECT_EQ(b.next(2).ids, c.next(2).ids);
  EXPECT_THROW(a.set_seq_len(0), lm::Error);
  EXPECT_THROW(a.next(0), lm::Error);
}

// Extra documents for epoch e (as synthetic passkey documents are): m + e % 3 of them, token values
// >= 1'000'000 so they never look like a corpus token.
Loader::ExtraDocs toy_extra(int64_t m, int64_t max_len) {
  return [=](uint64_t e) {
    TokenizedDocs x;
    const int64_t M = m + static_cast<int64_t>(e % 3), E = static_cast<int64_t>(e);
    for (int64_t j = 0; j < M; ++j) {
      const int64_t len = 1 + (E * 7 + j * 13) % max_len;
      for (int64_t p = 0; p < len; ++p) x.ids.push_back(static_cast<int32_t>(1000000 + E * 10000 + j * 100 + p));
      x.offsets.push_back(static_cast<int64_t>(x.ids.size()));
    }
    return x;
  };
}

// Epoch e of a loader with extra documents, as (source, document) per document: source 0 corpus, 1 extra.
std::vector<std::pair<int, int64_t>> mixed_epoch(const Loader& L, const Loader::ExtraDocs& extra, uint64_t e) {
  const auto order = L.epoch_order(e);
  const auto N = static_cast<int64_t>(order.size()), M = extra(e).num_docs();
  std::vector<std::pair<int, int64_t>> out;
  int64_t j = 0;
  for (int64_t k = 0; k < N; ++k) {
    for (; j < M && j * N / M == k; ++j) out.emplace_back(1, j);
    out.emplace_back(0, order[static_cast<size_t>(k)]);
  }
  EXPECT_EQ(j, M);
  return out;
}

TEST(Data, ExtraDocumentsAreSpreadThroughEachEpoch) {
  auto D = toy_docs(40, 30, 21);
  const auto extra = toy_extra(10, 30);
  Loader L(D, 16, 5, {}, extra);
  std::vector<int32_t> ref;  // the stream of epochs 0..3
  for (uint64_t e = 0; e < 4; ++e) {
    const TokenizedDocs x = extra(e);
    EXPECT_EQ(L.epoch_tokens(e), D->tokens() + x.tokens());
    EXPECT_EQ(L.epoch_extra_tokens(e), x.tokens());
    int64_t since_extra = 0, max_gap = 0;
    for (const auto& [src, d] : mixed_epoch(L, extra, e)) {
      const auto s = src == 0 ? D->doc(d) : x.doc(d);
      ref.insert(ref.end(), s.begin(), s.end());
      since_extra = src == 1 ? 0 : since_extra + 1;
      max_gap = std::max(max_gap, since_extra);
    }
    EXPECT_LE(max_gap, (40 + x.num_docs() - 1) / x.num_docs());  // evenly spread
  }
  // The batches read that stream in lanes (epochs of different lengths); a document's last token
  // predicts nothing.
  LaneModel model = lane_model(L, 4);
  std::vector<Batch> straight;
  Position saved;
  for (int i = 0; model.pos.epoch < 3; ++i) {
    if (i == 9) saved = L.position();
    straight.push_back(L.next(3));
    const Batch& b = straight.back();
    const auto starts = model.next(3, 16);
    ASSERT_EQ(L.position(), model.pos) << "batch " << i;
    for (size_t r = 0; r < 48; ++r) {
      const size_t at = starts[r / 16] + r % 16;
      ASSERT_EQ(b.ids[r], ref[at]) << "batch " << i << " row " << r;
      // Same document: same value / 100 (corpus documents are 1000 apart, extra ones 100).
      const bool last = at + 1 == ref.size() || ref[at + 1] / 100 != ref[at] / 100;
      EXPECT_EQ(b.targets[r], last ? kIgnore : ref[at + 1]) << "batch " << i << " row " << r;
    }
  }
  ASSERT_GT(straight.size(), 20u);
  // Resume: a new loader at a saved position gives the same batches.
  Loader R(D, 16, 5, saved, extra);
  for (size_t i = 9; i < straight.size(); ++i) EXPECT_EQ(R.next(3).ids, straight[i].ids) << i;
}

TEST(Data, SetExtraKeepsTheCorpusWhereItWas) {
  auto D = toy_docs(40, 30, 22);
  const auto extra = toy_extra(10, 30);
  // A corpus-only loader (an earlier stage) part-way through a document, then extra documents.
  Loader a(D, 16, 5), plain(D, 16, 5);
  for (int i = 0; i < 7; ++i) a.next(2), plain.next(2);
  const Loader::CorpusPoint c = a.corpus_point();
  EXPECT_EQ(a.position(), plain.position_of(c));
  ASSERT_GT(c.token, 0);
  a.set_extra(extra);
  EXPECT_EQ(a.corpus_point(), c);
  EXPECT_EQ(a.next(1).ids[0], D->doc(a.epoch_order(c.epoch)[static_cast<size_t>(c.slot)])[static_cast<size_t>(c.token)]);
  // Inside an extra document: the corpus continues with the next corpus document. Extra 1 of epoch 0
  // (14 tokens) lies right before corpus position 1 * 40 / 10 = 4.
  Loader b(D, 16, 5, {}, extra);
  const Position start4 = b.position_of({0, 4, 0});
  b.seek(Position{0, start4.offset - 5});
  EXPECT_EQ(b.next(1).ids[0], 1000000 + 100 + 9);  // token 9 of extra 1
  b.seek(Position{0, start4.offset - 5});
  EXPECT_EQ(b.corpus_point(), (Loader::CorpusPoint{0, 4, 0}));
  b.set_extra({});  // another stage's documents (here: none)
  EXPECT_EQ(b.position(), plain.position_of({0, 4, 0}));
  EXPECT_EQ(b.next(1).ids[0], D->doc(b.epoch_order(0)[4])[0]);
  // Without extra documents the stream is the corpus' (an empty function changes nothing).
  Loader e(D, 16, 5, {}, Loader::ExtraDocs{}), f(D, 16, 5);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(e.next(3).ids, f.next(3).ids);
  EXPECT_THROW(b.position_of({0, 40, 0}), lm::Error);
}

TEST(Data, SplitIsByDocumentDisjointAndDeterministic) {
  auto D = toy_docs(200, 30, 8);
  const DataSplit s = split_documents(*D, 0.05, 17);
  EXPECT_EQ(s.heldout_docs.size(), 10u);
  EXPECT_EQ(s.train_docs.size(), 190u);
  std::set<int64_t> all(s.train_docs.begin(), s.train_docs.end());
  for (const int64_t d : s.heldout_docs) EXPECT_TRUE(all.insert(d).second) << "document in both splits: " << d;
  EXPECT_EQ(all.size(), 200u);
  EXPECT_TRUE(std::is_sorted(s.heldout_docs.begin(), s.heldout_docs.end()));
  EXPECT_EQ(s.train.tokens() + s.heldout.tokens(), D->tokens());
  for (size_t k = 0; k < s.heldout_docs.size(); ++k) {  // whole documents, unchanged
    const auto a = s.heldout.doc(static_cast<int64_t>(k)), b = D->doc(s.heldout_docs[k]);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  }
  const DataSplit again = split_documents(*D, 0.05, 17);
  EXPECT_EQ(again.heldout_docs, s.heldout_docs);
  EXPECT_EQ(again.train.ids, s.train.ids);
  EXPECT_NE(split_documents(*D, 0.05, 18).heldout_docs, s.heldout_docs);
  // Small corpora still get one held-out document, and never lose all training ones.
  EXPECT_EQ(split_documents(*toy_docs(3, 5, 1), 0.01, 1).heldout_docs.size(), 1u);
  EXPECT_EQ(split_documents(*toy_docs(2, 5, 1), 0.9, 1).train_docs.size(), 1u);
  EXPECT_TRUE(split_documents(*D, 0.0, 1).heldout_docs.empty());
  EXPECT_THROW(split_documents(*D, 1.0, 1), lm::Error);
  EXPECT_THROW(split_documents(*D, -0.1, 1), lm::Error);
}

TEST(Data, EvalBatchesCoverTheHeldOutSplitOnce) {
  auto D = toy_docs(9, 40, 12);
  const int32_t pad = -7;
  const auto batches = eval_batches(*D, 16, 2, pad);
  ASSERT_FALSE(batches.empty());
  std::vector<int32_t> ids;
  int64_t predicted = 0;
  for (const auto& b : batches) {
    EXPECT_EQ(b.tokens(), 32);
    predicted += b.predicted();
    for (size_t r = 0; r < b.ids.size(); ++r) {
      if (b.ids[r] == pad) {
        EXPECT_EQ(b.targets[r], kIgnore);
        continue;
      }
      ids.push_back(b.ids[r]);
    }
  }
  EXPECT_EQ(ids, D->ids);  // document order, nothing shuffled, nothing lost
  EXPECT_EQ(predicted, D->tokens() - D->num_docs());
  // Same stream conventions as the loader: reference with the identity order.
  std::vector<Where> ref;
  for (int64_t d = 0; d < D->num_docs(); ++d)
    for (int64_t p = 0; p < static_cast<int64_t>(D->doc(d).size()); ++p)
      ref.push_back({d, p, static_cast<int64_t>(D->doc(d).size())});
  size_t at = 0;
  for (size_t i = 0; i + 1 < batches.size(); ++i) at = check_batch(batches[i], *D, ref, at);
  // The padded tail starts its own segment.
  const Batch& last = batches.back();
  const auto first_pad = std::find(last.ids.begin(), last.ids.end(), pad) - last.ids.begin();
  if (first_pad < last.tokens()) {
    EXPECT_NE(std::find(last.cu_seqlens.begin(), last.cu_seqlens.end(), first_pad), last.cu_seqlens.end());
  }
  EXPECT_EQ(eval_batches(*D, 16, 2, pad, 1).size(), 1u);
  EXPECT_TRUE(eval_batches(TokenizedDocs{}, 16, 2, pad).empty());
}

TEST(Data, UnigramBaselineByHand) {
  // Vocabulary {0, 1, 2, 3}; 0 is the separator. Train: [1 2 0] [2 0]; the targets (all but each
  // document's first token) are 2 0 0 -> counts 2, 0, 1, 0 over n = 3; add-one:
  // p = (c + 1) / (3 + 4) = 3/7, 1/7, 2/7, 1/7.
  TokenizedDocs train;
  train.ids = {1, 2, 0, 2, 0};
  train.offsets = {0, 3, 5};
  // Held-out [3 1 0]: the targets are 1 and 0 (a document's first token is never predicted).
  TokenizedDocs held;
  held.ids = {3, 1, 0};
  held.offsets = {0, 3};
  const Unigram u = Unigram::fit(train, 4);
  EXPECT_NEAR(std::exp(u.log_prob[0]), 3.0 / 7, 1e-12);
  EXPECT_NEAR(std::exp(u.log_prob[1]), 1.0 / 7, 1e-12);
  EXPECT_NEAR(std::exp(u.log_prob[2]), 2.0 / 7, 1e-12);
  EXPECT_NEAR(std::exp(u.log_prob[3]), 1.0 / 7, 1e-12);
  const double want = -(std::log(1.0 / 7) + std::log(3.0 / 7)) / 2;
  EXPECT_NEAR(u.cross_entropy(held), want, 1e-12);
  EXPECT_NEAR(u.cross_entropy(eval_batches(held, 2, 1, 3)), want, 1e-12);
  EXPECT_THROW(Unigram::fit(train, 2), lm::Error);  // id 2 outside a vocabulary of 2
  EXPECT_THROW(u.cross_entropy(TokenizedDocs{}), lm::Error);  // nothing to evaluate
}

TEST(Data, TokenizeDocumentsWithARealTokenizer) {
  const fs::path dir = fs::temp_directory_path() / ("lm_data_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<std::string> docs;
  const char* words[] = {"alpha", "beta", "gamma", "delta", "the", "of", "and", "zeta", "\n", "<|doc|>"};
  for (int d = 0; d < 60; ++d) {
    std::string s;
    for (int w = 0; w < 20 + d; ++w) s += std::string(w ? " " : "") + words[(d * 7 + w * w) % 9];
    docs.push_back(s);
  }
  docs.push_back(std::string("literal ") + words[9] + " inside");  // does not cut the document
  lm::io::Tokenizer::TrainOptions o;
  o.vocab_size = 300;
  const auto tok = lm::io::Tokenizer::train(docs, (dir / "t.model").string(), o);
  const int32_t sep = tok.special("<|doc|>");
  lm::set_num_threads(1);
  const TokenizedDocs one = tokenize_documents(tok, docs);
  lm::set_num_threads(2);
  const TokenizedDocs two = tokenize_documents(tok, docs);
  EXPECT_EQ(one.ids, two.ids);
  EXPECT_EQ(one.offsets, two.offsets);
  ASSERT_EQ(one.num_docs(), static_cast<int64_t>(docs.size()));
  for (int64_t d = 0; d < one.num_docs(); ++d) {  // <s> text <|doc|>
    const auto s = one.doc(d);
    ASSERT_EQ(s.front(), tok.bos());
    ASSERT_EQ(s.back(), sep);
    EXPECT_EQ(tok.decode(std::vector<int32_t>(s.begin() + 1, s.end() - 1)), docs[static_cast<size_t>(d)]);
  }
  const TokenizedDocs no_bos = tokenize_documents(tok, docs, false);
  EXPECT_EQ(no_bos.tokens(), one.tokens() - one.num_docs());
  EXPECT_NE(no_bos.doc(0).front(), tok.bos());
  // The literal separator inside the last document stays inside it.
  const auto last = one.doc(one.num_docs() - 1);
  EXPECT_EQ(std::count(last.begin(), last.end(), sep), 2);
  EXPECT_EQ(one.fingerprint(), two.fingerprint());
  fs::remove_all(dir);
}

}  // namespace

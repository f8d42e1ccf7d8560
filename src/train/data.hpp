#pragma once
// Training data: documents -> token stream -> packed batches with document boundaries.
// Legend: N documents, L tokens of a split, T seq_len, B sequences per batch.
//
// Tokens. A document is <s> (bos), its text's tokens, then one <|doc|> separator: the model learns
// to start a text from <s> alone (as generation and chat prompts begin) and to end it with <|doc|>.
// Boundaries come from the document offsets, never from token values, so a literal "<|doc|>" inside
// a text does not cut it.
//
// Stream. Epoch e of a split is its documents in a seeded permutation P_e (Philox, from seed and e)
// put end to end: S_e = doc[P_e(0)] doc[P_e(1)] ... (L tokens every epoch).
//
// Lanes. A batch of B sequences does not read B*T consecutive stream tokens (that would be only a
// few documents, which route alike in the MoE and make expert loads and gradients swing with the
// batch): S_e is split into B lanes of Lg = floor(L / B) tokens, lane r = S_e[r*Lg, (r+1)*Lg), and
// sequence r of every batch reads the next T tokens of lane r. So a batch at lane offset o holds
// S_e[r*Lg + o, r*Lg + o + T) for r = 0..B-1: B far-apart places of the epoch (~B documents).
// When o + T would pass Lg the epoch is done and the next batch starts epoch e + 1 at o = 0 (the
// < B*T tokens left over in the lanes' tails and the last L - B*Lg are dropped). Within an epoch every
// lane token a batch reads is read exactly once, nothing is padded.
// Position {epoch, offset}: offset = B*o, the tokens of the epoch consumed in total (< L), so the
// checkpoint format does not depend on the layout. It is all the state there is: a resumed run (same
// data, seed, T, B) reproduces the batches exactly. When B or T changes (a curriculum stage,
// set_seq_len, a next() with another B) the loader continues from the same Position: the lanes follow
// the new B, each at lane offset o = ceil(offset / B) (so about the same fraction of the epoch is done;
// the stage re-packs anyway).
// Small epochs: when even one batch does not fit (Lg < T) the batch reads B*T consecutive tokens of
// the endless stream S_e S_e+1 ... from the position instead (offset = stream offset then), as if
// B = 1 with sequences cut every T: every token used exactly once, continuing into the next epoch.
//
// Batch: B sequences of T tokens as one packed run of B*T rows (row r = sequence r / T, slot r % T):
//   ids[r]       sequence r / T's stream token r % T (see Lanes)
//   targets[r]   the next token of the same document, or kIgnore (-100) when row r holds the
//                document's last token (its <|doc|>): nothing is predicted across a document boundary.
//                A sequence's last row still predicts its document's next token: a sequence cut costs
//                context, not targets. With a loss mask (TokenizedDocs::loss_mask) also kIgnore where the
//                next token is masked out, and for a masked document's rows in a sequence that starts
//                inside it.
//   cu_seqlens   {0, ..., B*T}, strictly increasing: a boundary at every sequence start (multiples of
//                T) and at every document start inside a sequence, for model::Seqs::packed, so KDA
//                state and attention never cross a document or a sequence.
// Hence every token a batch reads except a document's first (its <s>) is a target exactly once per
// epoch, the separator included.
//
// Extra documents (synthetic passkey documents, train/synthetic.hpp): a Loader may be given a
// function extra(e) -> epoch e's extra documents (M of them). Epoch e's stream is then the N corpus
// documents in P_e with the extra ones spread evenly between them, extra j right before corpus
// position floor(j * N / M); offsets count tokens of that mixed stream (and L is its length). set_extra()
// swaps the function (a new curriculum stage generates documents for its seq_len) and keeps the corpus
// where it was: the position's offset moves to the same token of the same corpus document in the new
// stream (or to the next corpus document when it was inside an extra one). With lanes the offset
// (B*o, the tokens consumed) is such a stream offset too: corpus_point() is the corpus point at stream
// offset `offset`, so a re-mix keeps about the same fraction of the epoch done, each lane continuing
// from about the same fraction of its new length. Both maps are pure functions of the position and
// the extra documents, so a resumed run re-mixes exactly as the straight one. With B = 1 (one lane,
// the stream itself) the next batch starts at exactly that token. Without extra documents the stream
// is the corpus'.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "io/chat.hpp"
#include "io/json.hpp"
#include "io/tokenizer.hpp"

namespace lm::train {

inline constexpr int32_t kIgnore = -100;

struct TokenizedDocs {
  std::vector<int32_t> ids;          // [L] all documents back to back: <s> text <|doc|> each
  std::vector<int64_t> offsets{0};   // [N + 1] document d is ids[offsets[d], offsets[d + 1])
  // [L] or empty. Empty: every token of a document but its first is a target. Else token i is a target only
  // where loss_mask[i] = 1 (sft: the assistant's tokens, io::chat_tokens), and a masked document that a
  // sequence starts inside of has no targets in that sequence: a reply is never learnt without its prompt.
  std::vector<uint8_t> loss_mask;
  int64_t num_docs() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t tokens() const { return static_cast<int64_t>(ids.size()); }
  std::span<const int32_t> doc(int64_t d) const;
  std::span<const uint8_t> doc_mask(int64_t d) const;  // empty without a loss mask
  // FNV-1a over ids and offsets (and the mask when there is one): tells a resumed run it reads the same data
  uint64_t fingerprint() const;
};

// Encodes each document (in parallel; the result does not depend on the thread count) as
// [<s>] text <|doc|>; bos = false leaves out the <s>.
TokenizedDocs tokenize_documents(const io::Tokenizer& tok, const std::vector<std::string>& docs, bool bos = true);
// Conversations (sft demonstrations) as documents: each rendered by io::chat_tokens ([<s>] turns, no generation
// prompt, no <|doc|>) with its loss mask (the assistant's tokens). In parallel, like tokenize_documents.
TokenizedDocs tokenize_conversations(const io::Tokenizer& tok, const std::vector<io::Conversation>& convs);
// The documents `which` (indices into `all`), in that order.
TokenizedDocs select_documents(const TokenizedDocs& all, const std::vector<int64_t>& which);

// Held-out split by whole documents: a seeded permutation of the N documents; its first
// round(fraction * N) (at least 1 and at most N - 1 when fraction > 0 and N >= 2) are held out.
// Both splits keep the original document order. fraction must lie in [0, 1).
struct DataSplit {
  TokenizedDocs train, heldout;
  std::vector<int64_t> train_docs, heldout_docs;  // original document indices, ascending
};
DataSplit split_documents(const TokenizedDocs& all, double heldout_fraction, uint64_t seed);

struct Batch {
  std::vector<int32_t> ids, targets;  // [B*T]
  std::vector<float> weights;         // [B*T] each target's weight in the loss, or empty: all 1 (Loader::set_concat)
  std::vector<int64_t> cu_seqlens;    // [segments + 1]
  int64_t seqs = 0, seq_len = 0;      // B, T
  int64_t tokens() const { return static_cast<int64_t>(ids.size()); }
  int64_t predicted() const;  // targets that are not kIgnore (what a mean loss divides by)
  // Sequences [first, first + n) as a batch of their own (a micro-batch of a step).
  Batch sequences(int64_t first, int64_t n) const;
  // Context parallel: segment `rank` of `ranks` of every sequence, tokens [rank·T/ranks, (rank+1)·T/ranks), as a
  // batch of B sequences of T/ranks tokens. The targets are cut from the whole sequences, so a segment's last target
  // is the next segment's first token. lm::Error unless ranks divides T and every sequence is one segment
  // (cu_seqlens = {0, T, 2T, ...}: no document boundary or padding inside).
  Batch segment(int64_t rank, int64_t ranks) const;
};

// A whole-window synthetic sequence (Loader::set_concat): its tokens, and the span [answer_from, answer_to) of them
// that answers its question (empty: none).
struct SynthSeq {
  std::vector<int32_t> ids;
  int64_t answer_from = 0, answer_to = 0;
  bool operator==(const SynthSeq&) const = default;
};

struct Position {
  uint64_t epoch = 0, offset = 0;  // offset: tokens of epoch `epoch` already consumed, < L
  bool operator==(const Position&) const = default;
};
void to_json(io::json& j, const Position& p);    // {"epoch": e, "offset": o}
void from_json(const io::json& j, Position& p);  // lm::Error naming a missing or mistyped field

class Loader {
 public:
  // Epoch e's extra documents; must be a pure function of e (resume regenerates them).
  using ExtraDocs = std::function<TokenizedDocs(uint64_t epoch)>;
  // Where the loader stands in the corpus: token `token` of the document at position `slot` of P_epoch.
  struct CorpusPoint {
    uint64_t epoch = 0;
    int64_t slot = 0, token = 0;
    bool operator==(const CorpusPoint&) const = default;
  };

  // `docs` is the training split (at least one document). Starts at `start` (of the mixed stream
  // when `extra` is given).
  Loader(std::shared_ptr<const TokenizedDocs> docs, int64_t seq_len, uint64_t seed, Position start = {},
         ExtraDocs extra = {});

  // B sequences of seq_len() tokens, one from each of B lanes (see Lanes); the lanes are defined by B,
  // so a step split into micro-batches takes next(B) once and splits it (Batch::sequences).
  Batch next(int64_t B);
  Position position() const { return pos_; }
  void seek(Position p);              // throws if p.offset is not inside the epoch
  void set_seq_len(int64_t seq_len);  // re-pack from the current position on
  // Other extra documents (none: an empty function) from the current corpus point on (see above).
  void set_extra(ExtraDocs extra);
  // A long-context stage (stage option concat_documents): the documents an epoch's lanes read are permuted and
  // concatenated, so a sequence has no boundary at a document starting inside it (its targets stay as above).
  // With `synth` set, sequence r of a batch at lane offset o of epoch e is instead, when
  // rng.fork(e).uniform_f64(2·(o·B + r)) < `fraction`, the document synth(rng.fork(e).bits(2·(o·B + r) + 1)) (at
  // most seq_len tokens, padded, a segment of its own): a task spanning the whole window (a passkey document of about that length), never cut by a sequence
  // boundary. Its lane's tokens are skipped. A pure function of the position, so a resumed run reads the same
  // batches. (Extra documents, set_extra, should be off meanwhile: they would be cut. Epochs shorter than one
  // batch, read consecutively, get no synthetic sequences.)
  // With `answer_weight` (> 0, not 1), each batch carries Batch::weights: the targets that predict a synthetic
  // sequence's answer span count answer_weight times in the loss, every other target once.
  using Synth = std::function<SynthSeq(const Philox4& bits)>;
  void set_concat(bool on, double fraction = 0, Synth synth = {}, Rng rng = {}, double answer_weight = 1);
  CorpusPoint corpus_point() const;   // inside an extra document: the next corpus document, token 0
  Position position_of(CorpusPoint c) const;
  int64_t seq_len() const { return seq_len_; }
  int64_t epoch_tokens() const { return epoch_tokens(pos_.epoch); }  // the current epoch's stream
  int64_t epoch_tokens(uint64_t epoch) const;
  int64_t epoch_extra_tokens(uint64_t epoch) const;  // of them, in extra documents
  double epochs_done() const;                    // epoch + offset / epoch_tokens()
  uint64_t fingerprint() const;                  // data fingerprint mixed with the seed
  std::vector<int64_t> epoch_order(uint64_t epoch) const;  // P_e (corpus documents)

 private:
  struct Plan {
    std::vector<int64_t> order;      // [N + M] stream entries: d < N corpus document d, else extra d - N
    std::vector<int64_t> cum;        // [N + M + 1] stream offset of each entry
    std::vector<int64_t> corpus_at;  // [N + 1] entry of corpus position k of P_e (N: the end)
    std::shared_ptr<const TokenizedDocs> extra;  // epoch e's extra documents (null: none)
    std::span<const int32_t> doc(const TokenizedDocs& corpus, int64_t entry) const;
    std::span<const uint8_t> mask(const TokenizedDocs& corpus, int64_t entry) const;  // its loss mask (or empty)
  };
  const Plan& plan(uint64_t epoch) const;
  Batch next_consecutive(int64_t B);  // the small-epoch case (see Lanes)

  std::shared_ptr<const TokenizedDocs> docs_;
  int64_t seq_len_;
  bool concat_ = false;
  double synth_fraction_ = 0, answer_weight_ = 1;
  Synth synth_;
  Rng synth_rng_;
  uint64_t seed_;
  Position pos_;
  ExtraDocs extra_;
  mutable std::map<uint64_t, Plan> plans_;  // the current epoch's and the next's
};

// The held-out split in document order (no shuffle) as consecutive batches of B sequences of T
// tokens, same conventions as the Loader. The last batch is filled up to B*T rows with `pad_id`
// (target kIgnore, a segment of its own). max_batches 0: the whole split.
std::vector<Batch> eval_batches(const TokenizedDocs& heldout, int64_t seq_len, int64_t B, int32_t pad_id,
                                int64_t max_batches = 0);

// Unigram baseline: p(v) = (count_v + 1) / (n + V) (add-one smoothing), counts over the n tokens of
// the training split that are targets (all but each document's first, its <s>). Cross-entropy in
// nats per predicted token; exp() of it is the "unigram ppl" to print beside the model's.
struct Unigram {
  std::vector<double> log_prob;  // [V]
  static Unigram fit(const TokenizedDocs& train, int32_t vocab_size);
  double cross_entropy(const std::vector<Batch>& batches) const;  // mean over targets != kIgnore
  // Over the same targets the held-out batches of the whole split hold: every token but each
  // document's first (its <s>).
  double cross_entropy(const TokenizedDocs& heldout) const;
};

}  // namespace lm::train

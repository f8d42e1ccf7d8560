#pragma once
// Synthetic passkey documents mixed into the training stream (run config data.passkey_fraction), and
// multi-needle ones in concat_documents stages (data.multi_needle_fraction), so that a context-curriculum run
// learns retrieval across each stage's context; `longmoe eval --passkey / --multi-needle` asks prompts of the
// same templates (io/retrieval.hpp) with keys from other streams.
//
// Document j of epoch e of curriculum stage s (seq_len T), all drawn from Philox draw j of the stream
// passkey_rng(seed, s).fork(e), so any document is a pure function of (seed, s, e, j):
//   length  uniform in [lo, T] tokens, lo = max(ceil(T / 4), passkey_min_tokens + 2 (+1 for <|doc|>));
//           the document is the longest prompt (whole filler sentences) that fits, within about one
//           sentence below the drawn length
//   key     five digits, 10000..99999
//   depth   uniform in [0, 1): the needle's place in the filler
// Tokens: [<s>] prompt, then the answer key + "." and <|doc|>: the model learns to answer and end the
// document. An epoch holds documents 0..M-1, M the fewest whose drawn lengths reach `target` tokens.
// The held-out split, held-out perplexity and the unigram baseline never see these documents.
#include <cstdint>

#include "core/rng.hpp"
#include "io/tokenizer.hpp"
#include "train/data.hpp"

namespace lm::train {

// Stream of stage `stage`'s passkey documents (independent of the split, the shuffles and eval's keys).
Rng passkey_rng(uint64_t seed, int64_t stage);

// Synthetic tokens per epoch so that they are `fraction` of the mixed stream:
// fraction / (1 - fraction) * corpus_tokens, rounded. fraction must lie in [0, 0.9].
int64_t passkey_target_tokens(int64_t corpus_tokens, double fraction);

// The shortest document length used for stage length `seq_len` (see above); throws when the
// smallest passkey prompt of this tokenizer does not fit in `seq_len` tokens.
int64_t passkey_min_doc_tokens(const io::Tokenizer& tok, int64_t seq_len);

// The documents of one epoch of one stage (`rng` = passkey_rng(seed, stage).fork(epoch)); built in
// parallel, the result does not depend on the thread count.
TokenizedDocs passkey_documents(const io::Tokenizer& tok, int64_t seq_len, int64_t target_tokens, const Rng& rng);

// A long-context stage's synthetic sequence (Loader::set_concat): one passkey document filling a window of
// `seq_len` tokens, its length uniform in [seq_len / 2, seq_len] (at least the shortest document), key and depth
// as above, all from `bits`; its answer span marked (the key and ".", before <|doc|>).
SynthSeq passkey_sequence(const io::Tokenizer& tok, int64_t seq_len, const Philox4& bits);

// Multi-needle documents (data.multi_needle_fraction; io/retrieval.hpp's template, the one `longmoe eval
// --multi-needle` asks): kTrainNeedles facts at uniform depths, one of them asked for and answered, then <|doc|>.
inline constexpr int64_t kTrainNeedles = 4;  // (eval_retrieval's default "needles")
// The shortest multi-needle document for stage length `seq_len`; throws when the prompt without filler does not
// fit in seq_len / 2 tokens.
int64_t multi_needle_min_doc_tokens(const io::Tokenizer& tok, int64_t seq_len);
// One multi-needle document filling a window of `seq_len` tokens (length uniform in [seq_len / 2, seq_len]),
// everything drawn from `bits` (a stream of its own seeded by them).
SynthSeq multi_needle_sequence(const io::Tokenizer& tok, int64_t seq_len, const Philox4& bits);
// A synthetic sequence of a stage with both kinds: multi-needle with probability `multi_share` (of the synthetic
// sequences), else passkey_sequence(bits) as without multi-needle documents.
SynthSeq retrieval_sequence(const io::Tokenizer& tok, int64_t seq_len, double multi_share, const Philox4& bits);

}  // namespace lm::train

#pragma once
// Token embedding (SPEC §1: h = embed_tokens[ids]) forward and its scatter-add backward.
//
// Legend: T tokens, vocab rows of the table, d hidden.
// Layouts (row-major): ids [T] int32; table, dtable [vocab, d]; out, dout [T, d].
//
// The backward dtable[ids[t]] += dout[t] is made race-free and deterministic by giving each thread a
// range of the d columns: every table row is then summed over tokens in token order, so the bits do not
// depend on the thread count or on how ids repeat.
#include <cstdint>

namespace lm::ops {

// Throws lm::Error naming the first position whose id is outside [0, vocab); nothing is written then.
template <class F>
void embedding_forward(const int32_t* ids, int64_t T, const F* table, int64_t vocab, int64_t d, F* out);

// dtable [vocab, d] accumulated (+=). Same id check as the forward.
template <class F>
void embedding_backward(const int32_t* ids, int64_t T, const F* dout, int64_t vocab, int64_t d, F* dtable);

}  // namespace lm::ops

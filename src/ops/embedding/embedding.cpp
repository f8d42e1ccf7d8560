// Embedding gather and scatter-add on the CPU (see embedding.hpp).
// Legend: T tokens, vocab table rows, d hidden, kCols columns per backward work item.
#include "ops/embedding/embedding.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {

namespace {

void check_ids(const char* who, const int32_t* ids, int64_t T, int64_t vocab, int64_t d) {
  LM_CHECK(T >= 0 && vocab > 0 && d > 0, "{}: need T >= 0, vocab > 0, d > 0; got T={} vocab={} d={}", who, T, vocab, d);
  for (int64_t t = 0; t < T; ++t)
    LM_CHECK(ids[t] >= 0 && ids[t] < vocab, "{}: token id {} at position {} is out of range [0, {})", who, ids[t], t,
             vocab);
}

// Parallel only when each thread gets at least ~kMinWork elements (fork/join is not free).
constexpr int64_t kMinWork = 1 << 14;
int64_t grain(int64_t work_per_item) { return std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, work_per_item)); }

}  // namespace

template <class F>
void embedding_forward(const int32_t* ids, int64_t T, const F* table, int64_t vocab, int64_t d, F* out) {
  check_ids("embedding_forward", ids, T, vocab, d);
  parallel_for(
      T, [&](int64_t t) { std::memcpy(out + t * d, table + static_cast<int64_t>(ids[t]) * d, sizeof(F) * d); },
      grain(d));
}

template <class F>
void embedding_backward(const int32_t* ids, int64_t T, const F* dout, int64_t vocab, int64_t d, F* dtable) {
  check_ids("embedding_backward", ids, T, vocab, d);
  // Column ranges of at least kCols (whole cache lines) per work item; each item walks all tokens in order.
  constexpr int64_t kCols = 64;
  const int64_t nitems = (d + kCols - 1) / kCols;
  parallel_for(
      nitems,
      [&](int64_t i) {
        const int64_t c0 = i * kCols, c1 = std::min(d, c0 + kCols);
        for (int64_t t = 0; t < T; ++t) {
          F* dst = dtable + static_cast<int64_t>(ids[t]) * d;
          const F* src = dout + t * d;
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
        }
      },
      grain(T * kCols));
}

#define LM_INSTANTIATE(F)                                                                      \
  template void embedding_forward<F>(const int32_t*, int64_t, const F*, int64_t, int64_t, F*); \
  template void embedding_backward<F>(const int32_t*, int64_t, const F*, int64_t, int64_t, F*);
LM_INSTANTIATE(float)
LM_INSTANTIATE(double)
#undef LM_INSTANTIATE

}  // namespace lm::ops

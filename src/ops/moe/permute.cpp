// Token ↔ expert permutation: stable counting sort, gather, weighted combine and their backwards.
// Legend: m tokens, n experts, k experts per token, d width, a = i·k + t an assignment.
#include "ops/moe/permute.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {
namespace {

// Tokens per counting-sort chunk: per-chunk histograms [chunks, n] make both passes parallel
// while the stable order stays fixed (chunks are in token order).
constexpr int64_t kSortChunk = 2048;

void check_sizes(int64_t m, int64_t k, int64_t d, const char* what) {
  LM_CHECK(m >= 0 && k >= 1 && d >= 0, "{}: bad sizes m = {}, k = {}, d = {}", what, m, k, d);
}

}  // namespace

void moe_build_permutation(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int64_t* offsets,
                           int64_t* rows, int64_t* pos) {
  LM_CHECK(m >= 0 && k >= 1 && n >= 1, "moe_build_permutation: bad sizes m = {}, k = {}, n = {}", m, k, n);
  LM_CHECK(offsets && (m == 0 || (topk_idx && rows && pos)), "moe_build_permutation: null argument");
  const int64_t A = m * k;
  const int64_t chunks = std::max<int64_t>(1, (A + kSortChunk * k - 1) / (kSortChunk * k));
  const int64_t per = (A + chunks - 1) / chunks;
  std::vector<int64_t> cnt(static_cast<size_t>(chunks * n), 0);
  parallel_for(chunks, [&](int64_t c) {
    int64_t* h = cnt.data() + c * n;
    for (int64_t a = c * per, e = std::min(A, (c + 1) * per); a < e; ++a) {
      const int32_t j = topk_idx[a];
      LM_CHECK(j >= 0 && j < n, "moe_build_permutation: topk_idx[{}] = {} out of [0, {})", a, j, n);
      ++h[j];
    }
  });
  // Exclusive prefix, expert-major then chunk: chunk c's first row for expert j.
  int64_t run = 0;
  for (int64_t j = 0; j < n; ++j) {
    offsets[j] = run;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t v = cnt[static_cast<size_t>(c * n + j)];
      cnt[static_cast<size_t>(c * n + j)] = run;
      run += v;
    }
  }
  offsets[n] = run;
  parallel_for(chunks, [&](int64_t c) {
    int64_t* next = cnt.data() + c * n;
    for (int64_t a = c * per, e = std::min(A, (c + 1) * per); a < e; ++a) {
      const int64_t r = next[topk_idx[a]]++;
      rows[r] = a;
      pos[a] = r;
    }
  });
}

MoePermutation moe_permutation(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n) {
  MoePermutation p;
  p.m = m;
  p.k = k;
  p.n = n;
  p.offsets.resize(static_cast<size_t>(std::max<int64_t>(n, 0) + 1));
  p.rows.resize(static_cast<size_t>(std::max<int64_t>(m * k, 0)));
  p.pos.resize(p.rows.size());
  moe_build_permutation(topk_idx, m, k, n, p.offsets.data(), p.rows.data(), p.pos.data());
  return p;
}

template <class F>
void moe_gather(const F* x, const int64_t* rows, F* xs, int64_t m, int64_t k, int64_t d) {
  check_sizes(m, k, d, "moe_gather");
  if (m == 0 || d == 0) return;
  LM_CHECK(x && rows && xs, "moe_gather: null argument");
  parallel_for(
      m * k,
      [&](int64_t r) {
        const int64_t a = rows[r];
        LM_CHECK(a >= 0 && a < m * k, "moe_gather: rows[{}] = {} out of range", r, a);
        std::copy_n(x + (a / k) * d, d, xs + r * d);
      },
      64);
}

template <class F>
void moe_gather_backward(const F* dxs, const int64_t* pos, F* dx, int64_t m, int64_t k, int64_t d, bool accumulate) {
  check_sizes(m, k, d, "moe_gather_backward");
  if (m == 0 || d == 0) return;
  LM_CHECK(dxs && pos && dx, "moe_gather_backward: null argument");
  parallel_for(
      m,
      [&](int64_t i) {
        F* out = dx + i * d;
        if (!accumulate) std::fill(out, out + d, F(0));
        for (int64_t t = 0; t < k; ++t) {
          const int64_t r = pos[i * k + t];
          LM_CHECK(r >= 0 && r < m * k, "moe_gather_backward: pos[{}] = {} out of range", i * k + t, r);
          const F* src = dxs + r * d;
          for (int64_t c = 0; c < d; ++c) out[c] += src[c];
        }
      },
      16);
}

template <class F>
void moe_combine(const F* eo, const F* topk_w, const int64_t* pos, F* y, int64_t m, int64_t k, int64_t d,
                 bool accumulate) {
  check_sizes(m, k, d, "moe_combine");
  if (m == 0 || d == 0) return;
  LM_CHECK(eo && topk_w && pos && y, "moe_combine: null argument");
  parallel_for(
      m,
      [&](int64_t i) {
        F* out = y + i * d;
        if (!accumulate) std::fill(out, out + d, F(0));
        for (int64_t t = 0; t < k; ++t) {
          const int64_t r = pos[i * k + t];
          LM_CHECK(r >= 0 && r < m * k, "moe_combine: pos[{}] = {} out of range", i * k + t, r);
          const F p = topk_w[i * k + t];
          const F* src = eo + r * d;
          for (int64_t c = 0; c < d; ++c) out[c] += p * src[c];
        }
      },
      16);
}

template <class F>
void moe_combine_backward(const F* eo, const F* topk_w, const int64_t* pos, const F* dy, F* d_eo, F* d_topk_w,
                          int64_t m, int64_t k, int64_t d) {
  check_sizes(m, k, d, "moe_combine_backward");
  if (m == 0) return;
  LM_CHECK(eo && topk_w && pos && dy && d_eo, "moe_combine_backward: null argument");
  parallel_for(
      m,
      [&](int64_t i) {
        const F* g = dy + i * d;
        for (int64_t t = 0; t < k; ++t) {
          const int64_t r = pos[i * k + t];
          LM_CHECK(r >= 0 && r < m * k, "moe_combine_backward: pos[{}] = {} out of range", i * k + t, r);
          const F p = topk_w[i * k + t];
          const F* e = eo + r * d;
          F* de = d_eo + r * d;
          F dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            de[c] = p * g[c];
            dot += e[c] * g[c];
          }
          if (d_topk_w) d_topk_w[i * k + t] = dot;
        }
      },
      16);
}

#define LM_MOE_PERMUTE_INSTANTIATE(F)                                                                         \
  template void moe_gather<F>(const F*, const int64_t*, F*, int64_t, int64_t, int64_t);                      \
  template void moe_gather_backward<F>(const F*, const int64_t*, F*, int64_t, int64_t, int64_t, bool);       \
  template void moe_combine<F>(const F*, const F*, const int64_t*, F*, int64_t, int64_t, int64_t, bool);     \
  template void moe_combine_backward<F>(const F*, const F*, const int64_t*, const F*, F*, F*, int64_t, int64_t, \
                                        int64_t);
LM_MOE_PERMUTE_INSTANTIATE(float)
LM_MOE_PERMUTE_INSTANTIATE(double)
#undef LM_MOE_PERMUTE_INSTANTIATE

}  // namespace lm::ops

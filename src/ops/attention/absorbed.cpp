// MLA absorbed prefill (SPEC §3): a chunk of queries attends, causally, to the latent cache so far plus its
// own rows, without decompressing per-head keys and values.
//
// Legend: n queries at positions p .. p+n-1, Hm heads, R kv_lora_rank, Dr rope dim, RD = R + Dr;
//         bt tokens per query tile (about 128 (token, head) rows), bk keys per tile.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/parallel.hpp"
#include "core/simd_math.hpp"
#include "ops/attention/attention.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::ops {

namespace {
template <class F>
inline F exp_of(F x) {
  if constexpr (std::is_same_v<F, float>) return exp_approx(x);  // vectorises in the simd loop below
  else return std::exp(x);
}
}  // namespace

template <class F>
void mla_prefill_absorbed(const F* qa, const F* cache, int64_t p, int64_t n, int64_t Hm, int64_t R, int64_t Dr,
                          F scale, F* o_lat) {
  using Buf = std::vector<F>;
  const int64_t RD = R + Dr;
  const int64_t bt = std::max<int64_t>(1, 128 / Hm);
  constexpr int64_t bk = 128;
  const int64_t ntiles = (n + bt - 1) / bt;
  parallel_for_dynamic(ntiles, [&](int64_t it) {
    const int64_t t0 = it * bt, nt = std::min(bt, n - t0), M = nt * Hm;
    thread_local Buf S, acc, mx, l;
    S.resize(M * bk), acc.assign(M * R, F(0)), mx.assign(M, -std::numeric_limits<F>::infinity()), l.assign(M, F(0));
    const F* Q = qa + t0 * Hm * RD;    // rows (t, h): [M, RD]
    const int64_t kend = p + t0 + nt;  // keys visible to the tile's last token
    for (int64_t k0 = 0; k0 < kend; k0 += bk) {
      const int64_t nk = std::min(bk, kend - k0);
      gemm(false, true, M, nk, RD, scale, Q, RD, cache + k0 * RD, RD, F(0), S.data(), nk);
      for (int64_t r = 0; r < M; ++r) {
        F* sr = S.data() + r * nk;
        const int64_t valid = std::clamp<int64_t>(p + t0 + r / Hm + 1 - k0, 0, nk);  // causal
        if (valid == 0) {
          std::fill(sr, sr + nk, F(0));
          continue;
        }
        F m_new = mx[r];
        for (int64_t c = 0; c < valid; ++c) m_new = std::max(m_new, sr[c]);
        F sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < valid; ++c) {
          const F e = exp_of(sr[c] - m_new);
          sr[c] = e;
          sum += e;
        }
        std::fill(sr + valid, sr + nk, F(0));
        const F alpha = exp_of(mx[r] - m_new);  // 0 for the first tile (m = -inf)
        l[r] = l[r] * alpha + sum;
        mx[r] = m_new;
        if (alpha != F(1)) {
          F* ar = acc.data() + r * R;
#pragma omp simd
          for (int64_t e = 0; e < R; ++e) ar[e] *= alpha;
        }
      }
      gemm(false, false, M, R, nk, F(1), S.data(), nk, cache + k0 * RD, RD, F(1), acc.data(), R);
    }
    for (int64_t r = 0; r < M; ++r) {
      const F inv = F(1) / l[r];
      F* out = o_lat + (t0 * Hm + r) * R;
      for (int64_t e = 0; e < R; ++e) out[e] = acc[r * R + e] * inv;
    }
  });
}

template void mla_prefill_absorbed<float>(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          float, float*);
template void mla_prefill_absorbed<double>(const double*, const double*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                           double, double*);

}  // namespace lm::ops

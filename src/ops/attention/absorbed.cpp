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

// One query tile [t0, t0 + nt) over the keys [k_begin, k_end) (k_end at most those its last token sees): the running
// maximum mx, sum l and unnormalised accumulator acc of the online softmax, from scratch.
template <class F>
void absorbed_tile(const F* qa, const F* cache, int64_t p, int64_t t0, int64_t nt, int64_t k_begin, int64_t k_end,
                   int64_t Hm, int64_t R, int64_t Dr, F scale, std::vector<F>& S, F* mx, F* l, F* acc) {
  constexpr int64_t bk = 128;
  const int64_t RD = R + Dr, M = nt * Hm;
  S.resize(M * bk);
  std::fill(acc, acc + M * R, F(0));
  std::fill(mx, mx + M, -std::numeric_limits<F>::infinity());
  std::fill(l, l + M, F(0));
  const F* Q = qa + t0 * Hm * RD;  // rows (t, h): [M, RD]
  for (int64_t k0 = k_begin; k0 < k_end; k0 += bk) {
    const int64_t nk = std::min(bk, k_end - k0);
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
      const F alpha = exp_of(mx[r] - m_new);  // 0 for the first block (m = -inf)
      l[r] = l[r] * alpha + sum;
      mx[r] = m_new;
      if (alpha != F(1)) {
        F* ar = acc + r * R;
#pragma omp simd
        for (int64_t e = 0; e < R; ++e) ar[e] *= alpha;
      }
    }
    gemm(false, false, M, R, nk, F(1), S.data(), nk, cache + k0 * RD, RD, F(1), acc, R);
  }
}

template <class F>
void mla_prefill_absorbed(const F* qa, const F* cache, int64_t p, int64_t n, int64_t Hm, int64_t R, int64_t Dr,
                          F scale, F* o_lat) {
  using Buf = std::vector<F>;
  const int64_t bt = std::max<int64_t>(1, 128 / Hm);
  const int64_t ntiles = (n + bt - 1) / bt;
  // A short chunk far into a long context (the server's prefill pieces) has too few query tiles to keep the cores
  // busy: its keys are split into segments of kSeg, whose partial softmax states are merged in order. The split
  // depends on the sizes only, never on the thread count, so the result does not either.
  constexpr int64_t kSeg = 2048;
  const int64_t kend_max = p + n;
  const int64_t nseg = ntiles < 4 ? (kend_max + kSeg - 1) / kSeg : 1;
  if (nseg <= 1) {
    parallel_for_dynamic(ntiles, [&](int64_t it) {
      const int64_t t0 = it * bt, nt = std::min(bt, n - t0), M = nt * Hm;
      thread_local Buf S, acc, mx, l;
      acc.resize(M * R), mx.resize(M), l.resize(M);
      absorbed_tile(qa, cache, p, t0, nt, 0, p + t0 + nt, Hm, R, Dr, scale, S, mx.data(), l.data(), acc.data());
      for (int64_t r = 0; r < M; ++r) {
        const F inv = F(1) / l[r];
        F* out = o_lat + (t0 * Hm + r) * R;
        for (int64_t e = 0; e < R; ++e) out[e] = acc[r * R + e] * inv;
      }
    });
    return;
  }
  const int64_t Mmax = bt * Hm;
  Buf acc(static_cast<size_t>(ntiles * nseg * Mmax * R)), mx(static_cast<size_t>(ntiles * nseg * Mmax)),
      l(static_cast<size_t>(ntiles * nseg * Mmax));
  parallel_for_dynamic(ntiles * nseg, [&](int64_t w) {
    const int64_t it = w / nseg, sg = w % nseg, t0 = it * bt, nt = std::min(bt, n - t0);
    const int64_t kb = sg * kSeg, ke = std::min(p + t0 + nt, kb + kSeg);
    thread_local Buf S;
    F* a = acc.data() + w * Mmax * R;
    F* m = mx.data() + w * Mmax;
    F* s = l.data() + w * Mmax;
    if (kb >= ke) {  // past the tile's last visible key: an empty state
      std::fill(m, m + Mmax, -std::numeric_limits<F>::infinity());
      std::fill(s, s + Mmax, F(0));
      return;
    }
    absorbed_tile(qa, cache, p, t0, nt, kb, ke, Hm, R, Dr, scale, S, m, s, a);
  });
  for (int64_t it = 0; it < ntiles; ++it) {
    const int64_t t0 = it * bt, M = std::min(bt, n - t0) * Hm;
    for (int64_t r = 0; r < M; ++r) {
      F m = -std::numeric_limits<F>::infinity();
      for (int64_t sg = 0; sg < nseg; ++sg) m = std::max(m, mx[(it * nseg + sg) * Mmax + r]);
      F sum = 0;
      F* out = o_lat + (t0 * Hm + r) * R;
      std::fill(out, out + R, F(0));
      for (int64_t sg = 0; sg < nseg; ++sg) {
        const int64_t w = it * nseg + sg;
        const F ms = mx[w * Mmax + r];
        if (ms == -std::numeric_limits<F>::infinity()) continue;
        const F wgt = std::exp(ms - m);
        sum += l[w * Mmax + r] * wgt;
        const F* a = acc.data() + (w * Mmax + r) * R;
        for (int64_t e = 0; e < R; ++e) out[e] += a[e] * wgt;
      }
      const F inv = F(1) / sum;
      for (int64_t e = 0; e < R; ++e) out[e] *= inv;
    }
  }
}

template void mla_prefill_absorbed<float>(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          float, float*);
template void mla_prefill_absorbed<double>(const double*, const double*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                           double, double*);

}  // namespace lm::ops

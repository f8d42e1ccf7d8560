// Full (non-causal) varlen attention on the CPU (see full_attention.hpp for the math and layouts).
// Legend: N sequences, T_n length of sequence n, H heads, D head dim, Bq query tile rows.
#include "ops/full_attention/full_attention.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::ops {

namespace {
constexpr int64_t kBq = 64;
}  // namespace

void check_full_attn_dims(const FullAttnDims& d) {
  LM_CHECK(d.H >= 1 && d.D >= 1, "full attention: need H >= 1 and D >= 1, got H={} D={}", d.H, d.D);
  LM_CHECK(d.cu_seqlens && d.N >= 1, "full attention: cu_seqlens with N >= 1 sequences is required");
  LM_CHECK(d.cu_seqlens[0] == 0, "full attention: cu_seqlens must start at 0");
  for (int64_t n = 0; n < d.N; ++n)
    LM_CHECK(d.cu_seqlens[n + 1] >= d.cu_seqlens[n], "full attention: cu_seqlens must not decrease (entry {})", n + 1);
  LM_CHECK(d.ldqkv() >= d.H * d.D && d.ldo() >= d.H * d.D, "full attention: row strides {} / {} < H·D = {}",
           d.ldqkv(), d.ldo(), d.H * d.D);
}

template <class F>
void full_attention_reference(const F* q, const F* k, const F* v, F* o, F* lse, const FullAttnDims& d, F scale) {
  check_full_attn_dims(d);
  const int64_t H = d.H, D = d.D, ld = d.ldqkv(), ldo = d.ldo();
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t b = d.cu_seqlens[n], T = d.cu_seqlens[n + 1] - b;
    std::vector<double> s(static_cast<size_t>(T));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = b; t < b + T; ++t) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t u = 0; u < T; ++u) {
          double acc = 0;
          for (int64_t c = 0; c < D; ++c)
            acc += static_cast<double>(q[t * ld + h * D + c]) * static_cast<double>(k[(b + u) * ld + h * D + c]);
          s[u] = static_cast<double>(scale) * acc;
          mx = std::max(mx, s[u]);
        }
        double z = 0;
        for (int64_t u = 0; u < T; ++u) z += std::exp(s[u] - mx);
        for (int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (int64_t u = 0; u < T; ++u) acc += std::exp(s[u] - mx) / z * static_cast<double>(v[(b + u) * ld + h * D + c]);
          o[t * ldo + h * D + c] = static_cast<F>(acc);
        }
        if (lse) lse[t * H + h] = static_cast<F>(mx + std::log(z));
      }
  }
}

template <class F>
void full_attention_forward(const F* q, const F* k, const F* v, F* o, F* lse, const FullAttnDims& d, F scale) {
  check_full_attn_dims(d);
  const int64_t H = d.H, D = d.D, ld = d.ldqkv(), ldo = d.ldo();
  // Work items: (sequence, head, query tile), all independent.
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r0 = 0; r0 < d.cu_seqlens[n + 1] - d.cu_seqlens[n]; r0 += kBq) items.push_back({n, h, r0});
  parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const auto [n, h, r0] = items[static_cast<size_t>(i)];
    const int64_t b = d.cu_seqlens[n], T = d.cu_seqlens[n + 1] - b, m = std::min(kBq, T - r0);
    std::vector<F> S(static_cast<size_t>(m * T));  // [m, T] scores, then probabilities
    const F* qt = q + (b + r0) * ld + h * D;
    gemm(false, true, m, T, D, scale, qt, ld, k + b * ld + h * D, ld, F(0), S.data(), T);
    for (int64_t r = 0; r < m; ++r) {
      F* sr = S.data() + r * T;
      const F mx = *std::max_element(sr, sr + T);
      F z = 0;
      for (int64_t u = 0; u < T; ++u) z += (sr[u] = std::exp(sr[u] - mx));
      const F inv = F(1) / z;
      for (int64_t u = 0; u < T; ++u) sr[u] *= inv;
      lse[(b + r0 + r) * H + h] = mx + std::log(z);
    }
    gemm(false, false, m, D, T, F(1), S.data(), T, v + b * ld + h * D, ld, F(0), o + (b + r0) * ldo + h * D, ldo);
  });
}

template <class F>
void full_attention_backward(const F* q, const F* k, const F* v, const F* o, const F* lse, const F* do_, F* dq, F* dk,
                             F* dv, const FullAttnDims& d, F scale) {
  check_full_attn_dims(d);
  const int64_t H = d.H, D = d.D, ld = d.ldqkv(), ldo = d.ldo();
  // One item per (sequence, head): its dK and dV columns are its own, summed over its query tiles in order.
  parallel_for(d.N * H, [&](int64_t i) {
    const int64_t n = i / H, h = i % H;
    const int64_t b = d.cu_seqlens[n], T = d.cu_seqlens[n + 1] - b;
    if (T == 0) return;
    const F* kn = k + b * ld + h * D;
    const F* vn = v + b * ld + h * D;
    F* dkn = dk + b * ld + h * D;
    F* dvn = dv + b * ld + h * D;
    std::vector<F> P(static_cast<size_t>(std::min(kBq, T) * T)), dS(P.size());
    for (int64_t r0 = 0; r0 < T; r0 += kBq) {
      const int64_t m = std::min(kBq, T - r0);
      const F* qt = q + (b + r0) * ld + h * D;
      const F* dot = do_ + (b + r0) * ldo + h * D;
      const F* ot = o + (b + r0) * ldo + h * D;
      gemm(false, true, m, T, D, scale, qt, ld, kn, ld, F(0), P.data(), T);
      gemm(false, true, m, T, D, F(1), dot, ldo, vn, ld, F(0), dS.data(), T);  // dP
      for (int64_t r = 0; r < m; ++r) {
        const F l = lse[(b + r0 + r) * H + h];
        F delta = 0;
        for (int64_t c = 0; c < D; ++c) delta += dot[r * ldo + c] * ot[r * ldo + c];
        F* pr = P.data() + r * T;
        F* sr = dS.data() + r * T;
        for (int64_t u = 0; u < T; ++u) {
          pr[u] = std::exp(pr[u] - l);
          sr[u] = pr[u] * (sr[u] - delta);
        }
      }
      const F beta = r0 == 0 ? F(0) : F(1);
      gemm(false, false, m, D, T, scale, dS.data(), T, kn, ld, F(0), dq + (b + r0) * ld + h * D, ld);
      gemm(true, false, T, D, m, scale, dS.data(), T, qt, ld, beta, dkn, ld);
      gemm(true, false, T, D, m, F(1), P.data(), T, dot, ldo, beta, dvn, ld);
    }
  });
}

#define LM_INST(F)                                                                                                \
  template void full_attention_reference<F>(const F*, const F*, const F*, F*, F*, const FullAttnDims&, F);        \
  template void full_attention_forward<F>(const F*, const F*, const F*, F*, F*, const FullAttnDims&, F);          \
  template void full_attention_backward<F>(const F*, const F*, const F*, const F*, const F*, const F*, F*, F*, F*, \
                                           const FullAttnDims&, F);
LM_INST(float)
LM_INST(double)
#undef LM_INST

}  // namespace lm::ops

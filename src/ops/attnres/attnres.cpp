// Block AttnRes read on the CPU: one-shot forward/backward and the two-phase decode form.
// Legend: N sources, T tokens, d hidden, Q reads of phase 1, M sources of phase 2, nb fixed token blocks.
#include "ops/attnres/attnres.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {

namespace {

void check_args(const char* who, int64_t N, int64_t T, int64_t d, double eps) {
  LM_CHECK(N >= 0 && T >= 0 && d > 0, "{}: need N >= 0, T >= 0, d > 0; got N={} T={} d={}", who, N, T, d);
  LM_CHECK(eps >= 0 && std::isfinite(eps), "{}: eps must be finite and >= 0, got {}", who, eps);
}

template <class F>
void check_sources(const char* who, const F* const* v, int64_t N) {
  LM_CHECK(N == 0 || v != nullptr, "{}: source array is null", who);
  for (int64_t j = 0; j < N; ++j) LM_CHECK(v[j] != nullptr, "{}: source {} of {} is null", who, j, N);
}

// Token partition that depends on T only (never on the thread count): the dq reduction is reproducible.
struct TokenBlocks {
  int64_t nb, T;
  int64_t begin(int64_t b) const { return b * T / nb; }
  int64_t end(int64_t b) const { return (b + 1) * T / nb; }
};
TokenBlocks token_blocks(int64_t T) {
  constexpr int64_t kMinTokens = 16, kMaxBlocks = 64;
  return {std::clamp<int64_t>((T + kMinTokens - 1) / kMinTokens, 1, kMaxBlocks), T};
}

// Parallel only when each thread gets at least ~kMinWork source elements (fork/join is not free).
constexpr int64_t kMinWork = 1 << 14;
int64_t grain(int64_t work_per_block) { return std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, work_per_block)); }

// 1/r and q.v for one source row in one pass.
template <class F>
inline void score_parts(const F* vr, const F* q, int64_t d, F eps, F& rinv, F& qv) {
  F ss = 0, dot = 0;
#pragma omp simd reduction(+ : ss, dot)
  for (int64_t c = 0; c < d; ++c) {
    ss += vr[c] * vr[c];
    dot += q[c] * vr[c];
  }
  rinv = F(1) / std::sqrt(ss / static_cast<F>(d) + eps);
  qv = dot;
}

template <class F>
std::vector<F> make_query(const F* w, const F* gamma, int64_t d) {
  std::vector<F> q(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) q[static_cast<size_t>(c)] = gamma[c] * w[c];
  return q;
}

// a = softmax(z) in place over n entries.
template <class F>
inline void softmax_inplace(F* z, int64_t n) {
  F mx = z[0];
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, z[j]);
  F sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    z[j] = std::exp(z[j] - mx);
    sum += z[j];
  }
  const F inv = F(1) / sum;
  for (int64_t j = 0; j < n; ++j) z[j] *= inv;
}

}  // namespace

template <class F>
void attnres_forward(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, F eps, F* h,
                     F* probs) {
  check_args("attnres_forward", N, T, d, static_cast<double>(eps));
  LM_CHECK(N >= 1, "attnres_forward: need at least one source");
  check_sources("attnres_forward", v, N);
  const std::vector<F> q = make_query(w, gamma, d);
  const TokenBlocks tb = token_blocks(T);
  parallel_for(
      tb.nb,
      [&](int64_t b) {
        std::vector<F> a(static_cast<size_t>(N)), rinv(static_cast<size_t>(N));
        for (int64_t t = tb.begin(b); t < tb.end(b); ++t) {
          for (int64_t j = 0; j < N; ++j) {
            F qv;
            score_parts(v[j] + t * d, q.data(), d, eps, rinv[static_cast<size_t>(j)], qv);
            a[static_cast<size_t>(j)] = qv * rinv[static_cast<size_t>(j)];
          }
          softmax_inplace(a.data(), N);
          F* ht = h + t * d;
          const F a0 = a[0];
          const F* v0 = v[0] + t * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ht[c] = a0 * v0[c];
          for (int64_t j = 1; j < N; ++j) {
            const F aj = a[static_cast<size_t>(j)];
            const F* vj = v[j] + t * d;
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) ht[c] += aj * vj[c];
          }
          if (probs)
            for (int64_t j = 0; j < N; ++j) probs[t * N + j] = a[static_cast<size_t>(j)];
        }
      },
      grain((T / tb.nb + 1) * N * d));
}

template <class F>
void attnres_backward(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, F eps,
                      const F* dh, F* const* dv, F* dw, F* dgamma) {
  check_args("attnres_backward", N, T, d, static_cast<double>(eps));
  LM_CHECK(N >= 1, "attnres_backward: need at least one source");
  check_sources("attnres_backward", v, N);
  const std::vector<F> q = make_query(w, gamma, d);
  const TokenBlocks tb = token_blocks(T);
  const bool want_dq = dw || dgamma;
  std::vector<double> partial(want_dq ? static_cast<size_t>(tb.nb * d) : 0, 0.0);
  const F inv_d = F(1) / static_cast<F>(d);
  parallel_for(
      tb.nb,
      [&](int64_t b) {
        const auto n = static_cast<size_t>(N);
        std::vector<F> a(n), z(n), rinv(n), dv_dot(n);
        double* pq = want_dq ? partial.data() + b * d : nullptr;
        for (int64_t t = tb.begin(b); t < tb.end(b); ++t) {
          const F* delta = dh + t * d;
          for (int64_t j = 0; j < N; ++j) {
            const F* vj = v[j] + t * d;
            F qv;
            score_parts(vj, q.data(), d, eps, rinv[static_cast<size_t>(j)], qv);
            z[static_cast<size_t>(j)] = qv * rinv[static_cast<size_t>(j)];
            F dd = 0;
#pragma omp simd reduction(+ : dd)
            for (int64_t c = 0; c < d; ++c) dd += delta[c] * vj[c];
            dv_dot[static_cast<size_t>(j)] = dd;
          }
          std::copy(z.begin(), z.end(), a.begin());
          softmax_inplace(a.data(), N);
          F delta_h = 0;  // delta . h = sum_j a_j (delta . v_j)
          for (size_t j = 0; j < n; ++j) delta_h += a[j] * dv_dot[j];
          for (int64_t j = 0; j < N; ++j) {
            const auto js = static_cast<size_t>(j);
            const F dz = a[js] * (dv_dot[js] - delta_h);
            const F* vj = v[j] + t * d;
            const F coef_q = dz * rinv[js];                             // dz / r
            const F coef_v = dz * z[js] * rinv[js] * rinv[js] * inv_d;  // dz z / (r^2 d)
            if (pq) {
#pragma omp simd
              for (int64_t c = 0; c < d; ++c) pq[c] += static_cast<double>(coef_q * vj[c]);
            }
            if (F* g = dv[j]) {
              g += t * d;
              const F aj = a[js];
#pragma omp simd
              for (int64_t c = 0; c < d; ++c)
                g[c] += aj * delta[c] + coef_q * q[static_cast<size_t>(c)] - coef_v * vj[c];
            }
          }
        }
      },
      grain((T / tb.nb + 1) * N * d));
  if (!want_dq) return;
  for (int64_t c = 0; c < d; ++c) {
    double s = 0;
    for (int64_t b = 0; b < tb.nb; ++b) s += partial[static_cast<size_t>(b * d + c)];
    const F dq = static_cast<F>(s);
    if (dw) dw[c] += dq * gamma[c];
    if (dgamma) dgamma[c] += dq * w[c];
  }
}

template <class F>
void attnres_phase1(const F* const* v, int64_t N, int64_t T, int64_t d, const F* w, const F* gamma, int64_t Q, F eps,
                    F* m, F* l, F* acc) {
  check_args("attnres_phase1", N, T, d, static_cast<double>(eps));
  LM_CHECK(Q >= 1, "attnres_phase1: need Q >= 1 reads, got {}", Q);
  check_sources("attnres_phase1", v, N);
  std::vector<F> qs(static_cast<size_t>(Q * d));
  for (int64_t i = 0; i < Q * d; ++i) qs[static_cast<size_t>(i)] = gamma[i] * w[i];
  const TokenBlocks tb = token_blocks(T);
  parallel_for(
      tb.nb,
      [&](int64_t b) {
        std::vector<F> rinv(static_cast<size_t>(N)), z(static_cast<size_t>(N * Q));  // z [N, Q]
        for (int64_t t = tb.begin(b); t < tb.end(b); ++t) {
          // Scores of all Q reads against each closed source: the norm of v_j is shared by the reads.
          for (int64_t j = 0; j < N; ++j) {
            const F* vj = v[j] + t * d;
            F qv0;
            score_parts(vj, qs.data(), d, eps, rinv[static_cast<size_t>(j)], qv0);
            z[static_cast<size_t>(j * Q)] = qv0 * rinv[static_cast<size_t>(j)];
            for (int64_t i = 1; i < Q; ++i) {
              const F* qi = qs.data() + i * d;
              F dot = 0;
#pragma omp simd reduction(+ : dot)
              for (int64_t c = 0; c < d; ++c) dot += qi[c] * vj[c];
              z[static_cast<size_t>(j * Q + i)] = dot * rinv[static_cast<size_t>(j)];
            }
          }
          for (int64_t i = 0; i < Q; ++i) {
            F* acc_it = acc + (i * T + t) * d;
            std::fill(acc_it, acc_it + d, F(0));
            F mx = -std::numeric_limits<F>::infinity(), sum = 0;
            for (int64_t j = 0; j < N; ++j) mx = std::max(mx, z[static_cast<size_t>(j * Q + i)]);
            for (int64_t j = 0; j < N; ++j) {
              const F e = std::exp(z[static_cast<size_t>(j * Q + i)] - mx);
              sum += e;
              const F* vj = v[j] + t * d;
#pragma omp simd
              for (int64_t c = 0; c < d; ++c) acc_it[c] += e * vj[c];
            }
            m[i * T + t] = mx;
            l[i * T + t] = sum;
          }
        }
      },
      grain((T / tb.nb + 1) * N * Q * d));
}

template <class F>
void attnres_phase2(const F* m, const F* l, const F* acc, const F* const* v, int64_t M, int64_t T, int64_t d,
                    const F* w, const F* gamma, F eps, F* h) {
  check_args("attnres_phase2", M, T, d, static_cast<double>(eps));
  LM_CHECK(M >= 1, "attnres_phase2: need at least one new source, got M={}", M);
  check_sources("attnres_phase2", v, M);
  const std::vector<F> q = make_query(w, gamma, d);
  const TokenBlocks tb = token_blocks(T);
  parallel_for(
      tb.nb,
      [&](int64_t b) {
        std::vector<F> z(static_cast<size_t>(M));
        for (int64_t t = tb.begin(b); t < tb.end(b); ++t) {
          F mx = m[t];
          for (int64_t j = 0; j < M; ++j) {
            F rinv, qv;
            score_parts(v[j] + t * d, q.data(), d, eps, rinv, qv);
            z[static_cast<size_t>(j)] = qv * rinv;
            mx = std::max(mx, z[static_cast<size_t>(j)]);
          }
          // Rescale the closed-block state to the new max; an empty state (l = 0, m = -inf) contributes 0.
          const F s_old = l[t] > F(0) ? std::exp(m[t] - mx) : F(0);
          F sum = l[t] * s_old;
          F* ht = h + t * d;
          const F* at = acc + t * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ht[c] = s_old * at[c];
          for (int64_t j = 0; j < M; ++j) {
            const F e = std::exp(z[static_cast<size_t>(j)] - mx);
            sum += e;
            const F* vj = v[j] + t * d;
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) ht[c] += e * vj[c];
          }
          const F inv = F(1) / sum;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ht[c] *= inv;
        }
      },
      grain((T / tb.nb + 1) * M * d));
}

#define LM_INSTANTIATE(F)                                                                                             \
  template void attnres_forward<F>(const F* const*, int64_t, int64_t, int64_t, const F*, const F*, F, F*, F*);        \
  template void attnres_backward<F>(const F* const*, int64_t, int64_t, int64_t, const F*, const F*, F, const F*,      \
                                    F* const*, F*, F*);                                                               \
  template void attnres_phase1<F>(const F* const*, int64_t, int64_t, int64_t, const F*, const F*, int64_t, F, F*, F*, \
                                  F*);                                                                                \
  template void attnres_phase2<F>(const F*, const F*, const F*, const F* const*, int64_t, int64_t, int64_t, const F*, \
                                  const F*, F, F*);
LM_INSTANTIATE(float)
LM_INSTANTIATE(double)
#undef LM_INSTANTIATE

}  // namespace lm::ops

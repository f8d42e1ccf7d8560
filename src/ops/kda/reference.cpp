// Token-by-token KDA core (SPEC §2): the definition every faster path is checked against.
// T tokens, H heads, K key dim, V value dim; per (sequence, head) a state S [K, V]:
//   S' = diag(exp g_t) S_{t-1}
//   u  = S'^T k_t,  e = beta_t (v_t - u)
//   S_t = S' + k_t e^T
//   o_t = S_t^T (scale q_t)
// Backward walks time in reverse with dS = dL/dS_t (dht at the end), the adjoint of each line above.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {

void check_dims(const Dims& d) {
  LM_CHECK(d.B >= 1 && d.T >= 0 && d.H >= 1 && d.K >= 1 && d.V >= 1,
           "kda: bad dims B={} T={} H={} K={} V={} (need B, H, K, V >= 1 and T >= 0)", d.B, d.T, d.H, d.K, d.V);
  if (!d.cu_seqlens) return;
  LM_CHECK(d.B == 1, "kda: varlen (cu_seqlens) needs B == 1, got B={}", d.B);
  LM_CHECK(d.N >= 1, "kda: varlen needs N >= 1 sequences, got N={}", d.N);
  LM_CHECK(d.cu_seqlens[0] == 0, "kda: cu_seqlens must start at 0, got {}", d.cu_seqlens[0]);
  for (int64_t n = 0; n < d.N; ++n)
    LM_CHECK(d.cu_seqlens[n + 1] >= d.cu_seqlens[n], "kda: cu_seqlens must be non-decreasing, cu[{}]={} > cu[{}]={}", n,
             d.cu_seqlens[n], n + 1, d.cu_seqlens[n + 1]);
  LM_CHECK(d.cu_seqlens[d.N] == d.T, "kda: cu_seqlens must end at T={}, got cu[{}]={}", d.T, d.N, d.cu_seqlens[d.N]);
}

namespace {

// One step on S [K, V] in place; o (nullable) receives S_t^T (scale q). w is [2V + K] scratch.
// The single definition of the arithmetic shared by reference_forward, its backward replay and decode_step.
// The step runs in double whatever F is and rounds S once: S' = diag(exp g) S is never stored, and u, o
// are sums over K. A float state would otherwise take three roundings per entry and token (S', S' + k eᵀ,
// and the sums), which the recurrence carries forward over the whole memory of slowly decaying channels.
// It costs O(K·V) per token and head, like the state update itself.
template <class F>
void delta_step(F* S, const F* q, const F* k, const F* v, const F* g, F beta, F scale, F* o, double* w, int64_t K,
                int64_t V) {
  double *u = w, *oa = w + V, *a = w + 2 * V;
  std::fill(u, u + 2 * V, 0.0);
  for (int64_t i = 0; i < K; ++i) {  // u = S'^T k with S' = diag(exp g) S
    const F* row = S + i * V;
    a[i] = std::exp(static_cast<double>(g[i]));
    const double aki = a[i] * static_cast<double>(k[i]);
    for (int64_t j = 0; j < V; ++j) u[j] += aki * static_cast<double>(row[j]);
  }
  for (int64_t j = 0; j < V; ++j) u[j] = static_cast<double>(beta) * (static_cast<double>(v[j]) - u[j]);  // e
  for (int64_t i = 0; i < K; ++i) {  // S = S' + k e^T, o = S^T (scale q)
    F* row = S + i * V;
    const double ai = a[i], ki = static_cast<double>(k[i]), sq = static_cast<double>(scale) * q[i];
    for (int64_t j = 0; j < V; ++j) {
      const double sn = ai * static_cast<double>(row[j]) + ki * u[j];
      row[j] = static_cast<F>(sn);
      oa[j] += sq * sn;
    }
  }
  if (o)
    for (int64_t j = 0; j < V; ++j) o[j] = static_cast<F>(oa[j]);
}

int64_t step_scratch(int64_t K, int64_t V) { return 2 * V + K; }

template <class F>
void check_core(const CoreInputs<F>& in, const Dims& d) {
  check_dims(d);
  LM_CHECK(in.q && in.k && in.v && in.g && in.beta, "kda reference: q, k, v, g and beta are required");
}

// Per-row offsets of one (sequence, head) pair into the [rows, H, *] layouts.
struct Idx {
  int64_t H, K, V;
  int64_t qk(int64_t row, int64_t h) const { return (row * H + h) * K; }
  int64_t v(int64_t row, int64_t h) const { return (row * H + h) * V; }
  int64_t b(int64_t row, int64_t h) const { return row * H + h; }
  int64_t state(int64_t n, int64_t h) const { return (n * H + h) * K * V; }
};

// Dynamic-schedule loop over (sequence, head) that stays on the calling thread for tiny problems.
template <class Fn>
void for_items(int64_t n, int64_t work, Fn&& f) {
  if (work < (1 << 14)) {
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
    parallel_for_dynamic(n, f);
  }
}

constexpr int64_t kSeg = 64;  // backward checkpoint spacing: memory (T/kSeg + kSeg) * K * V per head

}  // namespace

template <class F>
void reference_forward(const CoreInputs<F>& in, const Dims& d, F* o, F* ht) {
  check_core(in, d);
  LM_CHECK(o != nullptr, "kda reference_forward: o is required");
  const int64_t H = d.H, K = d.K, V = d.V, KV = K * V;
  const Idx ix{H, K, V};
  for_items(d.num_seqs() * H, d.B * d.T * H * KV, [&](int64_t item) {
    const int64_t n = item / H, h = item % H, b = d.seq_begin(n), L = d.seq_len(n);
    std::vector<F> S(static_cast<size_t>(KV), F(0));
    std::vector<double> w(static_cast<size_t>(step_scratch(K, V)));
    if (in.h0) std::copy_n(in.h0 + ix.state(n, h), KV, S.data());
    for (int64_t t = 0; t < L; ++t) {
      const int64_t r = b + t;
      delta_step(S.data(), in.q + ix.qk(r, h), in.k + ix.qk(r, h), in.v + ix.v(r, h), in.g + ix.qk(r, h),
                 in.beta[ix.b(r, h)], in.scale, o + ix.v(r, h), w.data(), K, V);
    }
    if (ht) std::copy_n(S.data(), KV, ht + ix.state(n, h));
  });
}

template <class F>
void reference_backward(const CoreInputs<F>& in, const Dims& d, const F* do_, const F* dht, const CoreGrads<F>& gr) {
  check_core(in, d);
  LM_CHECK(do_ != nullptr, "kda reference_backward: do is required");
  const int64_t H = d.H, K = d.K, V = d.V, KV = K * V;
  const Idx ix{H, K, V};
  const F scale = in.scale;
  for_items(d.num_seqs() * H, d.B * d.T * H * KV, [&](int64_t item) {
    const int64_t n = item / H, h = item % H, b = d.seq_begin(n), L = d.seq_len(n);
    const int64_t nseg = (L + kSeg - 1) / kSeg;
    auto sz = [](int64_t m) { return static_cast<size_t>(m); };
    // Forward replay keeping the state at the start of every segment.
    std::vector<F> ckpt(sz(nseg * KV)), S(sz(KV), F(0)), u(sz(V));
    std::vector<double> w(sz(step_scratch(K, V)));
    if (in.h0) std::copy_n(in.h0 + ix.state(n, h), KV, S.data());
    for (int64_t m = 0; m < nseg; ++m) {
      std::copy_n(S.data(), KV, ckpt.data() + m * KV);
      for (int64_t t = m * kSeg; t < std::min(L, (m + 1) * kSeg); ++t) {
        const int64_t r = b + t;
        delta_step(S.data(), in.q + ix.qk(r, h), in.k + ix.qk(r, h), in.v + ix.v(r, h), in.g + ix.qk(r, h),
                   in.beta[ix.b(r, h)], scale, static_cast<F*>(nullptr), w.data(), K, V);
      }
    }
    std::vector<F> dS(sz(KV), F(0));  // dL/dS_t
    if (dht) std::copy_n(dht + ix.state(n, h), KV, dS.data());
    std::vector<F> buf(sz((kSeg + 1) * KV));  // states S_{t0-1} .. S_{t0+len-1} of one segment
    std::vector<F> a(sz(K)), e(sz(V)), vmu(sz(V)), de(sz(V)), du(sz(V)), dq(sz(K)), dk(sz(K)), dg(sz(K));
    for (int64_t m = nseg - 1; m >= 0; --m) {
      const int64_t t0 = m * kSeg, len = std::min(kSeg, L - t0);
      std::copy_n(ckpt.data() + m * KV, KV, buf.data());
      for (int64_t s = 0; s < len; ++s) {
        const int64_t r = b + t0 + s;
        std::copy_n(buf.data() + s * KV, KV, buf.data() + (s + 1) * KV);
        delta_step(buf.data() + (s + 1) * KV, in.q + ix.qk(r, h), in.k + ix.qk(r, h), in.v + ix.v(r, h),
                   in.g + ix.qk(r, h), in.beta[ix.b(r, h)], scale, static_cast<F*>(nullptr), w.data(), K, V);
      }
      for (int64_t s = len - 1; s >= 0; --s) {
        const int64_t r = b + t0 + s;
        const F* Sp = buf.data() + s * KV;        // S_{t-1}
        const F* St = buf.data() + (s + 1) * KV;  // S_t
        const F* q = in.q + ix.qk(r, h);
        const F* k = in.k + ix.qk(r, h);
        const F* v = in.v + ix.v(r, h);
        const F* g = in.g + ix.qk(r, h);
        const F* dO = do_ + ix.v(r, h);
        const F beta = in.beta[ix.b(r, h)];
        // Recompute u = S'^T k and e = beta (v - u).
        std::fill(u.begin(), u.end(), F(0));
        for (int64_t i = 0; i < K; ++i) {
          a[sz(i)] = std::exp(g[i]);
          const F* row = Sp + i * V;
          for (int64_t j = 0; j < V; ++j) u[sz(j)] += k[i] * (row[j] * a[sz(i)]);
        }
        for (int64_t j = 0; j < V; ++j) {
          vmu[sz(j)] = v[j] - u[sz(j)];
          e[sz(j)] = beta * vmu[sz(j)];
        }
        // o_t = scale S_t^T q:  dq = scale S_t do;  dS_t += scale q do^T.
        // S_t = S' + k e^T:     dk = dS_t e;       de = dS_t^T k.
        std::fill(de.begin(), de.end(), F(0));
        for (int64_t i = 0; i < K; ++i) {
          const F* st = St + i * V;
          F* ds = dS.data() + i * V;
          const F sq = scale * q[i];
          F acc_q = 0, acc_k = 0;
          for (int64_t j = 0; j < V; ++j) {
            acc_q += st[j] * dO[j];
            ds[j] += sq * dO[j];
            acc_k += ds[j] * e[sz(j)];
            de[sz(j)] += k[i] * ds[j];
          }
          dq[sz(i)] = scale * acc_q;
          dk[sz(i)] = acc_k;
        }
        // e = beta (v - u):  dbeta = de . (v - u);  dv = beta de;  du = -beta de.
        F dbeta = 0;
        for (int64_t j = 0; j < V; ++j) {
          dbeta += de[sz(j)] * vmu[sz(j)];
          du[sz(j)] = -beta * de[sz(j)];
        }
        // u = S'^T k:          dk += S' du;  dS' = dS_t + k du^T.
        // S' = diag(a) S_{t-1}: dg_i = sum_j dS'_ij S'_ij  (da/dg = a);  dS_{t-1} = diag(a) dS'.
        for (int64_t i = 0; i < K; ++i) {
          const F* sp = Sp + i * V;
          F* ds = dS.data() + i * V;
          const F ai = a[sz(i)], ki = k[i];
          F acc_k = 0, acc_g = 0;
          for (int64_t j = 0; j < V; ++j) {
            const F spr = sp[j] * ai;
            const F dsp = ds[j] + ki * du[sz(j)];
            acc_k += spr * du[sz(j)];
            acc_g += dsp * spr;
            ds[j] = ai * dsp;
          }
          dk[sz(i)] += acc_k;
          dg[sz(i)] = acc_g;
        }
        if (gr.dq) std::copy_n(dq.data(), K, gr.dq + ix.qk(r, h));
        if (gr.dk) std::copy_n(dk.data(), K, gr.dk + ix.qk(r, h));
        if (gr.dg) std::copy_n(dg.data(), K, gr.dg + ix.qk(r, h));
        if (gr.dv)
          for (int64_t j = 0; j < V; ++j) gr.dv[ix.v(r, h) + j] = beta * de[sz(j)];
        if (gr.dbeta) gr.dbeta[ix.b(r, h)] = dbeta;
      }
    }
    if (gr.dh0) std::copy_n(dS.data(), KV, gr.dh0 + ix.state(n, h));
  });
}

template <class F>
void decode_step(F* state, const F* q, const F* k, const F* v, const F* g, const F* beta, F* o, int64_t S, int64_t H,
                 int64_t K, int64_t V, F scale) {
  LM_CHECK(S >= 0 && H >= 1 && K >= 1 && V >= 1, "kda decode_step: bad shape S={} H={} K={} V={}", S, H, K, V);
  LM_CHECK(state && q && k && v && g && beta && o, "kda decode_step: null argument");
  const Idx ix{H, K, V};
  parallel_for(
      S,
      [&](int64_t s) {
        std::vector<double> w(static_cast<size_t>(step_scratch(K, V)));
        for (int64_t h = 0; h < H; ++h)
          delta_step(state + ix.state(s, h), q + ix.qk(s, h), k + ix.qk(s, h), v + ix.v(s, h), g + ix.qk(s, h),
                     beta[ix.b(s, h)], scale, o + ix.v(s, h), w.data(), K, V);
      },
      std::max<int64_t>(1, (1 << 14) / (H * K * V)));
}

#define LM_KDA_REF_INST(F)                                                                                          \
  template void reference_forward<F>(const CoreInputs<F>&, const Dims&, F*, F*);                                    \
  template void reference_backward<F>(const CoreInputs<F>&, const Dims&, const F*, const F*, const CoreGrads<F>&);  \
  template void decode_step<F>(F*, const F*, const F*, const F*, const F*, const F*, F*, int64_t, int64_t, int64_t, \
                               int64_t, F);
LM_KDA_REF_INST(float)
LM_KDA_REF_INST(double)
#undef LM_KDA_REF_INST

}  // namespace lm::kda

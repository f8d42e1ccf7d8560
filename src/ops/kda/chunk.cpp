// Chunked KDA on the CPU, forward and backward (SPEC §2.1, §2.2).
//
// Legend: T tokens of one sequence, H heads, K key dim, V value dim, C = 64 chunk, c <= C rows in
//         the current chunk (tail chunks are shorter), 16-row sub-tiles r with rows [i0, i1).
// Per chunk, with G = cumsum(g) (per channel), Γ = exp(G), S0 the state at the chunk start:
//   A_qk[i,j] = scale Σ_d q_id k_jd e^{G_id - G_jd}  (j <= i)      P_kk[i,j] = Σ_d k_id k_jd e^{G_id - G_jd} (j < i)
//   M = (I + Diag(β) P_kk)^-1,  U = M Diag(β) V,  W = M Diag(β) (K⊙Γ),  E = U - W S0
//   O = scale (Q⊙Γ) S0 + A_qk E,   S_C = Diag(Γ_last) S0 + (K ⊙ e^{G_last - G})ᵀ E
// The pairwise factor e^{G_i - G_j} is split around an anchor a as e^{G_i - a} · e^{a - G_j}, which
// turns a 16-row tile of A into one GEMM:
//   Bounded: a = G_{i0} + 7.5·lb for the whole row tile (diagonal tile included). With g >= lb each
//            factor stays within e^{±7.5|lb|} (e^{±37.5} for lb = -5), and a depends only on rows
//            <= i0, so prefill and decode agree. Past tiles only get smaller factors (they may
//            underflow to 0, which happens only for products below e^{-50} of the kept terms).
//   Exact:   a = G_{i0} for the past tiles (both factors <= 1, safe for any gate); the diagonal
//            tile pair by pair with one exp per pair and channel, never overflowing.
// G and every exponent (G_i - a, a - G_j, G_last - G) are formed in double, also for float: |G| reaches
// C·|lb| (320 for lb = -5), and a float cumulative sum would carry an absolute error of up to ~1e-5 into
// every factor e^{G_i - G_j}, however close i and j are (C·K adds per chunk). The exponentials and
// everything after them run in F.
// Each (sequence, head) runs sequentially over its chunks; pairs run in parallel.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/simd_math.hpp"
#include "ops/gemm/gemm.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {

const char* diag_path_name(DiagPath p) {
  switch (p) {
    case DiagPath::Auto: return "auto";
    case DiagPath::Bounded: return "bounded";
    case DiagPath::Exact: return "exact";
  }
  return "?";
}

// The bounded path multiplies factors up to e^{7.5|lb|}; beyond |lb| = 10 (e^75) the masked-out
// products of the diagonal tile approach fp32's range, so such gates take the exact path.
static constexpr double kMaxBoundedLb = 10.0;

DiagPath resolve_diag_path(DiagPath requested, GateParams gate) {
  const bool bounded_ok = gate.form == GateForm::LowerBound && gate.lower_bound < 0 &&
                          -gate.lower_bound <= kMaxBoundedLb;
  if (requested == DiagPath::Auto) return bounded_ok ? DiagPath::Bounded : DiagPath::Exact;
  if (requested == DiagPath::Bounded)
    LM_CHECK(bounded_ok,
             "the bounded diagonal path needs a lower-bounded gate with -{} <= lower_bound < 0 (got {} gate{}); "
             "use the exact path",
             kMaxBoundedLb, gate.form == GateForm::LowerBound ? "lower-bound" : "softplus",
             gate.form == GateForm::LowerBound ? fmt::format(", lower_bound {}", gate.lower_bound) : std::string());
  return requested;
}

namespace {

constexpr int64_t kC = 64;     // chunk length
constexpr int64_t kTile = 16;  // sub-tile length

// e^x for an exponent x formed in double (a difference of cumulative gate sums), x <= 0. Rounding x
// to float costs |x|·2^-24 relative, but the factor itself is e^{-|x|}, so the error it carries into
// any sum is at most max |x| e^{-|x|} · 2^-24 (~2e-8 of the largest term).
template <class F>
LM_ALWAYS_INLINE F fexp_d(double x) {
  if constexpr (std::is_same_v<F, float>) return exp_approx(static_cast<float>(x));
  else return std::exp(x);
}

// e^x for the bounded path's anchored factors: one of e^{G_i - a}, e^{a - G_j} is up to e^{7.5|lb|}
// (e^37.5) while their product is O(1), so a float exponent would cost up to 37.5·2^-24 = 2e-6 of the
// product. For float x is split as x = xh + xl (xh = fl(x), |xl| <= ulp(xh)/2), e^x = e^xh (1 + xl).
template <class F>
LM_ALWAYS_INLINE F fexp_split(double x) {
  if constexpr (std::is_same_v<F, float>) {
    const float xh = static_cast<float>(x);
    const float xl = static_cast<float>(x - static_cast<double>(xh));
    return exp_approx(xh) * (1.0f + xl);
  } else {
    return std::exp(x);
  }
}

// Scratch for one chunk of one (sequence, head); reused across chunks. Buffers that feed the same
// GEMM sit side by side so that one call does the work of two:
//   X  [2C, V+K]: rows 0..c = [U | W], rows c..2c = [ - | Q⊙Γ ]   (M [βV | βK⊙Γ] and [W; Q⊙Γ] S0)
//   BB [C, V+K]:  [βV | βK⊙Γ]
//   Y  [2C, V]:   [W S0 ; Q⊙Γ S0]
template <class F>
struct Work {
  int64_t K, V, ldx;                 // ldx = V + K
  std::vector<F> q, k, v, beta;      // [C,K] [C,K] [C,V] [C]
  std::vector<double> G, Gl;         // G = cumsum(g) [C,K], G_last [K]: double for any F (see the top)
  std::vector<F> Gam, Kg, Dec, Kd;   // Γ, K⊙Γ, e^{G_last - G}, K⊙Dec   [C,K]
  std::vector<F> Gaml;               // Γ_last [K]
  std::vector<F> Aqk, Pkk, M;        // [C,C], ld = C
  std::vector<F> X, BB, Y, E;        // see above; E [C,V]
  std::vector<F> Xa, Xb, Xo, ea, eb;  // tile factors: [2·16,K], [C,K], [2·16,C], e^{G-a} [16,K], e^{a-G} [C,K]
  std::vector<F> pe;                  // exact path: one pair's e^{G_i - G_j} [K]
  int64_t c = 0;                      // rows of the chunk now loaded
  Work(int64_t K_, int64_t V_) : K(K_), V(V_), ldx(K_ + V_) {
    for (auto* b : {&q, &k, &Gam, &Kg, &Dec, &Kd, &Xb, &eb}) b->assign(kC * K, F(0));
    G.assign(kC * K, 0.0);
    for (auto* b : {&v, &E}) b->assign(kC * V, F(0));
    for (auto* b : {&Aqk, &Pkk, &M}) b->assign(kC * kC, F(0));
    X.assign(2 * kC * ldx, F(0));
    BB.assign(kC * ldx, F(0));
    Y.assign(2 * kC * V, F(0));
    beta.assign(kC, F(0));
    Gl.assign(K, 0.0);
    Gaml.assign(K, F(0));
    Xa.assign(2 * kTile * K, F(0));
    Xo.assign(2 * kTile * kC, F(0));
    ea.assign(kTile * K, F(0));
    pe.assign(K, F(0));
  }
  // Views into the merged buffers (row stride ldx).
  F* U() { return X.data(); }
  F* W() { return X.data() + V; }
  F* Qg() { return X.data() + c * ldx + V; }
  F* B1() { return BB.data(); }
  F* B2() { return BB.data() + V; }
};

// Pointers to one (sequence, head) in the [rows, H, *] layouts.
template <class F>
struct SeqHead {
  const F *q, *k, *v, *g, *beta;
  int64_t row0, len, H, h;
  int64_t qk_off(int64_t t) const { return ((row0 + t) * H + h); }
};

// Loads rows [t0, t0 + c) and the chunk-level decay factors.
template <class F>
void load_chunk(Work<F>& w, const SeqHead<F>& s, int64_t t0, int64_t c) {
  const int64_t K = w.K, V = w.V;
  for (int64_t i = 0; i < c; ++i) {
    const int64_t r = s.qk_off(t0 + i);
    std::copy_n(s.q + r * K, K, &w.q[i * K]);
    std::copy_n(s.k + r * K, K, &w.k[i * K]);
    std::copy_n(s.v + r * V, V, &w.v[i * V]);
    const F* g = s.g + r * K;
    double* G = &w.G[i * K];
    const double* Gp = i ? &w.G[(i - 1) * K] : nullptr;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) G[d] = (Gp ? Gp[d] : 0.0) + static_cast<double>(g[d]);
    w.beta[i] = s.beta[r];
  }
  std::copy_n(&w.G[(c - 1) * K], K, w.Gl.data());
  for (int64_t d = 0; d < K; ++d) w.Gaml[d] = fexp_d<F>(w.Gl[d]);
  w.c = c;
  for (int64_t i = 0; i < c; ++i) {
    const double *G = &w.G[i * K], *Gl = w.Gl.data();
    const F *q = &w.q[i * K], *k = &w.k[i * K];
    F *Gam = &w.Gam[i * K], *Qg = w.Qg() + i * w.ldx, *Kg = &w.Kg[i * K], *Dec = &w.Dec[i * K], *Kd = &w.Kd[i * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      Gam[d] = fexp_d<F>(G[d]);
      Dec[d] = fexp_d<F>(Gl[d] - G[d]);
      Qg[d] = q[d] * Gam[d];
      Kg[d] = k[d] * Gam[d];
      Kd[d] = k[d] * Dec[d];
    }
  }
}

// Builds the anchored tile factors of row tile [i0, i1) over columns [0, cols):
//   Xa = [q_i e^{G_i - a} ; k_i e^{G_i - a}]  (2·nr rows, stride K),  Xb = k_j e^{a - G_j}  (cols rows).
template <class F, bool kBounded>
void tile_factors(Work<F>& w, int64_t i0, int64_t i1, int64_t cols, const double* a) {
  // Exact path: a = G_{i0}, both exponents are <= 0. Bounded: see fexp_split.
  auto ex = [](double x) { return kBounded ? fexp_split<F>(x) : fexp_d<F>(x); };
  const int64_t K = w.K, nr = i1 - i0;
  for (int64_t i = 0; i < nr; ++i) {
    const double* G = &w.G[(i0 + i) * K];
    const F *q = &w.q[(i0 + i) * K], *k = &w.k[(i0 + i) * K];
    F *ea = &w.ea[i * K], *xq = &w.Xa[i * K], *xk = &w.Xa[(nr + i) * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      ea[d] = ex(G[d] - a[d]);
      xq[d] = q[d] * ea[d];
      xk[d] = k[d] * ea[d];
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    const double* G = &w.G[j * K];
    const F* k = &w.k[j * K];
    F *eb = &w.eb[j * K], *xb = &w.Xb[j * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      eb[d] = ex(a[d] - G[d]);
      xb[d] = k[d] * eb[d];
    }
  }
}

// Anchor of row tile i0: the causal, bounded one or the first row (past tiles of the exact path).
template <class F>
void tile_anchor(const Work<F>& w, int64_t i0, bool bounded, F lb, std::vector<double>& a) {
  const double off = bounded ? 7.5 * static_cast<double>(lb) : 0.0;
  for (int64_t d = 0; d < w.K; ++d) a[d] = w.G[i0 * w.K + d] + off;
}

// A_qk (scale included, j <= i) and P_kk (j < i) of a chunk; entries outside the masks are zero.
template <class F>
void intra_chunk_A(Work<F>& w, int64_t c, bool bounded, F lb, F scale) {
  const int64_t K = w.K;
  std::fill(w.Aqk.begin(), w.Aqk.end(), F(0));
  std::fill(w.Pkk.begin(), w.Pkk.end(), F(0));
  std::vector<double> a(K);
  for (int64_t i0 = 0; i0 < c; i0 += kTile) {
    const int64_t i1 = std::min(i0 + kTile, c), nr = i1 - i0;
    const int64_t cols = bounded ? i1 : i0;  // exact: GEMM only over past tiles
    if (cols > 0) {
      tile_anchor(w, i0, bounded, lb, a);
      if (bounded) tile_factors<F, true>(w, i0, i1, cols, a.data());
      else tile_factors<F, false>(w, i0, i1, cols, a.data());
      ops::gemm(false, true, 2 * nr, cols, K, F(1), w.Xa.data(), K, w.Xb.data(), K, F(0), w.Xo.data(), kC);
      for (int64_t i = i0; i < i1; ++i) {
        const F *xq = &w.Xo[(i - i0) * kC], *xk = &w.Xo[(nr + i - i0) * kC];
        F *aq = &w.Aqk[i * kC], *pk = &w.Pkk[i * kC];
        const int64_t jq = std::min(cols, i + 1), jk = std::min(cols, i);
        for (int64_t j = 0; j < jq; ++j) aq[j] = scale * xq[j];
        for (int64_t j = 0; j < jk; ++j) pk[j] = xk[j];
      }
    }
    if (!bounded) {
      // Diagonal tile pair by pair: e^{G_i - G_j} <= 1 for j <= i, for any gate.
      for (int64_t i = i0; i < i1; ++i) {
        const double* Gi = &w.G[i * K];
        const F *qi = &w.q[i * K], *ki = &w.k[i * K];
        for (int64_t j = i0; j <= i; ++j) {
          const double* Gj = &w.G[j * K];
          const F* kj = &w.k[j * K];
          F* pe = w.pe.data();
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) pe[d] = fexp_d<F>(Gi[d] - Gj[d]) * kj[d];
          F sq = 0, sk = 0;
#pragma omp simd reduction(+ : sq, sk)
          for (int64_t d = 0; d < K; ++d) {
            sq += qi[d] * pe[d];
            sk += ki[d] * pe[d];
          }
          w.Aqk[i * kC + j] = scale * sq;
          if (j < i) w.Pkk[i * kC + j] = sk;
        }
      }
    }
  }
}

// M = (I + Diag(β) P_kk)^-1 by forward substitution (unit lower triangular), row by row; this is
// the same arithmetic as substituting per 16x16 diagonal block and then across blocks.
template <class F>
void invert_unit_lower(Work<F>& w, int64_t c) {
  F* M = w.M.data();
  std::fill(w.M.begin(), w.M.end(), F(0));
  for (int64_t i = 0; i < c; ++i) {
    const F* L = &w.Pkk[i * kC];
    const F b = w.beta[i];
    F* Mi = &M[i * kC];
    // M[i, :i] = -Σ_{m<i} βL[i,m] M[m, :i]  (M[m, j] = 0 for j > m)
    for (int64_t m = 0; m < i; ++m) {
      const F l = b * L[m];
      if (l == F(0)) continue;
      const F* Mm = &M[m * kC];
#pragma omp simd
      for (int64_t j = 0; j <= m; ++j) Mi[j] -= l * Mm[j];
    }
    Mi[i] = F(1);
  }
}

// U, W (one GEMM: M [βV | βK⊙Γ]), then [W S0 ; Q⊙Γ S0] (one GEMM) and E = U - W S0.
template <class F>
void solve_chunk(Work<F>& w, int64_t c, const F* S0) {
  const int64_t K = w.K, V = w.V, ld = w.ldx;
  for (int64_t i = 0; i < c; ++i) {
    const F b = w.beta[i];
    F *b1 = w.B1() + i * ld, *b2 = w.B2() + i * ld;
    const F *vi = &w.v[i * V], *kg = &w.Kg[i * K];
    for (int64_t e = 0; e < V; ++e) b1[e] = b * vi[e];
    for (int64_t d = 0; d < K; ++d) b2[d] = b * kg[d];
  }
  ops::gemm(false, false, c, ld, c, F(1), w.M.data(), kC, w.BB.data(), ld, F(0), w.X.data(), ld);
  ops::gemm(false, false, 2 * c, V, K, F(1), w.W(), ld, S0, V, F(0), w.Y.data(), V);
  for (int64_t i = 0; i < c; ++i) {
    const F *u = w.U() + i * ld, *ws = &w.Y[i * V];
    F* e = &w.E[i * V];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) e[j] = u[j] - ws[j];
  }
}

// S <- Diag(Γ_last) S + Kdᵀ E
template <class F>
void advance_state(Work<F>& w, int64_t c, F* S) {
  const int64_t K = w.K, V = w.V;
  for (int64_t d = 0; d < K; ++d) {
    const F gl = w.Gaml[d];
#pragma omp simd
    for (int64_t e = 0; e < V; ++e) S[d * V + e] *= gl;
  }
  ops::gemm(true, false, K, V, c, F(1), w.Kd.data(), K, w.E.data(), V, F(1), S, V);
}

template <class F>
SeqHead<F> seq_head(const CoreInputs<F>& in, const Dims& d, int64_t n, int64_t h) {
  return SeqHead<F>{in.q, in.k, in.v, in.g, in.beta, d.seq_begin(n), d.seq_len(n), d.H, h};
}

// First chunk-state slot of sequence n (slots are [(base + chunk) * H + h]).
int64_t chunk_base(const Dims& d, int64_t n) {
  if (!d.cu_seqlens) return n * ((d.T + kC - 1) / kC);
  int64_t b = 0;
  for (int64_t m = 0; m < n; ++m) b += (d.seq_len(m) + kC - 1) / kC;
  return b;
}

template <class F>
void forward_one(const CoreInputs<F>& in, const Dims& d, int64_t n, int64_t h, F* o, F* ht, bool bounded, F lb,
                 F* states) {
  const int64_t K = d.K, V = d.V;
  Work<F> w(K, V);
  std::vector<F> S(K * V, F(0));
  if (in.h0) std::copy_n(in.h0 + (n * d.H + h) * K * V, K * V, S.data());
  const SeqHead<F> s = seq_head(in, d, n, h);
  const int64_t base = states ? chunk_base(d, n) : 0;
  for (int64_t t0 = 0; t0 < s.len; t0 += kC) {
    const int64_t c = std::min(kC, s.len - t0);
    if (states) std::copy_n(S.data(), K * V, states + ((base + t0 / kC) * d.H + h) * K * V);
    load_chunk(w, s, t0, c);
    intra_chunk_A(w, c, bounded, lb, in.scale);
    invert_unit_lower(w, c);
    solve_chunk(w, c, S.data());
    // O = scale (Q⊙Γ) S0 + A_qk E, written straight into o's [rows, H, V] layout.
    F* out = o + s.qk_off(t0) * V;
    const int64_t ldo = d.H * V;
    for (int64_t i = 0; i < c; ++i) {
      const F* qs = &w.Y[(c + i) * V];
      F* oi = out + i * ldo;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) oi[j] = in.scale * qs[j];
    }
    ops::gemm(false, false, c, V, c, F(1), w.Aqk.data(), kC, w.E.data(), V, F(1), out, ldo);
    advance_state(w, c, S.data());
  }
  if (ht) std::copy_n(S.data(), K * V, ht + (n * d.H + h) * K * V);
}

// Gradient of the pairwise products of row tile [i0, i1) over columns [0, cols) through the anchored
// factors (the anchor's own gradient sums to zero: the products do not depend on it).
template <class F>
void tile_backward_gemm(Work<F>& w, int64_t i0, int64_t i1, int64_t cols, const F* dPqk, const F* dPkk, F* dq, F* dk,
                        F* dG, std::vector<F>& dXo, std::vector<F>& dXa, std::vector<F>& dXb) {
  const int64_t K = w.K, nr = i1 - i0;
  for (int64_t i = 0; i < nr; ++i) {
    std::copy_n(&dPqk[(i0 + i) * kC], cols, &dXo[i * kC]);
    std::copy_n(&dPkk[(i0 + i) * kC], cols, &dXo[(nr + i) * kC]);
  }
  ops::gemm(false, false, 2 * nr, K, cols, F(1), dXo.data(), kC, w.Xb.data(), K, F(0), dXa.data(), K);
  ops::gemm(true, false, cols, K, 2 * nr, F(1), dXo.data(), kC, w.Xa.data(), K, F(0), dXb.data(), K);
  for (int64_t i = 0; i < nr; ++i) {
    const F *ea = &w.ea[i * K], *gq = &dXa[i * K], *gk = &dXa[(nr + i) * K];
    const F *xq = &w.Xa[i * K], *xk = &w.Xa[(nr + i) * K];
    F *dqi = &dq[(i0 + i) * K], *dki = &dk[(i0 + i) * K], *dGi = &dG[(i0 + i) * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      dqi[d] += gq[d] * ea[d];
      dki[d] += gk[d] * ea[d];
      dGi[d] += gq[d] * xq[d] + gk[d] * xk[d];
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    const F *eb = &w.eb[j * K], *gb = &dXb[j * K], *xb = &w.Xb[j * K];
    F *dkj = &dk[j * K], *dGj = &dG[j * K];
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      dkj[d] += gb[d] * eb[d];
      dGj[d] -= gb[d] * xb[d];
    }
  }
}

template <class F>
void backward_one(const CoreInputs<F>& in, const Dims& d, int64_t n, int64_t h, const F* do_, const F* dht,
                  const CoreGrads<F>& gr, bool bounded, F lb, const F* states) {
  const int64_t K = d.K, V = d.V, H = d.H;
  const SeqHead<F> s = seq_head(in, d, n, h);
  const int64_t nchunks = (s.len + kC - 1) / kC;
  Work<F> w(K, V);
  // Pass 1: the state at the start of every chunk, from forward's copy or recomputed.
  std::vector<F> S0s(static_cast<size_t>(std::max<int64_t>(nchunks, 1)) * K * V, F(0));
  if (states) {
    const int64_t base = chunk_base(d, n);
    for (int64_t ci = 0; ci < nchunks; ++ci)
      std::copy_n(states + ((base + ci) * H + h) * K * V, K * V, &S0s[ci * K * V]);
  } else {
    std::vector<F> S(K * V, F(0));
    if (in.h0) std::copy_n(in.h0 + (n * H + h) * K * V, K * V, S.data());
    for (int64_t ci = 0; ci < nchunks; ++ci) {
      const int64_t t0 = ci * kC, c = std::min(kC, s.len - t0);
      std::copy_n(S.data(), K * V, &S0s[ci * K * V]);
      if (ci == nchunks - 1) break;  // the last chunk's end state is not needed
      load_chunk(w, s, t0, c);
      intra_chunk_A(w, c, bounded, lb, in.scale);
      invert_unit_lower(w, c);
      solve_chunk(w, c, S.data());
      advance_state(w, c, S.data());
    }
  }
  // Pass 2: chunks in reverse with dS = dL/dS at the chunk's end.
  std::vector<F> dS(K * V, F(0)), dS0(K * V);
  if (dht) std::copy_n(dht + (n * H + h) * K * V, K * V, dS.data());
  // dEW [C, V+K] = [dE | dW] and dBB = Mᵀ dEW = [d(βV) | d(βK⊙Γ)], side by side like X and BB.
  const int64_t ld = w.ldx;
  std::vector<F> dO(kC * V), dEW(kC * ld), dBB(kC * ld), dAqk(kC * kC), dM(kC * kC), tmp(kC * kC);
  std::vector<F> dQg(kC * K), dKd(kC * K), dq(kC * K), dk(kC * K), dG(kC * K);
  F *dE = dEW.data(), *dW = dEW.data() + V;
  const F *dB1 = dBB.data(), *dB2 = dBB.data() + V;
  std::vector<F> dPkk(kC * kC), dXo(2 * kTile * kC), dXa(2 * kTile * K), dXb(kC * K), dGl(K);
  std::vector<double> a(K);
  const F scale = in.scale;
  for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const int64_t t0 = ci * kC, c = std::min(kC, s.len - t0);
    const F* S0 = &S0s[ci * K * V];
    load_chunk(w, s, t0, c);
    intra_chunk_A(w, c, bounded, lb, scale);
    invert_unit_lower(w, c);
    solve_chunk(w, c, S0);
    for (int64_t i = 0; i < c; ++i) std::copy_n(do_ + s.qk_off(t0 + i) * V, V, &dO[i * V]);

    // dE = A_qkᵀ dO + Kd dS ;  dA_qk = tril(dO Eᵀ)
    ops::gemm(true, false, c, V, c, F(1), w.Aqk.data(), kC, dO.data(), V, F(0), dE, ld);
    ops::gemm(false, false, c, V, K, F(1), w.Kd.data(), K, dS.data(), V, F(1), dE, ld);
    ops::gemm(false, true, c, c, V, F(1), dO.data(), V, w.E.data(), V, F(0), dAqk.data(), kC);
    // dQg = scale dO S0ᵀ ;  dKd = E dSᵀ ;  dW = -dE S0ᵀ
    ops::gemm(false, true, c, K, V, scale, dO.data(), V, S0, V, F(0), dQg.data(), K);
    ops::gemm(false, true, c, K, V, F(1), w.E.data(), V, dS.data(), V, F(0), dKd.data(), K);
    ops::gemm(false, true, c, K, V, F(-1), dE, ld, S0, V, F(0), dW, ld);
    // dS0 = scale Qgᵀ dO + Diag(Γ_last) dS - Wᵀ dE
    for (int64_t dd = 0; dd < K; ++dd) {
      F acc = 0;
      for (int64_t e = 0; e < V; ++e) {
        acc += S0[dd * V + e] * dS[dd * V + e];
        dS0[dd * V + e] = w.Gaml[dd] * dS[dd * V + e];
      }
      dGl[dd] = acc * w.Gaml[dd];  // d/dG_last of Diag(Γ_last) S0
    }
    ops::gemm(true, false, K, V, c, scale, w.Qg(), ld, dO.data(), V, F(1), dS0.data(), V);
    ops::gemm(true, false, K, V, c, F(-1), w.W(), ld, dE, ld, F(1), dS0.data(), V);
    // [U | W] = M [B1 | B2] (dU = dE):  dM = [dE | dW] [B1 | B2]ᵀ,  [dB1 | dB2] = Mᵀ [dE | dW]
    ops::gemm(false, true, c, c, ld, F(1), dEW.data(), ld, w.BB.data(), ld, F(0), dM.data(), kC);
    ops::gemm(true, false, c, ld, c, F(1), w.M.data(), kC, dEW.data(), ld, F(0), dBB.data(), ld);
    // M = L^-1:  dL = -Mᵀ dM Mᵀ, of which the strictly lower part is dA_kk.
    ops::gemm(true, false, c, c, c, F(1), w.M.data(), kC, dM.data(), kC, F(0), tmp.data(), kC);
    ops::gemm(false, true, c, c, c, F(-1), tmp.data(), kC, w.M.data(), kC, F(0), dM.data(), kC);

    std::fill(dq.begin(), dq.end(), F(0));
    std::fill(dk.begin(), dk.end(), F(0));
    std::fill(dG.begin(), dG.end(), F(0));
    std::fill(dPkk.begin(), dPkk.end(), F(0));
    F* dbeta_out = gr.dbeta;
    for (int64_t i = 0; i < c; ++i) {
      const F b = w.beta[i];
      F db = 0;
      for (int64_t e = 0; e < V; ++e) db += w.v[i * V + e] * dB1[i * ld + e];
      for (int64_t dd = 0; dd < K; ++dd) db += w.Kg[i * K + dd] * dB2[i * ld + dd];
      for (int64_t j = 0; j < i; ++j) {
        const F dA = dM[i * kC + j];  // dA_kk[i, j]
        db += dA * w.Pkk[i * kC + j];
        dPkk[i * kC + j] = b * dA;
      }
      for (int64_t j = 0; j < kC; ++j) dAqk[i * kC + j] = j <= i ? scale * dAqk[i * kC + j] : F(0);  // dP_qk
      dbeta_out[s.qk_off(t0 + i)] = db;
      F* dv = gr.dv + s.qk_off(t0 + i) * V;
      for (int64_t e = 0; e < V; ++e) dv[e] = b * dB1[i * ld + e];
      // Γ-weighted factors: Qg = q⊙Γ, Kg = k⊙Γ (dKg = β dB2), Kd = k⊙e^{G_last-G}.
      const F *Gam = &w.Gam[i * K], *Dec = &w.Dec[i * K], *Qg = w.Qg() + i * ld, *Kg = &w.Kg[i * K], *Kd = &w.Kd[i * K];
      const F *gQg = &dQg[i * K], *gB2 = dB2 + i * ld, *gKd = &dKd[i * K];
      F *dqi = &dq[i * K], *dki = &dk[i * K], *dGi = &dG[i * K], *dGlp = dGl.data();
#pragma omp simd
      for (int64_t dd = 0; dd < K; ++dd) {
        const F gKg = b * gB2[dd];
        dqi[dd] += gQg[dd] * Gam[dd];
        dki[dd] += gKg * Gam[dd] + gKd[dd] * Dec[dd];
        dGi[dd] += gQg[dd] * Qg[dd] + gKg * Kg[dd] - gKd[dd] * Kd[dd];
        dGlp[dd] += gKd[dd] * Kd[dd];
      }
    }
    // Pairwise products A_qk (dP_qk in dAqk) and P_kk (dP_kk), tile by tile as in forward.
    for (int64_t i0 = 0; i0 < c; i0 += kTile) {
      const int64_t i1 = std::min(i0 + kTile, c);
      const int64_t cols = bounded ? i1 : i0;
      if (cols > 0) {
        tile_anchor(w, i0, bounded, lb, a);
        if (bounded) tile_factors<F, true>(w, i0, i1, cols, a.data());
        else tile_factors<F, false>(w, i0, i1, cols, a.data());
        tile_backward_gemm(w, i0, i1, cols, dAqk.data(), dPkk.data(), dq.data(), dk.data(), dG.data(), dXo, dXa, dXb);
      }
      if (!bounded) {
        for (int64_t i = i0; i < i1; ++i) {
          const double* Gi = &w.G[i * K];
          const F *qi = &w.q[i * K], *ki = &w.k[i * K];
          F *dqi = &dq[i * K], *dki = &dk[i * K], *dGi = &dG[i * K];
          for (int64_t j = i0; j <= i; ++j) {
            const F tq = dAqk[i * kC + j], tk = dPkk[i * kC + j];
            const double* Gj = &w.G[j * K];
            const F* kj = &w.k[j * K];
            F *dkj = &dk[j * K], *dGj = &dG[j * K];
#pragma omp simd
            for (int64_t dd = 0; dd < K; ++dd) {
              const F e = fexp_d<F>(Gi[dd] - Gj[dd]);
              const F side_i = (tq * qi[dd] + tk * ki[dd]) * e;  // pairs with k_j
              const F x = side_i * kj[dd];
              dqi[dd] += tq * kj[dd] * e;
              dki[dd] += tk * kj[dd] * e;
              dkj[dd] += side_i;
              dGi[dd] += x;
              dGj[dd] -= x;
            }
          }
        }
      }
    }
    // G_last's gradient joins the last row; g is the reverse cumulative sum of dG in the chunk.
    for (int64_t dd = 0; dd < K; ++dd) dG[(c - 1) * K + dd] += dGl[dd];
    for (int64_t i = c - 2; i >= 0; --i)
      for (int64_t dd = 0; dd < K; ++dd) dG[i * K + dd] += dG[(i + 1) * K + dd];
    for (int64_t i = 0; i < c; ++i) {
      const int64_t r = s.qk_off(t0 + i);
      std::copy_n(&dq[i * K], K, gr.dq + r * K);
      std::copy_n(&dk[i * K], K, gr.dk + r * K);
      std::copy_n(&dG[i * K], K, gr.dg + r * K);
    }
    std::swap(dS, dS0);
  }
  if (gr.dh0) std::copy_n(dS.data(), K * V, gr.dh0 + (n * H + h) * K * V);
}

}  // namespace

int64_t chunk_state_count(const Dims& d) {
  check_dims(d);
  return chunk_base(d, d.num_seqs()) * d.H;
}

template <class F>
void chunk_forward(const CoreInputs<F>& in, const Dims& d, F* o, F* ht, DiagPath path, GateParams gate,
                   F* chunk_states) {
  check_dims(d);
  const bool bounded = resolve_diag_path(path, gate) == DiagPath::Bounded;
  const F lb = static_cast<F>(gate.lower_bound);
  const int64_t N = d.num_seqs();
  parallel_for_dynamic(N * d.H, [&](int64_t i) { forward_one(in, d, i / d.H, i % d.H, o, ht, bounded, lb, chunk_states); });
}

template <class F>
void chunk_backward(const CoreInputs<F>& in, const Dims& d, const F* do_, const F* dht, const CoreGrads<F>& gr,
                    DiagPath path, GateParams gate, const F* chunk_states) {
  check_dims(d);
  LM_CHECK(gr.dq && gr.dk && gr.dv && gr.dg && gr.dbeta, "chunk_backward: dq, dk, dv, dg and dbeta are required");
  const bool bounded = resolve_diag_path(path, gate) == DiagPath::Bounded;
  const F lb = static_cast<F>(gate.lower_bound);
  const int64_t N = d.num_seqs();
  parallel_for_dynamic(N * d.H,
                       [&](int64_t i) { backward_one(in, d, i / d.H, i % d.H, do_, dht, gr, bounded, lb, chunk_states); });
}

template void chunk_forward<float>(const CoreInputs<float>&, const Dims&, float*, float*, DiagPath, GateParams,
                                   float*);
template void chunk_forward<double>(const CoreInputs<double>&, const Dims&, double*, double*, DiagPath, GateParams,
                                    double*);
template void chunk_backward<float>(const CoreInputs<float>&, const Dims&, const float*, const float*,
                                    const CoreGrads<float>&, DiagPath, GateParams, const float*);
template void chunk_backward<double>(const CoreInputs<double>&, const Dims&, const double*, const double*,
                                     const CoreGrads<double>&, DiagPath, GateParams, const double*);

}  // namespace lm::kda

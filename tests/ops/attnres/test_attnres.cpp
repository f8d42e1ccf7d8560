// Block AttnRes read: a naive per-token reference, float64 finite differences of dv, dw, dgamma,
// the two-phase decode form vs the one-shot read, float vs double, invariances.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/attnres/attnres.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

using Sources = std::vector<std::vector<double>>;

template <class F>
std::vector<const F*> ptrs(const std::vector<std::vector<F>>& v) {
  std::vector<const F*> p;
  for (const auto& x : v) p.push_back(x.data());
  return p;
}
template <class F>
std::vector<F*> mptrs(std::vector<std::vector<F>>& v) {
  std::vector<F*> p;
  for (auto& x : v) p.push_back(x.data());
  return p;
}

Sources make_sources(int64_t N, int64_t T, int64_t d, uint64_t seed) {
  Sources v;
  for (int64_t j = 0; j < N; ++j) v.push_back(randn(T * d, seed + j, 0.5 + 0.4 * j));  // varied scales
  return v;
}

// SPEC §6 written out per token, no shared code with the op.
std::vector<double> naive_read(const Sources& v, int64_t T, int64_t d, const std::vector<double>& w,
                               const std::vector<double>& gamma, double eps) {
  const auto N = static_cast<int64_t>(v.size());
  std::vector<double> h(T * d, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> z(N);
    double mx = -1e300;
    for (int64_t j = 0; j < N; ++j) {
      double ss = 0, s = 0;
      for (int64_t c = 0; c < d; ++c) ss += v[j][t * d + c] * v[j][t * d + c];
      const double r = std::sqrt(ss / d + eps);
      for (int64_t c = 0; c < d; ++c) s += gamma[c] * w[c] * v[j][t * d + c] / r;
      z[j] = s;
      mx = std::max(mx, s);
    }
    double den = 0;
    for (auto& zj : z) den += (zj = std::exp(zj - mx));
    for (int64_t j = 0; j < N; ++j)
      for (int64_t c = 0; c < d; ++c) h[t * d + c] += z[j] / den * v[j][t * d + c];
  }
  return h;
}

}  // namespace

TEST(AttnRes, ForwardMatchesNaive) {
  const int64_t N = 5, T = 37, d = 24;
  const double eps = 1e-5;
  const auto v = make_sources(N, T, d, 100);
  const auto w = randn(d, 1, 0.3), gamma = randn(d, 2, 1.0);
  std::vector<double> h(T * d), probs(T * N);
  attnres_forward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), eps, h.data(), probs.data());
  const double err = rel_rms_vec(naive_read(v, T, d, w, gamma, eps), h);
  EXPECT_LT(err, 1e-14);
  for (int64_t t = 0; t < T; ++t) {
    double s = 0;
    for (int64_t j = 0; j < N; ++j) s += probs[t * N + j];
    EXPECT_NEAR(s, 1.0, 1e-14);
  }
}

TEST(AttnRes, ZeroQueryIsTheMeanAndScoresAreScaleInvariant) {
  // Zero-init pseudo-query (from-scratch training): uniform weights, h = mean of the sources.
  const int64_t N = 3, T = 4, d = 8;
  auto v = make_sources(N, T, d, 200);
  const std::vector<double> zero(d, 0.0), gamma(d, 1.0);
  std::vector<double> h(T * d);
  attnres_forward(ptrs(v).data(), N, T, d, zero.data(), gamma.data(), 1e-5, h.data());
  for (int64_t i = 0; i < T * d; ++i) EXPECT_NEAR(h[i], (v[0][i] + v[1][i] + v[2][i]) / 3, 1e-15);
  // The score reads v / rms(v): scaling one source by 1e3 leaves the probabilities unchanged (eps = 0).
  const auto w = randn(d, 3);
  std::vector<double> p1(T * N), p2(T * N);
  attnres_forward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), 0.0, h.data(), p1.data());
  for (auto& x : v[1]) x *= 1e3;
  attnres_forward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), 0.0, h.data(), p2.data());
  EXPECT_LT(rel_rms_vec(p1, p2), 1e-13);
}

TEST(AttnRes, BackwardMatchesFiniteDifferences) {
  for (const int64_t N : {1, 2, 6}) {
    const int64_t T = 40, d = 16;  // T > 16: several reduction blocks
    const double eps = 1e-5;
    auto v = make_sources(N, T, d, 300);
    auto w = randn(d, 4, 0.5), gamma = randn(d, 5, 1.0);
    const auto G = randn(T * d, 6);
    std::vector<double> h(T * d);
    auto loss = [&] {
      attnres_forward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), eps, h.data());
      return lm::testing::dot(h, G);
    };
    // Accumulation: start the gradients from known values and subtract them afterwards.
    Sources dv(N, std::vector<double>(T * d, 0.25));
    std::vector<double> dw(d, -1.0), dgamma(d, 2.0);
    attnres_backward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), eps, G.data(), mptrs(dv).data(), dw.data(),
                     dgamma.data());
    for (auto& x : dv)
      for (auto& y : x) y -= 0.25;
    for (auto& y : dw) y += 1.0;
    for (auto& y : dgamma) y -= 2.0;
    double worst = 0;
    for (int64_t j = 0; j < N; ++j) {
      const double e = fd_check(v[j], dv[j], loss, 40);
      EXPECT_LT(e, 1e-7) << "dv[" << j << "] N=" << N;
      worst = std::max(worst, e);
    }
    const double ew = fd_check(w, dw, loss, d), eg = fd_check(gamma, dgamma, loss, d);
    EXPECT_LT(ew, 1e-7) << "N=" << N;
    EXPECT_LT(eg, 1e-7) << "N=" << N;
    std::printf("attnres N=%ld fd err: dv %.2e dw %.2e dgamma %.2e\n", long(N), worst, ew, eg);
  }
}

TEST(AttnRes, NullGradientsAreSkipped) {
  const int64_t N = 3, T = 5, d = 8;
  const auto v = make_sources(N, T, d, 400);
  const auto w = randn(d, 7), gamma = randn(d, 8), G = randn(T * d, 9);
  Sources dv_all(N, std::vector<double>(T * d, 0.0));
  std::vector<double> dv1(T * d, 0.0);
  attnres_backward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), 1e-5, G.data(), mptrs(dv_all).data(),
                   static_cast<double*>(nullptr), static_cast<double*>(nullptr));
  std::vector<double*> only1{nullptr, dv1.data(), nullptr};
  attnres_backward(ptrs(v).data(), N, T, d, w.data(), gamma.data(), 1e-5, G.data(), only1.data(),
                   static_cast<double*>(nullptr), static_cast<double*>(nullptr));
  EXPECT_EQ(dv1, dv_all[1]);
}

TEST(AttnRes, TwoPhaseEqualsOneShot) {
  // Q reads of one block share N closed sources; each then merges M partial sources.
  const int64_t T = 23, d = 32, Q = 3;
  const double eps = 1e-5;
  for (const auto& [N, M] : {std::pair<int64_t, int64_t>{4, 1}, {4, 2}, {1, 1}, {0, 1}, {0, 3}}) {
    const auto closed = make_sources(N, T, d, 500);
    const auto partial = make_sources(M, T, d, 600);
    const auto wq = randn(Q * d, 10, 0.8), gq = randn(Q * d, 11, 1.0);
    std::vector<double> m(Q * T), l(Q * T), acc(Q * T * d);
    attnres_phase1(ptrs(closed).data(), N, T, d, wq.data(), gq.data(), Q, eps, m.data(), l.data(), acc.data());
    Sources all = closed;
    for (const auto& x : partial) all.push_back(x);
    for (int64_t i = 0; i < Q; ++i) {
      std::vector<double> h2(T * d), h1(T * d);
      attnres_phase2(m.data() + i * T, l.data() + i * T, acc.data() + i * T * d, ptrs(partial).data(), M, T, d,
                     wq.data() + i * d, gq.data() + i * d, eps, h2.data());
      attnres_forward(ptrs(all).data(), N + M, T, d, wq.data() + i * d, gq.data() + i * d, eps, h1.data());
      const double err = rel_rms_vec(h1, h2);
      EXPECT_LT(err, 1e-14) << "N=" << N << " M=" << M << " read " << i;
    }
  }
}

TEST(AttnRes, FloatMatchesDouble) {
  const int64_t N = 9, T = 64, d = 128;  // K3-like: embedding + 8 blocks
  const double eps = 1e-5;
  const auto vd = make_sources(N, T, d, 700);
  std::vector<std::vector<float>> vf;
  for (const auto& x : vd) vf.emplace_back(x.begin(), x.end());
  const auto wd = randn(d, 12, 0.3), gd = randn(d, 13, 1.0), Gd = randn(T * d, 14);
  const std::vector<float> wf(wd.begin(), wd.end()), gf(gd.begin(), gd.end()), Gf(Gd.begin(), Gd.end());
  std::vector<double> hd(T * d);
  std::vector<float> hf(T * d);
  attnres_forward(ptrs(vd).data(), N, T, d, wd.data(), gd.data(), eps, hd.data());
  attnres_forward(ptrs(vf).data(), N, T, d, wf.data(), gf.data(), float(eps), hf.data());
  const double eh = rel_rms_vec(hd, std::vector<double>(hf.begin(), hf.end()));
  EXPECT_LT(eh, 1e-6);
  Sources dvd(N, std::vector<double>(T * d, 0.0));
  std::vector<std::vector<float>> dvf(N, std::vector<float>(T * d, 0.0f));
  std::vector<double> dwd(d, 0.0), dgd(d, 0.0);
  std::vector<float> dwf(d, 0.0f), dgf(d, 0.0f);
  attnres_backward(ptrs(vd).data(), N, T, d, wd.data(), gd.data(), eps, Gd.data(), mptrs(dvd).data(), dwd.data(),
                   dgd.data());
  attnres_backward(ptrs(vf).data(), N, T, d, wf.data(), gf.data(), float(eps), Gf.data(), mptrs(dvf).data(), dwf.data(),
                   dgf.data());
  double edv = 0;
  for (int64_t j = 0; j < N; ++j)
    edv = std::max(edv, rel_rms_vec(dvd[j], std::vector<double>(dvf[j].begin(), dvf[j].end())));
  const double ew = rel_rms_vec(dwd, std::vector<double>(dwf.begin(), dwf.end()));
  const double eg = rel_rms_vec(dgd, std::vector<double>(dgf.begin(), dgf.end()));
  EXPECT_LT(edv, 1e-5);
  EXPECT_LT(ew, 1e-5);
  EXPECT_LT(eg, 1e-5);
  std::printf("attnres f32 vs f64: h %.2e dv %.2e dw %.2e dgamma %.2e\n", eh, edv, ew, eg);
}

TEST(AttnRes, BackwardIsThreadCountIndependent) {
  const int64_t N = 4, T = 300, d = 64;
  std::vector<std::vector<float>> v;
  for (int64_t j = 0; j < N; ++j) v.push_back(randn<float>(T * d, 800 + j));
  const auto w = randn<float>(d, 15), g = randn<float>(d, 16), G = randn<float>(T * d, 17);
  std::vector<float> dw1(d, 0.0f), dw2(d, 0.0f), dg1(d, 0.0f), dg2(d, 0.0f);
  std::vector<std::vector<float>> dv(N, std::vector<float>(T * d, 0.0f));
  const int saved = num_threads();
  set_num_threads(1);
  attnres_backward(ptrs(v).data(), N, T, d, w.data(), g.data(), 1e-5f, G.data(), mptrs(dv).data(), dw1.data(),
                   dg1.data());
  set_num_threads(2);
  attnres_backward(ptrs(v).data(), N, T, d, w.data(), g.data(), 1e-5f, G.data(), mptrs(dv).data(), dw2.data(),
                   dg2.data());
  set_num_threads(saved);
  EXPECT_EQ(dw1, dw2);
  EXPECT_EQ(dg1, dg2);
}

TEST(AttnRes, RejectsBadArguments) {
  std::vector<double> x(8), w(4), g(4), h(8);
  const double* src[2] = {x.data(), nullptr};
  EXPECT_THROW(attnres_forward(src, 2, 2, 4, w.data(), g.data(), 1e-5, h.data()), Error);
  EXPECT_THROW(attnres_forward(src, 0, 2, 4, w.data(), g.data(), 1e-5, h.data()), Error);
  std::vector<double> m(2), l(2), acc(8);
  EXPECT_THROW(attnres_phase2(m.data(), l.data(), acc.data(), src, 0, 2, 4, w.data(), g.data(), 1e-5, h.data()), Error);
}

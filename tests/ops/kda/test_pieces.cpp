// KDA pieces (gate, L2 norm, sigmoid, short conv): float64 finite-difference gradients, the forward
// formulas against direct evaluations of their definitions, and streaming/varlen consistency.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "ops/kda/kda.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::kda;
using lm::testing::dot;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::randu;
using lm::testing::rel_rms_vec;

namespace {

using Vec = std::vector<double>;
constexpr double kFdTol = 1e-7;  // central differences in float64 with h = 1e-6 are good to ~1e-9 here

double max_abs_diff(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// ---- gate ------------------------------------------------------------------------------------

struct GateCase {
  int64_t rows = 7, H = 3, K = 4;
  Vec x, A_log, dt_bias, w;
  explicit GateCase(uint64_t seed, double x_sd = 1.5) {
    x = randn(static_cast<size_t>(rows * H * K), seed, x_sd);
    Vec u = randu(static_cast<size_t>(H), seed + 1, 1.0, 16.0);
    A_log.resize(u.size());
    for (size_t i = 0; i < u.size(); ++i) A_log[i] = std::log(u[i]) * 0.5;  // keep the bounded slope moderate
    dt_bias = randn(static_cast<size_t>(H * K), seed + 2, 0.5);
    w = randn(x.size(), seed + 3);
  }
  double loss(GateParams p) const {
    Vec g(x.size());
    gate_forward(x.data(), A_log.data(), dt_bias.data(), g.data(), rows, H, K, p);
    return dot(g, w);
  }
};

void check_gate_grads(GateParams p, uint64_t seed) {
  GateCase c(seed);
  Vec dx(c.x.size()), dA(c.A_log.size(), 0.0), dbias(c.dt_bias.size(), 0.0);
  gate_backward(c.x.data(), c.A_log.data(), c.dt_bias.data(), c.w.data(), dx.data(), dA.data(), dbias.data(), c.rows,
                c.H, c.K, p);
  auto f = [&] { return c.loss(p); };
  EXPECT_LT(fd_check(c.x, dx, f), kFdTol);
  EXPECT_LT(fd_check(c.A_log, dA, f), kFdTol);
  EXPECT_LT(fd_check(c.dt_bias, dbias, f), kFdTol);
  // dA_log and ddt_bias accumulate: a second call adds the same amount on top of what is there.
  Vec dA2(dA.size(), 1.0), dbias2(dbias.size(), -2.0), dx2(dx.size(), 99.0);
  gate_backward(c.x.data(), c.A_log.data(), c.dt_bias.data(), c.w.data(), dx2.data(), dA2.data(), dbias2.data(), c.rows,
                c.H, c.K, p);
  for (size_t i = 0; i < dA.size(); ++i) EXPECT_NEAR(dA2[i], 1.0 + dA[i], 1e-12);
  for (size_t i = 0; i < dbias.size(); ++i) EXPECT_NEAR(dbias2[i], -2.0 + dbias[i], 1e-12);
  EXPECT_EQ(dx2, dx);  // dx is written, not accumulated
}

TEST(KdaGate, SoftplusGradientsMatchFiniteDifferences) { check_gate_grads(GateParams{GateForm::Softplus, 0.0}, 11); }

TEST(KdaGate, LowerBoundGradientsMatchFiniteDifferences) {
  check_gate_grads(GateParams{GateForm::LowerBound, -5.0}, 21);
  check_gate_grads(GateParams{GateForm::LowerBound, -0.7}, 22);
}

TEST(KdaGate, ForwardMatchesDefinition) {
  // One head, K = 5 channels at chosen points, including both sides of the softplus threshold (20).
  const Vec x = {-40.0, -3.0, 0.25, 19.5, 25.0};
  const Vec dt = {0.0, 0.5, -0.25, 0.0, 0.0};
  const Vec A_log = {std::log(3.0)};
  Vec g(5);
  gate_forward(x.data(), A_log.data(), dt.data(), g.data(), 1, 1, 5, GateParams{GateForm::Softplus, 0.0});
  for (int i = 0; i < 5; ++i) {
    const double z = x[i] + dt[i];
    const double sp = z > 20 ? z : std::log(1.0 + std::exp(z));
    EXPECT_NEAR(g[i], -3.0 * sp, 1e-12 * (1 + std::abs(sp))) << i;
  }
  EXPECT_EQ(g[4], -std::exp(A_log[0]) * 25.0);  // exactly the identity branch above the threshold, as torch
  gate_forward(x.data(), A_log.data(), dt.data(), g.data(), 1, 1, 5, GateParams{GateForm::LowerBound, -5.0});
  for (int i = 0; i < 5; ++i) {
    const double z = x[i] + dt[i];
    EXPECT_NEAR(g[i], -5.0 / (1.0 + std::exp(-3.0 * z)), 1e-12) << i;
    EXPECT_LE(g[i], 0.0);
    EXPECT_GE(g[i], -5.0);
  }
}

TEST(KdaGate, ExtremeInputsStayFinite) {
  const Vec x = {-1e4, -700.0, 700.0, 1e4};
  const Vec dt(4, 0.0), A_log = {2.0}, dg(4, 1.0);
  for (GateParams p : {GateParams{GateForm::Softplus, 0.0}, GateParams{GateForm::LowerBound, -5.0}}) {
    Vec g(4), dx(4), dA(1, 0.0), db(4, 0.0);
    gate_forward(x.data(), A_log.data(), dt.data(), g.data(), 1, 1, 4, p);
    gate_backward(x.data(), A_log.data(), dt.data(), dg.data(), dx.data(), dA.data(), db.data(), 1, 1, 4, p);
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(std::isfinite(g[i]) && std::isfinite(dx[i])) << i;
      EXPECT_LE(g[i], 0.0);
    }
    EXPECT_TRUE(std::isfinite(dA[0]));
  }
}

TEST(KdaGate, RejectsNonNegativeLowerBound) {
  Vec x(4, 0.0), dt(4, 0.0), A(1, 0.0), g(4);
  EXPECT_THROW(gate_forward(x.data(), A.data(), dt.data(), g.data(), 1, 1, 4, GateParams{GateForm::LowerBound, 0.0}),
               Error);
}

// ---- l2norm, sigmoid -------------------------------------------------------------------------

TEST(KdaL2Norm, UnitNormAndFiniteDifferences) {
  const int64_t rows = 6, D = 5;
  Vec x = randn(static_cast<size_t>(rows * D), 31), w = randn(x.size(), 32);
  x[3] = 0.0;  // a zero channel is fine
  Vec y(x.size());
  l2norm_forward(x.data(), y.data(), rows, D);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0, sx = 0;
    for (int64_t d = 0; d < D; ++d) {
      ss += y[r * D + d] * y[r * D + d];
      sx += x[r * D + d] * x[r * D + d];
    }
    EXPECT_NEAR(ss, sx / (sx + 1e-6), 1e-12);  // eps sits inside the sqrt
  }
  Vec dx(x.size());
  l2norm_backward(x.data(), w.data(), dx.data(), rows, D);
  auto f = [&] {
    Vec yy(x.size());
    l2norm_forward(x.data(), yy.data(), rows, D);
    return dot(yy, w);
  };
  EXPECT_LT(fd_check(x, dx, f, 30), kFdTol);
  // Tiny rows: eps dominates, y ~ x / 1e-3, and the gradient still matches.
  Vec xs = randn(static_cast<size_t>(D), 33, 1e-4), ws = randn(static_cast<size_t>(D), 34), dxs(xs.size());
  l2norm_backward(xs.data(), ws.data(), dxs.data(), 1, D);
  auto fs = [&] {
    Vec yy(xs.size());
    l2norm_forward(xs.data(), yy.data(), 1, D);
    return dot(yy, ws);
  };
  EXPECT_LT(fd_check(xs, dxs, fs, 5, 1e-9), 1e-6);
}

TEST(KdaSigmoid, ValuesAndFiniteDifferences) {
  Vec x = randn(40, 41, 3.0), w = randn(40, 42);
  x[0] = 800.0;
  x[1] = -800.0;
  Vec y(x.size()), dx(x.size());
  sigmoid_forward(x.data(), y.data(), 40);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], 1.0 / (1.0 + std::exp(-x[i])), 1e-15);
  sigmoid_backward(x.data(), w.data(), dx.data(), 40);
  EXPECT_TRUE(std::isfinite(dx[0]) && std::isfinite(dx[1]));
  auto f = [&] {
    Vec yy(x.size());
    sigmoid_forward(x.data(), yy.data(), 40);
    return dot(yy, w);
  };
  EXPECT_LT(fd_check(x, dx, f, 40), kFdTol);
}

// ---- short conv ------------------------------------------------------------------------------

struct ConvCase {
  ConvDims d;
  std::vector<int64_t> cu;
  int64_t nseq = 0, rows = 0;
  Vec x, w, cache, r;
  bool has_cache = false;
  ConvCase(bool varlen, bool with_cache, int64_t C, int64_t W, uint64_t seed) {
    d.C = C;
    d.W = W;
    if (varlen) {
      cu = {0, 2, 2, 9, 14};  // a short (< W-1), an empty and two longer sequences
      d.B = 1;
      d.T = cu.back();
      d.N = static_cast<int64_t>(cu.size()) - 1;
      d.cu_seqlens = cu.data();
      nseq = d.N;
    } else {
      d.B = 2;
      d.T = 6;
      nseq = d.B;
    }
    rows = d.B * d.T;
    x = randn(static_cast<size_t>(rows * C), seed);
    w = randn(static_cast<size_t>(C * W), seed + 1, 0.5);
    has_cache = with_cache;
    cache = with_cache ? randn(static_cast<size_t>(nseq * C * (W - 1)), seed + 2) : Vec{};
    r = randn(x.size(), seed + 3);
  }
  const double* cache_ptr() const { return has_cache ? cache.data() : nullptr; }
  int64_t begin(int64_t n) const { return d.cu_seqlens ? cu[n] : n * d.T; }
  int64_t len(int64_t n) const { return d.cu_seqlens ? cu[n + 1] - cu[n] : d.T; }
  Vec forward(bool silu) const {
    Vec y(x.size());
    short_conv_forward(x.data(), w.data(), cache_ptr(), y.data(), d, silu);
    return y;
  }
  // The definition, written independently: pad each sequence with its cache (or zeros) and slide.
  Vec naive(bool silu) const {
    const int64_t C = d.C, W = d.W;
    Vec y(x.size());
    for (int64_t n = 0; n < nseq; ++n) {
      const int64_t L = len(n), b = begin(n);
      for (int64_t c = 0; c < C; ++c) {
        Vec pad(static_cast<size_t>(L + W - 1), 0.0);
        for (int64_t j = 0; j < W - 1; ++j) pad[j] = has_cache ? cache[(n * C + c) * (W - 1) + j] : 0.0;
        for (int64_t t = 0; t < L; ++t) pad[t + W - 1] = x[(b + t) * C + c];
        for (int64_t t = 0; t < L; ++t) {
          double s = 0;
          for (int64_t k = 0; k < W; ++k) s += w[c * W + k] * pad[t + k];
          y[(b + t) * C + c] = silu ? s / (1.0 + std::exp(-s)) : s;
        }
      }
    }
    return y;
  }
};

TEST(KdaShortConv, ForwardMatchesDefinition) {
  for (int64_t W : {1, 2, 4})
    for (bool varlen : {false, true})
      for (bool cache : {false, true})
        for (bool silu : {false, true}) {
          if (W == 1 && cache) continue;
          ConvCase c(varlen, cache, 19, W, 50 + static_cast<uint64_t>(W));  // 19: a partial channel block
          EXPECT_LT(max_abs_diff(c.forward(silu), c.naive(silu)), 1e-13)
              << "W=" << W << " varlen=" << varlen << " cache=" << cache << " silu=" << silu;
        }
}

TEST(KdaShortConv, GradientsMatchFiniteDifferences) {
  for (bool varlen : {false, true})
    for (bool with_cache : {false, true})
      for (bool silu : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "varlen=" << varlen << " cache=" << with_cache << " silu=" << silu);
        ConvCase c(varlen, with_cache, 5, 4, 60);
        Vec dx(c.x.size(), 7.0), dw(c.w.size(), 0.0), dcache(static_cast<size_t>(c.nseq * c.d.C * 3), 7.0);
        short_conv_backward(c.x.data(), c.w.data(), c.cache_ptr(), c.r.data(), dx.data(), dw.data(), dcache.data(), c.d,
                            silu);
        auto f = [&] { return dot(c.forward(silu), c.r); };
        EXPECT_LT(fd_check(c.x, dx, f, 40), kFdTol);
        EXPECT_LT(fd_check(c.w, dw, f, 20), kFdTol);
        if (with_cache) {
          EXPECT_LT(fd_check(c.cache, dcache, f, 30), kFdTol);
        }
        // dw accumulates.
        Vec dw2(c.w.size(), 0.5), dx2(c.x.size());
        short_conv_backward(c.x.data(), c.w.data(), c.cache_ptr(), c.r.data(), dx2.data(), dw2.data(),
                            static_cast<double*>(nullptr), c.d, silu);
        for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw2[i], 0.5 + dw[i], 1e-12);
        EXPECT_EQ(dx2, dx);
      }
}

TEST(KdaShortConv, StepsEqualOnePass) {
  // Batch of S sequences streamed token by token from an initial cache equals the packed forward,
  // and the cache left behind equals short_conv_final_cache.
  for (bool silu : {false, true}) {
    const int64_t S = 3, T = 9, C = 7, W = 4;
    Vec x = randn(static_cast<size_t>(S * T * C), 70), w = randn(static_cast<size_t>(C * W), 71, 0.5);
    Vec cache0 = randn(static_cast<size_t>(S * C * (W - 1)), 72);
    ConvDims d{S, T, C, W, nullptr, 0};
    Vec y(x.size()), fin(cache0.size());
    short_conv_forward(x.data(), w.data(), cache0.data(), y.data(), d, silu);
    short_conv_final_cache(x.data(), cache0.data(), fin.data(), d);
    Vec cache = cache0, xs(static_cast<size_t>(S * C)), ys(xs.size());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < C; ++c) xs[s * C + c] = x[(s * T + t) * C + c];
      short_conv_step(xs.data(), w.data(), cache.data(), ys.data(), S, C, W, silu);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(ys[s * C + c], y[(s * T + t) * C + c], 1e-14);
    }
    EXPECT_EQ(cache, fin);
  }
}

TEST(KdaShortConv, FinalCacheThenStepsEqualsConcatenation) {
  // x = [x1 | x2] per sequence. Forward over x1 (lengths 2, 0, 5: shorter than W-1, empty, longer),
  // final_cache, then stream x2: equals the tail of one forward pass over the concatenation.
  const int64_t C = 6, W = 4, T2 = 5;
  const std::vector<int64_t> L1 = {2, 0, 5};
  const int64_t N = 3;
  std::vector<int64_t> cu1 = {0}, cuall = {0};
  for (int64_t n = 0; n < N; ++n) {
    cu1.push_back(cu1.back() + L1[n]);
    cuall.push_back(cuall.back() + L1[n] + T2);
  }
  Vec x1 = randn(static_cast<size_t>(cu1.back() * C), 80), x2 = randn(static_cast<size_t>(N * T2 * C), 81);
  Vec w = randn(static_cast<size_t>(C * W), 82, 0.5), cache0 = randn(static_cast<size_t>(N * C * (W - 1)), 83);
  Vec xall(static_cast<size_t>(cuall.back() * C));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t t = 0; t < L1[n]; ++t)
      for (int64_t c = 0; c < C; ++c) xall[(cuall[n] + t) * C + c] = x1[(cu1[n] + t) * C + c];
    for (int64_t t = 0; t < T2; ++t)
      for (int64_t c = 0; c < C; ++c) xall[(cuall[n] + L1[n] + t) * C + c] = x2[(n * T2 + t) * C + c];
  }
  ConvDims dall{1, cuall.back(), C, W, cuall.data(), N};
  ConvDims d1{1, cu1.back(), C, W, cu1.data(), N};
  Vec yall(xall.size()), finall(cache0.size());
  short_conv_forward(xall.data(), w.data(), cache0.data(), yall.data(), dall, true);
  short_conv_final_cache(xall.data(), cache0.data(), finall.data(), dall);
  Vec cache(cache0.size());
  short_conv_final_cache(x1.data(), cache0.data(), cache.data(), d1);
  Vec inplace = cache0;  // the in-place form gives the same cache
  short_conv_final_cache(x1.data(), inplace.data(), inplace.data(), d1);
  EXPECT_EQ(inplace, cache);
  Vec xs(static_cast<size_t>(N * C)), ys(xs.size());
  for (int64_t t = 0; t < T2; ++t) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) xs[n * C + c] = x2[(n * T2 + t) * C + c];
    short_conv_step(xs.data(), w.data(), cache.data(), ys.data(), N, C, W, true);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(ys[n * C + c], yall[(cuall[n] + L1[n] + t) * C + c], 1e-14);
  }
  EXPECT_LT(max_abs_diff(cache, finall), 1e-15);
}

TEST(KdaShortConv, VarlenEqualsSeparateRuns) {
  ConvCase c(true, true, 9, 4, 90);
  for (bool silu : {false, true}) {
    Vec y = c.forward(silu), dx(c.x.size()), dw(c.w.size(), 0.0), dcache(c.cache.size());
    short_conv_backward(c.x.data(), c.w.data(), c.cache.data(), c.r.data(), dx.data(), dw.data(), dcache.data(), c.d,
                        silu);
    Vec dw_sum(c.w.size(), 0.0);
    for (int64_t n = 0; n < c.nseq; ++n) {
      const int64_t b = c.begin(n), L = c.len(n), C = c.d.C;
      if (L == 0) {  // an empty sequence passes its whole gradient-free history through: dcache = 0
        for (int64_t i = 0; i < C * 3; ++i) EXPECT_EQ(dcache[n * C * 3 + i], 0.0);
        continue;
      }
      ConvDims d1{1, L, C, 4, nullptr, 0};
      const double* xn = c.x.data() + b * C;
      const double* cn = c.cache.data() + n * C * 3;
      Vec yn(static_cast<size_t>(L * C)), dxn(yn.size()), dcn(static_cast<size_t>(C * 3));
      short_conv_forward(xn, c.w.data(), cn, yn.data(), d1, silu);
      short_conv_backward(xn, c.w.data(), cn, c.r.data() + b * C, dxn.data(), dw_sum.data(), dcn.data(), d1, silu);
      for (int64_t i = 0; i < L * C; ++i) {
        EXPECT_EQ(yn[i], y[b * C + i]);
        EXPECT_EQ(dxn[i], dx[b * C + i]);
      }
      for (int64_t i = 0; i < C * 3; ++i) EXPECT_EQ(dcn[i], dcache[n * C * 3 + i]);
    }
    EXPECT_LT(rel_rms_vec(dw_sum, dw), 1e-14);
  }
}

TEST(KdaShortConv, RejectsBadDims) {
  Vec x(12, 0.0), w(8, 0.0), y(12);
  std::vector<int64_t> bad = {0, 2, 1, 3};
  EXPECT_THROW(short_conv_forward(x.data(), w.data(), static_cast<double*>(nullptr), y.data(),
                                  ConvDims{1, 3, 4, 2, bad.data(), 3}, false),
               Error);
  EXPECT_THROW(short_conv_forward(x.data(), w.data(), static_cast<double*>(nullptr), y.data(),
                                  ConvDims{1, 3, 4, 0, nullptr, 0}, false),
               Error);
}

}  // namespace

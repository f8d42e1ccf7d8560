// RMSNorm: known values, float64 finite differences of every backward, float vs double, strides,
// accumulation into dw, and thread-count independence.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

template <class To, class From>
std::vector<To> cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

}  // namespace

TEST(RmsNorm, KnownValues) {
  // x = [3, 4]: mean(x^2) = 12.5; w = [1, 2].
  const std::vector<double> x{3, 4}, w{1, 2};
  std::vector<double> y(2), rstd(1);
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), 1, 2, 0.0);
  EXPECT_NEAR(rstd[0], 1 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-15);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), 1e-15);
  // eps enters inside the sqrt.
  rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), 1, 2, 0.5);
  EXPECT_NEAR(rstd[0], 1 / std::sqrt(13.0), 1e-15);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  for (const auto& shape : {std::pair<int64_t, int64_t>{7, 13}, {100, 5}, {3, 64}}) {
    const int64_t rows = shape.first, D = shape.second;  // plain locals: lambdas capture them
    const double eps = 1e-5;
    auto x = randn(rows * D, 1, 1.5);
    auto w = randn(D, 2, 0.3);
    for (auto& wi : w) wi += 1.0;
    const auto G = randn(rows * D, 3);  // L = sum(y * G)
    std::vector<double> y(x.size()), rstd(rows);
    auto loss = [&] {
      rmsnorm_forward(x.data(), w.data(), y.data(), static_cast<double*>(nullptr), rows, D, eps);
      return lm::testing::dot(y, G);
    };
    rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, D, eps);
    std::vector<double> dx(x.size()), dw(D, 0.0), dx2(x.size());
    rmsnorm_backward(x.data(), w.data(), rstd.data(), G.data(), dx.data(), dw.data(), rows, D, eps);
    // rstd null recomputes it: identical.
    rmsnorm_backward(x.data(), w.data(), static_cast<const double*>(nullptr), G.data(), dx2.data(),
                     static_cast<double*>(nullptr), rows, D, eps);
    EXPECT_EQ(dx, dx2);
    const double ex = fd_check(x, dx, loss, 40);
    const double ew = fd_check(w, dw, loss, 40);
    EXPECT_LT(ex, 1e-8) << rows << "x" << D;
    EXPECT_LT(ew, 1e-8) << rows << "x" << D;
    std::printf("rmsnorm %ldx%ld fd err: dx %.2e dw %.2e\n", long(rows), long(D), ex, ew);
  }
}

TEST(RmsNorm, StridedRowsAndInPlace) {
  // MLA kv_a: rows of 20 with the norm over the first 12 columns; y written into rows of 16.
  const int64_t rows = 9, D = 12, ldx = 20, ldy = 16;
  const double eps = 1e-6;
  auto xs = randn(rows * ldx, 4);
  auto w = randn(D, 5);
  std::vector<double> x(rows * D), y(rows * D), ys(rows * ldy, -7.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < D; ++j) x[r * D + j] = xs[r * ldx + j];
  rmsnorm_forward(x.data(), w.data(), y.data(), static_cast<double*>(nullptr), rows, D, eps);
  rmsnorm_forward(xs.data(), w.data(), ys.data(), static_cast<double*>(nullptr), rows, D, eps, ldx, ldy);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < D; ++j) EXPECT_EQ(ys[r * ldy + j], y[r * D + j]);
    for (int64_t j = D; j < ldy; ++j) EXPECT_EQ(ys[r * ldy + j], -7.0);  // untouched
  }
  const auto dy = randn(rows * D, 6);
  std::vector<double> dys(rows * ldy, 0.0), dxs(rows * ldx, -3.0), dx(rows * D), dw(D, 0.0), dws(D, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < D; ++j) dys[r * ldy + j] = dy[r * D + j];
  rmsnorm_backward(x.data(), w.data(), static_cast<const double*>(nullptr), dy.data(), dx.data(), dw.data(), rows, D,
                   eps);
  rmsnorm_backward(xs.data(), w.data(), static_cast<const double*>(nullptr), dys.data(), dxs.data(), dws.data(), rows,
                   D, eps, ldx, ldy);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < D; ++j) EXPECT_EQ(dxs[r * ldx + j], dx[r * D + j]);
    for (int64_t j = D; j < ldx; ++j) EXPECT_EQ(dxs[r * ldx + j], -3.0);
  }
  EXPECT_EQ(dw, dws);
  // In place: forward y = x, backward dx = dy.
  auto xi = x;
  rmsnorm_forward(xi.data(), w.data(), xi.data(), static_cast<double*>(nullptr), rows, D, eps);
  EXPECT_EQ(xi, y);
  auto dyi = dy;
  rmsnorm_backward(x.data(), w.data(), static_cast<const double*>(nullptr), dyi.data(), dyi.data(),
                   static_cast<double*>(nullptr), rows, D, eps);
  EXPECT_EQ(dyi, dx);
}

TEST(RmsNorm, DwAccumulatesAndIsThreadCountIndependent) {
  const int64_t rows = 1000, D = 48;  // > 32 rows: several reduction blocks
  const auto x = randn<float>(rows * D, 7);
  const auto w = randn<float>(D, 8);
  const auto dy = randn<float>(rows * D, 9);
  std::vector<float> dx(x.size()), dw1(D, 0.5f), dw2(D, 0.5f), dw0(D, 0.0f);
  const int saved = num_threads();
  set_num_threads(1);
  rmsnorm_backward(x.data(), w.data(), static_cast<const float*>(nullptr), dy.data(), dx.data(), dw1.data(), rows, D,
                   1e-5f);
  set_num_threads(2);
  rmsnorm_backward(x.data(), w.data(), static_cast<const float*>(nullptr), dy.data(), dx.data(), dw2.data(), rows, D,
                   1e-5f);
  rmsnorm_backward(x.data(), w.data(), static_cast<const float*>(nullptr), dy.data(), dx.data(), dw0.data(), rows, D,
                   1e-5f);
  set_num_threads(saved);
  EXPECT_EQ(dw1, dw2);  // bitwise
  for (int64_t j = 0; j < D; ++j) EXPECT_NEAR(dw1[j], dw0[j] + 0.5f, 1e-5f * (1 + std::fabs(dw0[j])));
}

TEST(RmsNorm, FloatMatchesDouble) {
  const int64_t rows = 64, D = 256;
  const auto xd = randn(rows * D, 10, 2.0);
  const auto wd = randn(D, 11);
  const auto gd = randn(rows * D, 12);
  const auto dyd = randn(rows * D, 13);
  const auto xf = cast<float>(xd), wf = cast<float>(wd), gf = cast<float>(gd), dyf = cast<float>(dyd);
  std::vector<double> yd(xd.size()), dxd(xd.size()), dwd(D, 0.0), dgd(xd.size());
  std::vector<float> yf(xd.size()), dxf(xd.size()), dwf(D, 0.0f), dgf(xd.size());
  rmsnorm_forward(xd.data(), wd.data(), yd.data(), static_cast<double*>(nullptr), rows, D, 1e-5);
  rmsnorm_forward(xf.data(), wf.data(), yf.data(), static_cast<float*>(nullptr), rows, D, 1e-5f);
  EXPECT_LT(rel_rms_vec(yd, cast<double>(yf)), 1e-6);
  rmsnorm_backward(xd.data(), wd.data(), static_cast<const double*>(nullptr), dyd.data(), dxd.data(), dwd.data(), rows,
                   D, 1e-5);
  rmsnorm_backward(xf.data(), wf.data(), static_cast<const float*>(nullptr), dyf.data(), dxf.data(), dwf.data(), rows,
                   D, 1e-5f);
  const double e_dx = rel_rms_vec(dxd, cast<double>(dxf)), e_dw = rel_rms_vec(dwd, cast<double>(dwf));
  EXPECT_LT(e_dx, 1e-5);
  EXPECT_LT(e_dw, 1e-5);
  // Gated form.
  rmsnorm_gated_forward(xd.data(), gd.data(), wd.data(), yd.data(), static_cast<double*>(nullptr), rows, D, 1e-5);
  rmsnorm_gated_forward(xf.data(), gf.data(), wf.data(), yf.data(), static_cast<float*>(nullptr), rows, D, 1e-5f);
  const double e_gy = rel_rms_vec(yd, cast<double>(yf));
  EXPECT_LT(e_gy, 1e-6);
  std::fill(dwd.begin(), dwd.end(), 0.0);
  std::fill(dwf.begin(), dwf.end(), 0.0f);
  rmsnorm_gated_backward(xd.data(), gd.data(), wd.data(), static_cast<const double*>(nullptr), dyd.data(), dxd.data(),
                         dgd.data(), dwd.data(), rows, D, 1e-5);
  rmsnorm_gated_backward(xf.data(), gf.data(), wf.data(), static_cast<const float*>(nullptr), dyf.data(), dxf.data(),
                         dgf.data(), dwf.data(), rows, D, 1e-5f);
  const double e_gdx = rel_rms_vec(dxd, cast<double>(dxf)), e_gdg = rel_rms_vec(dgd, cast<double>(dgf)),
               e_gdw = rel_rms_vec(dwd, cast<double>(dwf));
  EXPECT_LT(e_gdx, 1e-5);
  EXPECT_LT(e_gdg, 1e-5);
  EXPECT_LT(e_gdw, 1e-5);
  std::printf("rmsnorm f32 vs f64: dx %.2e dw %.2e | gated y %.2e dx %.2e dgate %.2e dw %.2e\n", e_dx, e_dw, e_gy,
              e_gdx, e_gdg, e_gdw);
}

TEST(RmsNormGated, KnownValueAndFiniteDifferences) {
  // Per-head use: T = 5 tokens, H = 3 heads, V = 8 -> rows = 15 sharing w [8].
  const int64_t T = 5, H = 3, V = 8, rows = T * H;
  const double eps = 1e-5;
  auto x = randn(rows * V, 20);
  auto g = randn(rows * V, 21, 2.0);
  auto w = randn(V, 22, 0.2);
  for (auto& wi : w) wi += 1.0;
  const auto G = randn(rows * V, 23);
  std::vector<double> out(x.size()), rstd(rows), plain(x.size());
  rmsnorm_gated_forward(x.data(), g.data(), w.data(), out.data(), rstd.data(), rows, V, eps);
  rmsnorm_forward(x.data(), w.data(), plain.data(), static_cast<double*>(nullptr), rows, V, eps);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(out[i], plain[i] / (1 + std::exp(-g[i])), 1e-14);
  auto loss = [&] {
    rmsnorm_gated_forward(x.data(), g.data(), w.data(), out.data(), static_cast<double*>(nullptr), rows, V, eps);
    return lm::testing::dot(out, G);
  };
  std::vector<double> dx(x.size()), dg(x.size()), dw(V, 0.0);
  rmsnorm_gated_backward(x.data(), g.data(), w.data(), rstd.data(), G.data(), dx.data(), dg.data(), dw.data(), rows, V,
                         eps);
  const double ex = fd_check(x, dx, loss, 40), eg = fd_check(g, dg, loss, 40), ew = fd_check(w, dw, loss, 40);
  EXPECT_LT(ex, 1e-8);
  EXPECT_LT(eg, 1e-8);
  EXPECT_LT(ew, 1e-8);
  std::printf("rmsnorm_gated fd err: dx %.2e dgate %.2e dw %.2e\n", ex, eg, ew);
}

TEST(RmsNorm, RejectsBadArguments) {
  std::vector<double> x(8), w(4), y(8);
  EXPECT_THROW(rmsnorm_forward(x.data(), w.data(), y.data(), static_cast<double*>(nullptr), 2, 0, 1e-5), Error);
  EXPECT_THROW(rmsnorm_forward(x.data(), w.data(), y.data(), static_cast<double*>(nullptr), 2, 4, 1e-5, 3), Error);
  EXPECT_THROW(rmsnorm_forward(x.data(), w.data(), y.data(), static_cast<double*>(nullptr), 2, 4, -1.0), Error);
}

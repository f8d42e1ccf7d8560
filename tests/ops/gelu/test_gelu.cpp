// GELU (tanh and erf forms): known values, float vs double, and float64 finite differences of the backward.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/gelu/gelu.hpp"
#include "tests/testing.hpp"

using namespace lm::ops;
using lm::testing::randn;

TEST(Gelu, KnownValues) {
  // x Φ(x) (Φ(3) = 0.998650101968370) and PyTorch's approximate="tanh" at x = -2, -0.5, 0, 1 (, 3).
  const std::vector<double> x{-2, -0.5, 0, 1, 3};
  const std::vector<double> erf_ref{-0.04550026389635842, -0.15426876936299347, 0, 0.8413447460685429,
                                    2.99595030590511};
  const std::vector<double> tanh_ref{-0.04540230591222, -0.15428599017481, 0, 0.84119199060827};
  std::vector<double> y(x.size());
  gelu_forward(x.data(), y.data(), 5, GeluKind::Erf);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], erf_ref[i], 1e-13) << x[i];
  gelu_forward(x.data(), y.data(), 5, GeluKind::Tanh);
  for (size_t i = 0; i < tanh_ref.size(); ++i) EXPECT_NEAR(y[i], tanh_ref[i], 1e-12) << x[i];
}

TEST(Gelu, BackwardMatchesFiniteDifferencesAndFloatMatchesDouble) {
  const int64_t n = 40000;  // spans several parallel blocks
  auto x = randn<double>(n, 1, 2.0);
  const auto dy = randn<double>(n, 2);
  for (GeluKind k : {GeluKind::Tanh, GeluKind::Erf}) {
    std::vector<double> dx(n), y(n);
    gelu_backward(x.data(), dy.data(), dx.data(), n, k);
    auto f = [&] {
      gelu_forward(x.data(), y.data(), n, k);
      return lm::testing::dot(y, dy);
    };
    EXPECT_LT(lm::testing::fd_check(x, dx, f, 32, 1e-5), 1e-8);
    std::vector<float> xf(x.begin(), x.end()), yf(n), dyf(dy.begin(), dy.end()), dxf(n);
    gelu_forward(xf.data(), yf.data(), n, k);
    gelu_forward(x.data(), y.data(), n, k);
    EXPECT_LT(lm::testing::rel_rms_vec(y, std::vector<double>(yf.begin(), yf.end())), 1e-6);
    gelu_backward(xf.data(), dyf.data(), dxf.data(), n, k);
    EXPECT_LT(lm::testing::rel_rms_vec(dx, std::vector<double>(dxf.begin(), dxf.end())), 1e-6);
  }
}

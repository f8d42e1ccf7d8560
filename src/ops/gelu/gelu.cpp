// GELU forward/backward on the CPU (formulas in gelu.hpp). Legend: n elements.
#include "ops/gelu/gelu.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {

namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // √(2/π)
constexpr double kCubic = 0.044715;
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)
constexpr int64_t kGrain = 1 << 14;

template <class F>
F gelu_tanh(F x) {
  const F u = static_cast<F>(kSqrt2OverPi) * (x + static_cast<F>(kCubic) * x * x * x);
  return F(0.5) * x * (F(1) + std::tanh(u));
}
template <class F>
F gelu_tanh_grad(F x) {
  const F t = std::tanh(static_cast<F>(kSqrt2OverPi) * (x + static_cast<F>(kCubic) * x * x * x));
  const F du = static_cast<F>(kSqrt2OverPi) * (F(1) + F(3) * static_cast<F>(kCubic) * x * x);
  return F(0.5) * (F(1) + t) + F(0.5) * x * (F(1) - t * t) * du;
}
template <class F>
F gelu_erf(F x) {
  return F(0.5) * x * (F(1) + std::erf(x * static_cast<F>(kInvSqrt2)));
}
template <class F>
F gelu_erf_grad(F x) {
  const F cdf = F(0.5) * (F(1) + std::erf(x * static_cast<F>(kInvSqrt2)));
  return cdf + x * static_cast<F>(kInvSqrt2Pi) * std::exp(F(-0.5) * x * x);
}

void check(const char* who, int64_t n) { LM_CHECK(n >= 0, "{}: n = {} must be >= 0", who, n); }

}  // namespace

template <class F>
void gelu_forward(const F* x, F* y, int64_t n, GeluKind kind) {
  check("gelu_forward", n);
  const int64_t blocks = (n + kGrain - 1) / kGrain;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * kGrain);
    if (kind == GeluKind::Tanh)
      for (int64_t i = b * kGrain; i < e; ++i) y[i] = gelu_tanh(x[i]);
    else
      for (int64_t i = b * kGrain; i < e; ++i) y[i] = gelu_erf(x[i]);
  });
}

template <class F>
void gelu_backward(const F* x, const F* dy, F* dx, int64_t n, GeluKind kind) {
  check("gelu_backward", n);
  const int64_t blocks = (n + kGrain - 1) / kGrain;
  parallel_for(blocks, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * kGrain);
    if (kind == GeluKind::Tanh)
      for (int64_t i = b * kGrain; i < e; ++i) dx[i] = dy[i] * gelu_tanh_grad(x[i]);
    else
      for (int64_t i = b * kGrain; i < e; ++i) dx[i] = dy[i] * gelu_erf_grad(x[i]);
  });
}

template void gelu_forward<float>(const float*, float*, int64_t, GeluKind);
template void gelu_forward<double>(const double*, double*, int64_t, GeluKind);
template void gelu_backward<float>(const float*, const float*, float*, int64_t, GeluKind);
template void gelu_backward<double>(const double*, const double*, double*, int64_t, GeluKind);

}  // namespace lm::ops

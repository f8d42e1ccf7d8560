// Per-head L2 norm of q and k, and the beta sigmoid (SPEC §2).
// rows = B*T*H head vectors, D = K channels each; n elements for the sigmoid.
//   l2norm:  r = 1 / sqrt(sum_d x_d^2 + eps),  y = r x          (eps inside the sqrt, as fla)
//   sigmoid: b = 1 / (1 + exp(-x))
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {
namespace {

template <class F>
F stable_sigmoid(F z) {
  if (z >= F(0)) return F(1) / (F(1) + std::exp(-z));
  const F e = std::exp(z);
  return e / (F(1) + e);
}

template <class F>
F inv_norm(const F* x, int64_t D, F eps) {
  F ss = 0;
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  return F(1) / std::sqrt(ss + eps);
}

}  // namespace

template <class F>
void l2norm_forward(const F* x, F* y, int64_t rows, int64_t D, F eps) {
  LM_CHECK(rows >= 0 && D > 0, "l2norm: bad shape rows={} D={}", rows, D);
  LM_CHECK(eps >= F(0), "l2norm: eps must be >= 0, got {}", static_cast<double>(eps));
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* xr = x + r * D;
        F* yr = y + r * D;
        const F inv = inv_norm(xr, D, eps);
        for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * inv;
      },
      256);
}

template <class F>
void l2norm_backward(const F* x, const F* dy, F* dx, int64_t rows, int64_t D, F eps) {
  LM_CHECK(rows >= 0 && D > 0, "l2norm: bad shape rows={} D={}", rows, D);
  // dr/dx_j = -x_j r^3, so dx = r (dy - y (y . dy)) with y = r x.
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* xr = x + r * D;
        const F* dyr = dy + r * D;
        F* dxr = dx + r * D;
        const F inv = inv_norm(xr, D, eps);
        F ydy = 0;
        for (int64_t d = 0; d < D; ++d) ydy += xr[d] * inv * dyr[d];
        for (int64_t d = 0; d < D; ++d) dxr[d] = inv * (dyr[d] - xr[d] * inv * ydy);
      },
      256);
}

template <class F>
void sigmoid_forward(const F* x, F* y, int64_t n) {
  LM_CHECK(n >= 0, "sigmoid: bad size {}", n);
  for (int64_t i = 0; i < n; ++i) y[i] = stable_sigmoid(x[i]);
}

template <class F>
void sigmoid_backward(const F* x, const F* dy, F* dx, int64_t n) {
  LM_CHECK(n >= 0, "sigmoid: bad size {}", n);
  for (int64_t i = 0; i < n; ++i) {
    const F s = stable_sigmoid(x[i]);
    dx[i] = dy[i] * s * (F(1) - s);
  }
}

#define LM_KDA_L2_INST(F)                                                        \
  template void l2norm_forward<F>(const F*, F*, int64_t, int64_t, F);            \
  template void l2norm_backward<F>(const F*, const F*, F*, int64_t, int64_t, F); \
  template void sigmoid_forward<F>(const F*, F*, int64_t);                       \
  template void sigmoid_backward<F>(const F*, const F*, F*, int64_t);
LM_KDA_L2_INST(float)
LM_KDA_L2_INST(double)
#undef LM_KDA_L2_INST

}  // namespace lm::kda

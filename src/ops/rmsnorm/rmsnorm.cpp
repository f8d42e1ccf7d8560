// RMSNorm forward/backward on the CPU (see rmsnorm.hpp for the formulas).
// Legend: rows independent vectors, D normalised width, ldx/ldy row strides, nb fixed row blocks of the
//         dw reduction.
#include "ops/rmsnorm/rmsnorm.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/simd_math.hpp"

namespace lm::ops {

namespace {

void check_args(const char* who, int64_t rows, int64_t D, int64_t ldx, int64_t ldy, double eps) {
  LM_CHECK(rows >= 0 && D > 0, "{}: need rows >= 0 and D > 0, got rows={} D={}", who, rows, D);
  LM_CHECK(ldx >= D && ldy >= D, "{}: row strides ldx={} ldy={} must be >= D={}", who, ldx, ldy, D);
  LM_CHECK(eps >= 0 && std::isfinite(eps), "{}: eps must be finite and >= 0, got {}", who, eps);
}

template <class F>
inline F row_rstd(const F* x, int64_t D, F eps) {
  F ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
  return F(1) / std::sqrt(ss / static_cast<F>(D) + eps);
}

// sigmoid of the output gate: float through the vectorisable lm::exp_approx (~2 ulp), double exact.
template <class F>
LM_ALWAYS_INLINE F sigmoid(F z) {
  if constexpr (std::is_same_v<F, float>)
    return 1.0f / (1.0f + exp_approx(-z));
  else
    return F(1) / (F(1) + std::exp(-z));
}

// Parallel only when each thread gets at least ~kMinWork elements: below that the fork/join costs more
// than the loop (and oversubscribed machines make it far worse).
constexpr int64_t kMinWork = 1 << 14;
int64_t grain(int64_t work_per_item) { return std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, work_per_item)); }

// Fixed partition of rows for the dw reduction: depends on `rows` only, never on the thread count, so
// the summation order (and the bits of dw) are reproducible across machines and OMP_NUM_THREADS.
struct RowBlocks {
  int64_t nb;
  int64_t rows;
  int64_t begin(int64_t b) const { return b * rows / nb; }
  int64_t end(int64_t b) const { return (b + 1) * rows / nb; }
};
RowBlocks row_blocks(int64_t rows) {
  constexpr int64_t kMinRows = 32, kMaxBlocks = 64;
  return {std::clamp<int64_t>((rows + kMinRows - 1) / kMinRows, 1, kMaxBlocks), rows};
}

// dw[j] += sum over blocks of partial[b][j], in block order.
template <class F>
void reduce_partials(const std::vector<double>& partial, int64_t nb, int64_t D, F* dw) {
  for (int64_t j = 0; j < D; ++j) {
    double s = 0;
    for (int64_t b = 0; b < nb; ++b) s += partial[static_cast<size_t>(b * D + j)];
    dw[j] += static_cast<F>(s);
  }
}

}  // namespace

template <class F>
void rmsnorm_forward(const F* x, const F* w, F* y, F* rstd, int64_t rows, int64_t D, F eps, int64_t ldx, int64_t ldy) {
  if (ldx == 0) ldx = D;
  if (ldy == 0) ldy = D;
  check_args("rmsnorm_forward", rows, D, ldx, ldy, static_cast<double>(eps));
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* xr = x + r * ldx;
        F* yr = y + r * ldy;
        const F rs = row_rstd(xr, D, eps);
        if (rstd) rstd[r] = rs;
        // (x * rstd) first, then * w: the reference's order (it casts x_normed before the weight).
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) yr[j] = (xr[j] * rs) * w[j];
      },
      grain(D));
}

template <class F>
void rmsnorm_backward(const F* x, const F* w, const F* rstd, const F* dy, F* dx, F* dw, int64_t rows, int64_t D, F eps,
                      int64_t ldx, int64_t ldy) {
  if (ldx == 0) ldx = D;
  if (ldy == 0) ldy = D;
  check_args("rmsnorm_backward", rows, D, ldx, ldy, static_cast<double>(eps));
  const RowBlocks rb = row_blocks(rows);
  std::vector<double> partial(dw ? static_cast<size_t>(rb.nb * D) : 0, 0.0);
  parallel_for(
      rb.nb,
      [&](int64_t b) {
        double* pw = dw ? partial.data() + b * D : nullptr;
        for (int64_t r = rb.begin(b); r < rb.end(b); ++r) {
          const F* xr = x + r * ldx;
          const F* dyr = dy + r * ldy;
          F* dxr = dx + r * ldx;
          const F rs = rstd ? rstd[r] : row_rstd(xr, D, eps);
          // c = mean(g * n) with g = w * dy, n = x * rs.
          F gn = 0;
#pragma omp simd reduction(+ : gn)
          for (int64_t j = 0; j < D; ++j) gn += w[j] * dyr[j] * xr[j];
          const F c = gn * rs / static_cast<F>(D);
          if (pw) {
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) pw[j] += static_cast<double>(dyr[j] * (xr[j] * rs));
          }
          // dx last: it may alias dy.
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) dxr[j] = rs * (w[j] * dyr[j] - (xr[j] * rs) * c);
        }
      },
      grain((rows / rb.nb + 1) * D));
  if (dw) reduce_partials(partial, rb.nb, D, dw);
}

template <class F>
void rmsnorm_gated_forward(const F* x, const F* gate, const F* w, F* out, F* rstd, int64_t rows, int64_t D, F eps) {
  check_args("rmsnorm_gated_forward", rows, D, D, D, static_cast<double>(eps));
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* xr = x + r * D;
        const F* gr = gate + r * D;
        F* orow = out + r * D;
        const F rs = row_rstd(xr, D, eps);
        if (rstd) rstd[r] = rs;
#pragma omp simd
        for (int64_t j = 0; j < D; ++j) orow[j] = ((xr[j] * rs) * w[j]) * sigmoid(gr[j]);
      },
      grain(D));
}

template <class F>
void rmsnorm_gated_backward(const F* x, const F* gate, const F* w, const F* rstd, const F* dout, F* dx, F* dgate, F* dw,
                            int64_t rows, int64_t D, F eps) {
  check_args("rmsnorm_gated_backward", rows, D, D, D, static_cast<double>(eps));
  const RowBlocks rb = row_blocks(rows);
  std::vector<double> partial(dw ? static_cast<size_t>(rb.nb * D) : 0, 0.0);
  parallel_for(
      rb.nb,
      [&](int64_t b) {
        double* pw = dw ? partial.data() + b * D : nullptr;
        for (int64_t r = rb.begin(b); r < rb.end(b); ++r) {
          const F* xr = x + r * D;
          const F* gr = gate + r * D;
          const F* dor = dout + r * D;
          F* dxr = dx + r * D;
          F* dgr = dgate + r * D;
          const F rs = rstd ? rstd[r] : row_rstd(xr, D, eps);
          // Pass 1: dgate = dout * y * s(1-s) with y = n * w; dy = dout * s (kept in dx as scratch).
          F gn = 0;
#pragma omp simd reduction(+ : gn)
          for (int64_t j = 0; j < D; ++j) {
            const F s = sigmoid(gr[j]);
            const F n = xr[j] * rs;
            const F dyj = dor[j] * s;
            dgr[j] = dor[j] * (n * w[j]) * s * (F(1) - s);
            gn += w[j] * dyj * n;
            dxr[j] = dyj;
          }
          if (pw) {
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) pw[j] += static_cast<double>(dxr[j] * (xr[j] * rs));
          }
          const F c = gn / static_cast<F>(D);
          // Pass 2: dx = rs * (w * dy - n * c).
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) dxr[j] = rs * (w[j] * dxr[j] - (xr[j] * rs) * c);
        }
      },
      grain((rows / rb.nb + 1) * D));
  if (dw) reduce_partials(partial, rb.nb, D, dw);
}

#define LM_INSTANTIATE(F)                                                                                         \
  template void rmsnorm_forward<F>(const F*, const F*, F*, F*, int64_t, int64_t, F, int64_t, int64_t);            \
  template void rmsnorm_backward<F>(const F*, const F*, const F*, const F*, F*, F*, int64_t, int64_t, F, int64_t, \
                                    int64_t);                                                                     \
  template void rmsnorm_gated_forward<F>(const F*, const F*, const F*, F*, F*, int64_t, int64_t, F);              \
  template void rmsnorm_gated_backward<F>(const F*, const F*, const F*, const F*, const F*, F*, F*, F*, int64_t,  \
                                          int64_t, F);
LM_INSTANTIATE(float)
LM_INSTANTIATE(double)
#undef LM_INSTANTIATE

}  // namespace lm::ops

// SiTU-GLU and SwiGLU forward/backward on the CPU (see glu.hpp for the formulas).
// Legend: rows tokens, I intermediate width; ab [rows, 2I] = [a | b], h [rows, I].
//
// float runs on vectorisable sigmoid/tanh built from lm::exp_approx (glibc's expf/tanhf are scalar calls
// without -ffast-math, and made SiTU cost ~10x a SwiGLU); double keeps std::exp/std::tanh as the reference.
#include "ops/glu/glu.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/simd_math.hpp"

namespace lm::ops {

namespace {

void check_args(const char* who, int64_t rows, int64_t I, const GluParams& p) {
  LM_CHECK(rows >= 0 && I > 0, "{}: need rows >= 0 and I > 0, got rows={} I={}", who, rows, I);
  if (p.kind == GluKind::SiTU)
    LM_CHECK(p.beta1 > 0 && std::isfinite(p.beta1), "{}: SiTU beta1 must be finite and > 0, got {}", who, p.beta1);
}

// Parallel only when each thread gets at least ~kMinWork elements.
constexpr int64_t kMinWork = 1 << 13;
int64_t grain(int64_t I) { return std::max<int64_t>(1, kMinWork / I); }

LM_ALWAYS_INLINE float sigmoid_fast(float z) { return 1.0f / (1.0f + exp_approx(-z)); }

// tanh for float without a library call. |x| < 0.5: the odd Taylor series through x^15 (truncation
// < 5e-9 relative there), which avoids the cancellation of 1 - e^{-2|x|} near 0; otherwise
// sign(x) (1 - e) / (1 + e) with e = e^{-2|x|} <= e^{-1}. Both are computed and one is selected, so the
// loop stays branch-free.
LM_ALWAYS_INLINE float tanh_fast(float x) {
  const float x2 = x * x;
  float p = -929569.0f / 638512875.0f;
  p = p * x2 + 21844.0f / 6081075.0f;
  p = p * x2 - 1382.0f / 155925.0f;
  p = p * x2 + 62.0f / 2835.0f;
  p = p * x2 - 17.0f / 315.0f;
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 - 1.0f / 3.0f;
  const float series = x + x * x2 * p;
  const float ax = std::fabs(x);
  const float e = exp_approx(-2.0f * ax);
  const float closed = std::copysign((1.0f - e) / (1.0f + e), x);
  return ax < 0.5f ? series : closed;
}

template <class F>
LM_ALWAYS_INLINE F sigmoid(F z) {
  if constexpr (std::is_same_v<F, float>)
    return sigmoid_fast(z);
  else
    return F(1) / (F(1) + std::exp(-z));
}

template <class F>
LM_ALWAYS_INLINE F tanh_(F x) {
  if constexpr (std::is_same_v<F, float>)
    return tanh_fast(x);
  else
    return std::tanh(x);
}

// SiTU constants in F. `cap_b` false: B(b) = b.
template <class F>
struct Situ {
  F beta1, inv_beta1, beta2, inv_beta2;
  bool cap_b;
  explicit Situ(const GluParams& p)
      : beta1(static_cast<F>(p.beta1)),
        inv_beta1(static_cast<F>(1.0 / p.beta1)),
        beta2(static_cast<F>(p.beta2)),
        inv_beta2(p.beta2 > 0 && std::isfinite(p.beta2) ? static_cast<F>(1.0 / p.beta2) : F(0)),
        cap_b(p.beta2 > 0 && std::isfinite(p.beta2)) {}
};

// One row of each kernel; CapB is a template parameter so the inner loops carry no branch.
template <class F, bool CapB>
void situ_forward_row(const F* a, const F* b, F* h, int64_t I, const Situ<F>& c) {
#pragma omp simd
  for (int64_t j = 0; j < I; ++j) {
    const F A = c.beta1 * tanh_(a[j] * c.inv_beta1) * sigmoid(a[j]);
    const F B = CapB ? c.beta2 * tanh_(b[j] * c.inv_beta2) : b[j];
    h[j] = A * B;
  }
}

template <class F, bool CapB>
void situ_backward_row(const F* a, const F* b, const F* g, F* da, F* db, int64_t I, const Situ<F>& c) {
  // Each iteration reads a[j], b[j] before writing da[j], db[j] at the same places, and no iteration
  // touches another's elements: in place (dab == ab) is safe, also vectorised.
#pragma omp simd
  for (int64_t j = 0; j < I; ++j) {
    const F aj = a[j], bj = b[j];
    const F t = tanh_(aj * c.inv_beta1);
    const F s = sigmoid(aj);
    const F A = c.beta1 * t * s;
    const F dA = (F(1) - t * t) * s + c.beta1 * t * s * (F(1) - s);
    F B = bj, dB = F(1);
    if constexpr (CapB) {
      const F u = tanh_(bj * c.inv_beta2);
      B = c.beta2 * u;
      dB = F(1) - u * u;
    }
    da[j] = g[j] * B * dA;
    db[j] = g[j] * A * dB;
  }
}

template <class F>
void swiglu_forward_row(const F* a, const F* b, F* h, int64_t I) {
#pragma omp simd
  for (int64_t j = 0; j < I; ++j) h[j] = a[j] * sigmoid(a[j]) * b[j];
}

template <class F>
void swiglu_backward_row(const F* a, const F* b, const F* g, F* da, F* db, int64_t I) {
#pragma omp simd
  for (int64_t j = 0; j < I; ++j) {
    const F aj = a[j], bj = b[j];
    const F s = sigmoid(aj);
    da[j] = g[j] * bj * s * (F(1) + aj * (F(1) - s));
    db[j] = g[j] * aj * s;
  }
}

}  // namespace

template <class F>
void glu_forward(const F* ab, F* h, int64_t rows, int64_t I, const GluParams& p) {
  check_args("glu_forward", rows, I, p);
  const Situ<F> c(p);
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* a = ab + r * 2 * I;
        const F* b = a + I;
        F* hr = h + r * I;
        if (p.kind == GluKind::SwiGLU)
          swiglu_forward_row(a, b, hr, I);
        else if (c.cap_b)
          situ_forward_row<F, true>(a, b, hr, I, c);
        else
          situ_forward_row<F, false>(a, b, hr, I, c);
      },
      grain(I));
}

template <class F>
void glu_backward(const F* ab, const F* dh, F* dab, int64_t rows, int64_t I, const GluParams& p) {
  check_args("glu_backward", rows, I, p);
  const Situ<F> c(p);
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* a = ab + r * 2 * I;
        const F* b = a + I;
        const F* g = dh + r * I;
        F* da = dab + r * 2 * I;
        F* db = da + I;
        if (p.kind == GluKind::SwiGLU)
          swiglu_backward_row(a, b, g, da, db, I);
        else if (c.cap_b)
          situ_backward_row<F, true>(a, b, g, da, db, I, c);
        else
          situ_backward_row<F, false>(a, b, g, da, db, I, c);
      },
      grain(I));
}

#define LM_INSTANTIATE(F)                                                         \
  template void glu_forward<F>(const F*, F*, int64_t, int64_t, const GluParams&); \
  template void glu_backward<F>(const F*, const F*, F*, int64_t, int64_t, const GluParams&);
LM_INSTANTIATE(float)
LM_INSTANTIATE(double)
#undef LM_INSTANTIATE

}  // namespace lm::ops

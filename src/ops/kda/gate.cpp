// KDA forget gate (SPEC §2, §2.2; golden README "The computation").
// rows tokens (B*T), H heads, K key dim. x, g [rows, H, K]; A_log [H]; dt_bias [H*K] (viewed [H, K]).
//   z = x + dt_bias[h, k],  a = exp(A_log[h])
//   softplus form: g = -a * softplus(z)          (softplus(z) = z for z > 20, as torch)
//   bounded form:  g = lb * sigmoid(a * z)        (g in (lb, 0))
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {
namespace {

constexpr double kSoftplusThreshold = 20.0;  // torch F.softplus default: identity above it

template <class F>
F stable_sigmoid(F z) {
  // Never exponentiates a positive number, so it cannot overflow.
  if (z >= F(0)) return F(1) / (F(1) + std::exp(-z));
  const F e = std::exp(z);
  return e / (F(1) + e);
}

template <class F>
F softplus(F z) {
  return z > F(kSoftplusThreshold) ? z : std::log1p(std::exp(z));
}

// torch's softplus backward: slope 1 above the threshold, sigmoid(z) below.
template <class F>
F softplus_slope(F z) {
  return z > F(kSoftplusThreshold) ? F(1) : stable_sigmoid(z);
}

void check_gate_args(int64_t rows, int64_t H, int64_t K, const GateParams& p) {
  LM_CHECK(rows >= 0 && H > 0 && K > 0, "kda gate: bad shape rows={} H={} K={}", rows, H, K);
  LM_CHECK(p.form == GateForm::Softplus || p.lower_bound < 0.0,
           "kda gate: lower_bound must be < 0 for the bounded form, got {}", p.lower_bound);
}

}  // namespace

template <class F>
void gate_forward(const F* x, const F* A_log, const F* dt_bias, F* g, int64_t rows, int64_t H, int64_t K,
                  GateParams p) {
  check_gate_args(rows, H, K, p);
  const int64_t HK = H * K;
  const F lb = static_cast<F>(p.lower_bound);
  const bool bounded = p.form == GateForm::LowerBound;
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* xr = x + r * HK;
        F* gr = g + r * HK;
        for (int64_t h = 0; h < H; ++h) {
          const F a = std::exp(A_log[h]);
          for (int64_t c = h * K; c < (h + 1) * K; ++c) {
            const F z = xr[c] + dt_bias[c];
            gr[c] = bounded ? lb * stable_sigmoid(a * z) : -a * softplus(z);
          }
        }
      },
      64);
}

template <class F>
void gate_backward(const F* x, const F* A_log, const F* dt_bias, const F* dg, F* dx, F* dA_log, F* ddt_bias,
                   int64_t rows, int64_t H, int64_t K, GateParams p) {
  check_gate_args(rows, H, K, p);
  const int64_t HK = H * K;
  const F lb = static_cast<F>(p.lower_bound);
  const bool bounded = p.form == GateForm::LowerBound;
  // One task per channel (h, k): it owns dx[:, c] and ddt_bias[c], so no two tasks write the same
  // place; the dA_log contributions are kept per channel and summed over k afterwards (deterministic).
  std::vector<double> dA_part(static_cast<size_t>(HK), 0.0);
  parallel_for(
      HK,
      [&](int64_t c) {
        const int64_t h = c / K;
        const F a = std::exp(A_log[h]);
        double sum_dz = 0, sum_dA = 0;  // reductions over all tokens: accumulate in double even for float
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = r * HK + c;
          const F z = x[i] + dt_bias[c];
          F dz, dA;
          if (bounded) {
            // g = lb * s(a z): dg/dz = lb s (1 - s) a, dg/dA_log = dg/dz * z (since da/dA_log = a).
            const F s = stable_sigmoid(a * z);
            dz = dg[i] * lb * s * (F(1) - s) * a;
            dA = dz * z;
          } else {
            // g = -a softplus(z): dg/dz = -a softplus'(z), dg/dA_log = g.
            dz = -dg[i] * a * softplus_slope(z);
            dA = dg[i] * (-a * softplus(z));
          }
          dx[i] = dz;
          sum_dz += dz;
          sum_dA += dA;
        }
        ddt_bias[c] += static_cast<F>(sum_dz);
        dA_part[static_cast<size_t>(c)] = sum_dA;
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(rows, 1)));
  for (int64_t h = 0; h < H; ++h) {
    double s = 0;
    for (int64_t k = 0; k < K; ++k) s += dA_part[static_cast<size_t>(h * K + k)];
    dA_log[h] += static_cast<F>(s);
  }
}

#define LM_KDA_GATE_INST(F)                                                                                     \
  template void gate_forward<F>(const F*, const F*, const F*, F*, int64_t, int64_t, int64_t, GateParams);       \
  template void gate_backward<F>(const F*, const F*, const F*, const F*, F*, F*, F*, int64_t, int64_t, int64_t, \
                                 GateParams);
LM_KDA_GATE_INST(float)
LM_KDA_GATE_INST(double)
#undef LM_KDA_GATE_INST

}  // namespace lm::kda

// SiTU-GLU and SwiGLU: closed-form values, the |h| < 100 bound, float64 finite differences,
// float vs double, in-place backward.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "ops/glu/glu.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

double sig(double z) { return 1 / (1 + std::exp(-z)); }

// Straight from SPEC §4.
double situ_ref(double a, double b, double b1, double b2) {
  const double A = b1 * std::tanh(a / b1) * sig(a);
  const double B = (b2 > 0 && std::isfinite(b2)) ? b2 * std::tanh(b / b2) : b;
  return A * B;
}

const GluParams kCases[] = {GluParams::situ(4, 25), GluParams::situ(4, 0),
                            GluParams::situ(4, std::numeric_limits<double>::infinity()), GluParams::situ(1.5, 3),
                            GluParams::swiglu()};

const char* name(const GluParams& p) {
  if (p.kind == GluKind::SwiGLU) return "swiglu";
  return (p.beta2 > 0 && std::isfinite(p.beta2)) ? "situ" : "situ(no cap)";
}

}  // namespace

TEST(Glu, ForwardMatchesFormula) {
  const int64_t rows = 6, I = 11;
  const auto ab = randn(rows * 2 * I, 1, 6.0);
  for (const GluParams& p : kCases) {
    std::vector<double> h(rows * I);
    glu_forward(ab.data(), h.data(), rows, I, p);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < I; ++j) {
        const double a = ab[r * 2 * I + j], b = ab[r * 2 * I + I + j];
        const double ref = p.kind == GluKind::SwiGLU ? a * sig(a) * b : situ_ref(a, b, p.beta1, p.beta2);
        EXPECT_NEAR(h[r * I + j], ref, 1e-13 * (1 + std::fabs(ref))) << name(p);
      }
  }
}

TEST(Glu, SituOutputIsBoundedBy100) {
  // beta1 * beta2 = 100 bounds |h|: A in (-beta1*0.28, beta1), B in (-25, 25).
  // rows = 2, I = 2: row 0 = [a | b] = [1e4, -1e4 | 1e4, 3], row 1 = [1e4, -1e4 | -1e4, -7].
  const std::vector<float> ab{1e4f, -1e4f, 1e4f, 3.0f, 1e4f, -1e4f, -1e4f, -7.0f};
  std::vector<float> h(4);
  glu_forward(ab.data(), h.data(), 2, 2, GluParams::situ());
  for (float x : h) {
    EXPECT_TRUE(std::isfinite(x));
    EXPECT_LE(std::fabs(x), 100.0f);
  }
  EXPECT_NEAR(h[0], 100.0f, 1e-3f);   // a, b -> +inf
  EXPECT_NEAR(h[2], -100.0f, 1e-3f);  // a -> +inf, b -> -inf
  EXPECT_EQ(h[1], 0.0f);              // a -> -inf: sigmoid(a) = 0
  std::vector<double> z{0.0, 5.0};
  std::vector<double> hz(1);
  glu_forward(z.data(), hz.data(), 1, 1, GluParams::situ());
  EXPECT_EQ(hz[0], 0.0);  // tanh(0) = 0
}

TEST(Glu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, I = 17;
  for (const GluParams& p : kCases) {
    auto ab = randn(rows * 2 * I, 2, 3.0);  // wide: exercises the tanh/sigmoid saturation
    const auto G = randn(rows * I, 3);
    std::vector<double> h(rows * I), dab(ab.size());
    auto loss = [&] {
      glu_forward(ab.data(), h.data(), rows, I, p);
      return lm::testing::dot(h, G);
    };
    glu_backward(ab.data(), G.data(), dab.data(), rows, I, p);
    const double err = fd_check(ab, dab, loss, 80);
    EXPECT_LT(err, 1e-8) << name(p);
    std::printf("glu %s (beta1 %g beta2 %g) fd err %.2e\n", name(p), p.beta1, p.beta2, err);
  }
}

TEST(Glu, DerivativesMatchSpecClosedForm) {
  // SPEC §4: dA/da = (1 - t^2) s + beta1 t s (1 - s), dB/db = 1 - u^2.
  const double a = 1.3, b = -40.0, b1 = 4, b2 = 25;
  const std::vector<double> ab{a, b}, dh{1.0};
  std::vector<double> dab(2);
  glu_backward(ab.data(), dh.data(), dab.data(), 1, 1, GluParams::situ(b1, b2));
  const double t = std::tanh(a / b1), s = sig(a), u = std::tanh(b / b2);
  EXPECT_NEAR(dab[0], ((1 - t * t) * s + b1 * t * s * (1 - s)) * b2 * u, 1e-14);
  EXPECT_NEAR(dab[1], b1 * t * s * (1 - u * u), 1e-14);
}

TEST(Glu, FloatMatchesDoubleAndInPlace) {
  const int64_t rows = 33, I = 96;
  const auto abd = randn(rows * 2 * I, 4, 3.0);
  const auto dhd = randn(rows * I, 5);
  const std::vector<float> abf(abd.begin(), abd.end()), dhf(dhd.begin(), dhd.end());
  for (const GluParams& p : kCases) {
    std::vector<double> hd(rows * I), dabd(abd.size());
    std::vector<float> hf(rows * I), dabf(abd.size());
    glu_forward(abd.data(), hd.data(), rows, I, p);
    glu_forward(abf.data(), hf.data(), rows, I, p);
    glu_backward(abd.data(), dhd.data(), dabd.data(), rows, I, p);
    glu_backward(abf.data(), dhf.data(), dabf.data(), rows, I, p);
    const double eh = rel_rms_vec(hd, std::vector<double>(hf.begin(), hf.end()));
    const double eg = rel_rms_vec(dabd, std::vector<double>(dabf.begin(), dabf.end()));
    EXPECT_LT(eh, 1e-6) << name(p);
    EXPECT_LT(eg, 1e-6) << name(p);
    std::printf("glu %s f32 vs f64: h %.2e dab %.2e\n", name(p), eh, eg);
    auto inplace = abf;
    glu_backward(inplace.data(), dhf.data(), inplace.data(), rows, I, p);
    EXPECT_EQ(inplace, dabf) << name(p);
  }
}

TEST(Glu, FloatActivationsArePointwiseAccurate) {
  // float uses its own tanh/sigmoid (series near 0, exp-based beyond |x| = 0.5): sweep both arguments
  // through 0, the branch points (a/beta1 = +-0.5 at a = +-2, b/beta2 = +-0.5 at b = +-12.5) and saturation.
  const int64_t n = 4001;
  std::vector<double> abd(2 * n);
  for (int64_t j = 0; j < n; ++j) {
    abd[j] = -20.0 + 40.0 * static_cast<double>(j) / (n - 1);                   // a
    abd[n + j] = 60.0 - 120.0 * static_cast<double>((j * 7919) % n) / (n - 1);  // b, shuffled
  }
  abd[0] = 1e-7;  // tiny: relative accuracy near 0
  abd[n] = -3e-6;
  const std::vector<float> abf(abd.begin(), abd.end());
  const std::vector<double> abr(abf.begin(), abf.end());  // the float inputs, exactly, in double
  for (const GluParams& p : kCases) {
    std::vector<double> hd(n), dd(2 * n), ones(n, 1.0);
    std::vector<float> hf(n), df(2 * n), onesf(n, 1.0f);
    glu_forward(abr.data(), hd.data(), 1, n, p);
    glu_forward(abf.data(), hf.data(), 1, n, p);
    glu_backward(abr.data(), ones.data(), dd.data(), 1, n, p);
    glu_backward(abf.data(), onesf.data(), df.data(), 1, n, p);
    double worst_h = 0, worst_d = 0;
    for (int64_t j = 0; j < n; ++j) worst_h = std::max(worst_h, std::fabs(hf[j] - hd[j]) / (std::fabs(hd[j]) + 1e-30));
    // Derivatives: 1 - t^2 and 1 - u^2 cancel in saturation in any float implementation (autograd's
    // too; ~1e-7 absolute, then multiplied by |B| up to 60 in da), so they get an absolute-or-relative
    // bound. The tanh/sigmoid themselves are held to the strict bound on h above.
    for (int64_t j = 0; j < 2 * n; ++j)
      worst_d = std::max(worst_d, std::fabs(df[j] - dd[j]) / (std::fabs(dd[j]) + 1.0));
    EXPECT_LT(worst_h, 2e-6) << name(p);
    EXPECT_LT(worst_d, 5e-5) << name(p);
    std::printf("glu %s float pointwise: max rel err h %.2e, dab (abs or rel) %.2e\n", name(p), worst_h, worst_d);
  }
}

TEST(Glu, RejectsBadArguments) {
  std::vector<double> ab(4), h(2);
  EXPECT_THROW(glu_forward(ab.data(), h.data(), 1, 0, GluParams::situ()), Error);
  EXPECT_THROW(glu_forward(ab.data(), h.data(), 1, 2, GluParams::situ(0.0, 25)), Error);
}

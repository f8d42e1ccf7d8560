// GELU (Tanh and Erf) forward and backward on the GPU against the CPU fp32 definition (ops/gelu). The GPU reads
// a in fp32 and dg in fp32 or bf16 (a bf16 dg is rounded on the host before the reference). Skips without a
// CUDA device.
//
// Legend: n elements.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/gelu/cuda/gelu_cuda.hpp"
#include "ops/gelu/gelu.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {
// Fraction of elements whose bf16 value x equals bf16(ref) exactly. The two GELU kinds differ by ~1e-4 in relative
// RMS, below any bf16 tolerance, but their bf16 roundings disagree on a quarter of these inputs: this metric,
// not the RMS, tells the kinds apart.
double exact_bf16(const Vec& ref, const Vec& x) {
  size_t same = 0;
  for (size_t i = 0; i < ref.size(); ++i) same += f32_to_bf16(ref[i]) == f32_to_bf16(x[i]);
  return ref.empty() ? 1.0 : double(same) / double(ref.size());
}
constexpr double kMinExact = 0.95;  // the right kind: 1.000 (tanh) and 0.989 (erf: erff vs std::erf near 0) on an H200
}  // namespace

TEST(OpsCuda, GeluForwardBackward) {
  REQUIRE_GPU();
  const int64_t n = 20011;  // not a multiple of the block
  // Wide enough to reach both tails (tanh and erf saturate near |x| ~ 4).
  const Vec a = randn(size_t(n), 71, 3.0);
  const Vec dg = round_bf16(randn(size_t(n), 72, 1.0));
  for (const ops::GeluKind kind : {ops::GeluKind::Tanh, ops::GeluKind::Erf}) {
    const char* kn = kind == ops::GeluKind::Tanh ? "tanh" : "erf";
    Vec g_ref(static_cast<size_t>(n)), da_ref(static_cast<size_t>(n));
    ops::gelu_forward<float>(a.data(), g_ref.data(), n, kind);
    ops::gelu_backward<float>(a.data(), dg.data(), da_ref.data(), n, kind);

    Dev ga(size_t(n) * 4), gg(size_t(n) * 2), gdg32(size_t(n) * 4), gdg16(size_t(n) * 2), gda(size_t(n) * 2);
    up(ga, a), up(gdg32, dg), up_bf16(gdg16, dg);
    oc::gelu_forward(ga.f(), gg.p, n, kind);
    const Vec g = down_bf16(gg, size_t(n));
    const double eg = err(g_ref, g);
    oc::gelu_backward(ga.f(), gdg32.p, DType::F32, gda.p, n, kind);
    const double e32 = err(da_ref, down_bf16(gda, size_t(n)));
    oc::gelu_backward(ga.f(), gdg16.p, DType::BF16, gda.p, n, kind);
    const double e16 = err(da_ref, down_bf16(gda, size_t(n)));
    oc::gelu_backward(ga.f(), gdg16.p, DType::BF16, gdg16.p, n, kind);  // in place: da == dg
    const Vec da_ip = down_bf16(gdg16, size_t(n));
    const double eip = err(da_ref, da_ip);
    kc::synchronize();
    const double xg = exact_bf16(g_ref, g), xd = exact_bf16(da_ref, da_ip);
    std::printf("GELU %s: g %.2e, da (dg f32) %.2e, (dg bf16) %.2e, in place %.2e; exact bf16: g %.4f, da %.4f\n",
                kn, eg, e32, e16, eip, xg, xd);
    EXPECT_GE(xg, kMinExact) << kn;
    EXPECT_GE(xd, kMinExact) << kn;
    EXPECT_LE(eg, kTolBf16) << kn;
    EXPECT_LE(e32, kTolBf16) << kn;
    EXPECT_LE(e16, kTolBf16) << kn;
    EXPECT_LE(eip, kTolBf16) << kn;
  }
  // The test's power: the other kind's values miss kMinExact by far, so a kernel computing the wrong kind fails.
  Vec gt(static_cast<size_t>(n)), ge(static_cast<size_t>(n));
  ops::gelu_forward<float>(a.data(), gt.data(), n, ops::GeluKind::Tanh);
  ops::gelu_forward<float>(a.data(), ge.data(), n, ops::GeluKind::Erf);
  Vec dt(static_cast<size_t>(n)), de(static_cast<size_t>(n));
  ops::gelu_backward<float>(a.data(), dg.data(), dt.data(), n, ops::GeluKind::Tanh);
  ops::gelu_backward<float>(a.data(), dg.data(), de.data(), n, ops::GeluKind::Erf);
  const double xf = exact_bf16(ge, gt), xb = exact_bf16(de, dt);
  std::printf("GELU tanh vs erf (CPU): rel RMS forward %.2e, backward %.2e; exact bf16 forward %.4f, backward %.4f\n",
              err(ge, gt), err(de, dt), xf, xb);
  EXPECT_LT(xf, kMinExact);
  EXPECT_LT(xb, kMinExact);
}

TEST(OpsCuda, GeluRejectsBadArguments) {
  REQUIRE_GPU();
  EXPECT_THROW(oc::gelu_forward(nullptr, nullptr, -1, ops::GeluKind::Tanh), lm::Error);
  Dev a(64), d(64);
  EXPECT_THROW(oc::gelu_backward(a.f(), d.p, DType::F16, d.p, 8, ops::GeluKind::Erf), lm::Error);
}

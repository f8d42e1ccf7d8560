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
    const double eg = err(g_ref, down_bf16(gg, size_t(n)));
    oc::gelu_backward(ga.f(), gdg32.p, DType::F32, gda.p, n, kind);
    const double e32 = err(da_ref, down_bf16(gda, size_t(n)));
    oc::gelu_backward(ga.f(), gdg16.p, DType::BF16, gda.p, n, kind);
    const double e16 = err(da_ref, down_bf16(gda, size_t(n)));
    oc::gelu_backward(ga.f(), gdg16.p, DType::BF16, gdg16.p, n, kind);  // in place: da == dg
    const double eip = err(da_ref, down_bf16(gdg16, size_t(n)));
    kc::synchronize();
    std::printf("GELU %s: g %.2e, da (dg f32) %.2e, (dg bf16) %.2e, in place %.2e\n", kn, eg, e32, e16, eip);
    EXPECT_LE(eg, kTolBf16) << kn;
    EXPECT_LE(e32, kTolBf16) << kn;
    EXPECT_LE(e16, kTolBf16) << kn;
    EXPECT_LE(eip, kTolBf16) << kn;
  }
  // The two kinds differ by more than the tolerance on these inputs: a kernel computing the wrong kind fails.
  Vec gt(static_cast<size_t>(n)), ge(static_cast<size_t>(n));
  ops::gelu_forward<float>(a.data(), gt.data(), n, ops::GeluKind::Tanh);
  ops::gelu_forward<float>(a.data(), ge.data(), n, ops::GeluKind::Erf);
  Vec dt(static_cast<size_t>(n)), de(static_cast<size_t>(n));
  ops::gelu_backward<float>(a.data(), dg.data(), dt.data(), n, ops::GeluKind::Tanh);
  ops::gelu_backward<float>(a.data(), dg.data(), de.data(), n, ops::GeluKind::Erf);
  std::printf("GELU tanh vs erf (CPU): forward %.2e, backward %.2e\n", err(ge, gt), err(de, dt));
}

TEST(OpsCuda, GeluRejectsBadArguments) {
  REQUIRE_GPU();
  EXPECT_THROW(oc::gelu_forward(nullptr, nullptr, -1, ops::GeluKind::Tanh), lm::Error);
  Dev a(64), d(64);
  EXPECT_THROW(oc::gelu_backward(a.f(), d.p, DType::F16, d.p, 8, ops::GeluKind::Erf), lm::Error);
}

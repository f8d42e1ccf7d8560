// Bilinear resize (align_corners=False) on the GPU against the CPU fp32 path (ops/bilinear): up, down, mixed and
// equal sizes; the backward accumulates onto a nonzero dsrc and is deterministic. Skips without a CUDA device.
//
// Legend: Hi×Wi -> Ho×Wo grids of C channels.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/bilinear/bilinear.hpp"
#include "ops/bilinear/cuda/bilinear_cuda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

TEST(OpsCuda, BilinearForwardBackward) {
  REQUIRE_GPU();
  struct Case {
    int64_t Hi, Wi, Ho, Wo;
  };
  // up, down, mixed (one axis each way, one axis kept), equal sizes, the K3 table (64×64) to a small grid, 1×1.
  const Case cases[] = {{8, 8, 12, 20}, {16, 12, 5, 7}, {6, 10, 15, 10}, {7, 9, 7, 9}, {64, 64, 18, 26}, {1, 1, 3, 2}};
  const int64_t C = 37;
  uint64_t seed = 900;
  for (const Case& c : cases) {
    const size_t ni = size_t(c.Hi * c.Wi * C), no = size_t(c.Ho * c.Wo * C);
    const Vec src = randn(ni, ++seed), ddst = randn(no, ++seed), dsrc0 = randn(ni, ++seed);
    Vec dst_ref(no), dsrc_ref = dsrc0;
    ops::bilinear_resize_forward<float>(src.data(), c.Hi, c.Wi, C, dst_ref.data(), c.Ho, c.Wo);
    ops::bilinear_resize_backward<float>(ddst.data(), c.Hi, c.Wi, C, c.Ho, c.Wo, dsrc_ref.data());

    Dev gsrc(ni * 4), gdst(no * 4), gddst(no * 4), gdsrc(ni * 4);
    up(gsrc, src), up(gddst, ddst), up(gdsrc, dsrc0);
    oc::bilinear_resize_forward(gsrc.f(), c.Hi, c.Wi, C, gdst.f(), c.Ho, c.Wo);
    const Vec dst = down<float>(gdst, no);
    oc::bilinear_resize_backward(gddst.f(), c.Hi, c.Wi, C, c.Ho, c.Wo, gdsrc.f());
    const std::vector<uint8_t> first = bytes_of(gdsrc, ni * 4);
    const Vec dsrc = down<float>(gdsrc, ni);
    // Again from the same start: identical bits.
    up(gdsrc, dsrc0);
    oc::bilinear_resize_backward(gddst.f(), c.Hi, c.Wi, C, c.Ho, c.Wo, gdsrc.f());
    const bool same = bytes_of(gdsrc, ni * 4) == first;
    kc::synchronize();
    const double ef = err(dst_ref, dst);
    const double eb = err(dsrc_ref, dsrc);
    const double ed = err(minus(dsrc_ref, dsrc0), minus(dsrc, dsrc0));  // the added part alone
    std::printf("bilinear %lldx%lld -> %lldx%lld: forward %.2e, backward %.2e (added part %.2e), repeat %s\n",
                (long long)c.Hi, (long long)c.Wi, (long long)c.Ho, (long long)c.Wo, ef, eb, ed,
                same ? "identical" : "DIFFERS");
    EXPECT_LE(ef, kTolF32);
    EXPECT_LE(eb, kTolF32);
    EXPECT_LE(ed, kTolF32);
    EXPECT_TRUE(same);
  }
}

TEST(OpsCuda, BilinearRejectsEmptyGrids) {
  REQUIRE_GPU();
  Dev a(64), b(64);
  EXPECT_THROW(oc::bilinear_resize_forward(a.f(), 0, 2, 1, b.f(), 2, 2), lm::Error);
  EXPECT_THROW(oc::bilinear_resize_backward(a.f(), 2, 2, 1, 2, 0, b.f()), lm::Error);
}

// Bilinear resize (align_corners = False): PyTorch's values up and down, the identity at equal size, float vs
// double, and the backward as the exact transpose of the forward.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.hpp"
#include "ops/bilinear/bilinear.hpp"
#include "tests/testing.hpp"

using namespace lm::ops;
using lm::testing::randn;

TEST(Bilinear, KnownValues) {
  // F.interpolate([[1, 2], [3, 4]], size=(4, 4), mode="bilinear", align_corners=False).
  const std::vector<double> src{1, 2, 3, 4};
  std::vector<double> dst(16);
  bilinear_resize_forward(src.data(), 2, 2, 1, dst.data(), 4, 4);
  const std::vector<double> ref{1.0, 1.25, 1.75, 2.0, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3.0, 3.25, 3.75, 4.0};
  for (int i = 0; i < 16; ++i) EXPECT_DOUBLE_EQ(dst[i], ref[i]) << i;
  // Down: a 1x5 ramp 0..4 to 1x3 reads sources 1/3, 2, 11/3 (no antialias).
  const std::vector<double> ramp{0, 1, 2, 3, 4};
  std::vector<double> d3(3);
  bilinear_resize_forward(ramp.data(), 1, 5, 1, d3.data(), 1, 3);
  EXPECT_NEAR(d3[0], 1.0 / 3.0, 1e-15);
  EXPECT_NEAR(d3[1], 2.0, 1e-15);
  EXPECT_NEAR(d3[2], 11.0 / 3.0, 1e-15);
}

TEST(Bilinear, IdentityFloatAndTranspose) {
  const int64_t C = 70;  // more than one channel block in the backward
  const auto src = randn<double>(4 * 4 * C, 1);
  std::vector<double> same(src.size());
  bilinear_resize_forward(src.data(), 4, 4, C, same.data(), 4, 4);
  EXPECT_EQ(same, src);
  for (auto [Ho, Wo] : {std::pair<int64_t, int64_t>{6, 8}, {2, 6}, {3, 3}, {9, 1}}) {
    std::vector<double> dst(Ho * Wo * C);
    bilinear_resize_forward(src.data(), 4, 4, C, dst.data(), Ho, Wo);
    const auto g = randn<double>(dst.size(), 2);
    std::vector<double> gs(src.size(), 0.0);
    bilinear_resize_backward(g.data(), 4, 4, C, Ho, Wo, gs.data());
    EXPECT_NEAR(lm::testing::dot(dst, g), lm::testing::dot(src, gs), 1e-11) << Ho << "x" << Wo;
    std::vector<float> sf(src.begin(), src.end()), df(dst.size());
    bilinear_resize_forward(sf.data(), 4, 4, C, df.data(), Ho, Wo);
    EXPECT_LT(lm::testing::rel_rms_vec(dst, std::vector<double>(df.begin(), df.end())), 1e-7);
  }
  EXPECT_THROW(bilinear_resize_forward(src.data(), 4, 4, C, same.data(), 0, 4), lm::Error);
}

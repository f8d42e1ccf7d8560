#include <gtest/gtest.h>

#include <cmath>

#include "core/rng.hpp"
#include "core/tensor.hpp"

using namespace lm;

TEST(Tensor, ViewsShareStorageAndCopiesDoNot) {
  Tensor t = Tensor::empty({2, 3, 4});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % kAlign, 0u);
  Tensor s = t.select(1, 2);  // [2, 4]
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.item(0), 8.0);
  EXPECT_EQ(s.item(5), 21.0);
  Tensor tr = t.transpose(0, 2).contiguous();  // [4, 3, 2]
  EXPECT_EQ(tr.item(1), 12.0);
  s.fill(-1.0);
  EXPECT_EQ(t.item(8), -1.0);
  EXPECT_EQ(tr.item(8), 5.0);  // tr[1,1,0] = t[0,1,1]: the copy did not change
  EXPECT_THROW(t.view({5, 5}), Error);
  EXPECT_EQ(t.view({-1, 4}).dim(0), 6);
  EXPECT_THROW(t.slice(0, 1, 3), Error);
  EXPECT_THROW((void)t.data<double>(), Error);
}

TEST(Tensor, DtypeConversionsRoundTrip) {
  Tensor t = Tensor::from_vector<float>({1.0f, -2.5f, 3.140625f, 65504.0f, 1e-8f, 0.0f}, {6});
  Tensor b = t.to(DType::BF16).to(DType::F32);
  Tensor h = t.to(DType::F16).to(DType::F32);
  EXPECT_EQ(b.data<float>()[1], -2.5f);
  EXPECT_EQ(b.data<float>()[2], 3.140625f);
  EXPECT_EQ(h.data<float>()[3], 65504.0f);
  EXPECT_NEAR(h.data<float>()[4], 0.0f, 1e-7f);
  // bf16 round-to-nearest-even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and rounds to even (1).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (float x : {0.1f, -7.25f, 1000.5f, 3.0e-5f, 6.0e-8f}) EXPECT_NEAR(f16_to_f32(f32_to_f16(x)), x, std::fabs(x) * 1e-3f + 6e-8f);
}

TEST(Tensor, RelRmsIsTheGoldenMetric) {
  Tensor a = Tensor::from_vector<float>({3, 4}, {2});
  Tensor b = Tensor::from_vector<float>({3, 4.5f}, {2});
  EXPECT_NEAR(rel_rms(a, b), 0.5 / 5.0, 1e-12);
  Tensor n = Tensor::from_vector<float>({3, NAN}, {2});
  EXPECT_FALSE(rel_rms(a, n) < 1.0);
}

TEST(Rng, PhiloxIsCounterBasedAndWellSpread) {
  Rng r{1234, 7};
  EXPECT_EQ(r.bits(5).v[0], (Rng{1234, 7}).bits(5).v[0]);
  EXPECT_NE(r.bits(5).v[0], r.bits(6).v[0]);
  EXPECT_NE(r.bits(5).v[0], (Rng{1235, 7}).bits(5).v[0]);
  double mean = 0, var = 0, umean = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal(i);
    mean += x;
    var += x * x;
    const float u = r.uniform(i);
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    umean += u;
  }
  EXPECT_NEAR(mean / n, 0.0, 0.01);
  EXPECT_NEAR(var / n, 1.0, 0.01);
  EXPECT_NEAR(umean / n, 0.5, 0.005);
}

// Philox4x32-10 known-answer test (Random123 kat_vectors: counter and key all zero).
TEST(Rng, PhiloxKnownAnswer) {
  Philox4 p = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(p.v[0], 0x6627e8d5u);
  EXPECT_EQ(p.v[1], 0xe169c58du);
  EXPECT_EQ(p.v[2], 0xbc57ac4cu);
  EXPECT_EQ(p.v[3], 0x9b00dbd8u);
}

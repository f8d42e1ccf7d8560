// Full (non-causal) varlen attention: the tiled GEMM path against the definition (several query tiles, an
// empty and a one-token sequence, strided q/k/v as slices of one fused projection), float vs double, the
// backward against float64 finite differences, and no attention across sequence boundaries.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "ops/full_attention/full_attention.hpp"
#include "tests/testing.hpp"

using namespace lm::ops;
using lm::testing::randn;

namespace {
struct Case {
  std::vector<int64_t> cu;
  int64_t H, D;
  FullAttnDims dims() const {
    FullAttnDims d;
    d.H = H, d.D = D, d.cu_seqlens = cu.data(), d.N = static_cast<int64_t>(cu.size()) - 1;
    d.ld_qkv = 3 * H * D, d.ld_o = H * D;
    return d;
  }
};
}  // namespace

TEST(FullAttention, TiledMatchesReference) {
  const Case c{{0, 150, 150, 151, 200}, 3, 8};  // 150 rows = three query tiles; an empty and a 1-token sequence
  const FullAttnDims d = c.dims();
  const int64_t rows = d.rows(), HD = c.H * c.D;
  const auto qkv = randn<double>(rows * 3 * HD, 1);
  const double scale = 1.0 / std::sqrt(8.0);
  std::vector<double> o_ref(rows * HD), lse_ref(rows * c.H), o(rows * HD), lse(rows * c.H);
  full_attention_reference(qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD, o_ref.data(), lse_ref.data(), d, scale);
  full_attention_forward(qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD, o.data(), lse.data(), d, scale);
  EXPECT_LT(lm::testing::rel_rms_vec(o_ref, o), 1e-14);
  EXPECT_LT(lm::testing::rel_rms_vec(lse_ref, lse), 1e-14);
  std::vector<float> qf(qkv.begin(), qkv.end()), of(o.size()), lf(lse.size());
  full_attention_forward(qf.data(), qf.data() + HD, qf.data() + 2 * HD, of.data(), lf.data(), d, static_cast<float>(scale));
  EXPECT_LT(lm::testing::rel_rms_vec(o_ref, std::vector<double>(of.begin(), of.end())), 1e-6);
}

TEST(FullAttention, SequencesDoNotSeeEachOther) {
  const Case c{{0, 5, 12}, 1, 4};
  const FullAttnDims d = c.dims();
  auto qkv = randn<double>(12 * 12, 2);
  std::vector<double> o1(12 * 4), o2(12 * 4), lse(12);
  full_attention_forward(qkv.data(), qkv.data() + 4, qkv.data() + 8, o1.data(), lse.data(), d, 0.5);
  for (int64_t r = 5; r < 12; ++r)
    for (int64_t j = 0; j < 12; ++j) qkv[r * 12 + j] += 3.0;  // change the second sequence only
  full_attention_forward(qkv.data(), qkv.data() + 4, qkv.data() + 8, o2.data(), lse.data(), d, 0.5);
  for (int64_t i = 0; i < 5 * 4; ++i) EXPECT_EQ(o1[i], o2[i]);
}

TEST(FullAttention, BackwardMatchesFiniteDifferences) {
  const Case c{{0, 70, 70, 79}, 2, 4};  // 70 rows: two query tiles
  const FullAttnDims d = c.dims();
  const int64_t rows = d.rows(), HD = c.H * c.D;
  auto qkv = randn<double>(rows * 3 * HD, 3);
  const auto dout = randn<double>(rows * HD, 4);
  const double scale = 0.5;
  std::vector<double> o(rows * HD), lse(rows * c.H), dqkv(qkv.size(), 0.0);
  full_attention_forward(qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD, o.data(), lse.data(), d, scale);
  full_attention_backward(qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD, o.data(), lse.data(), dout.data(),
                          dqkv.data(), dqkv.data() + HD, dqkv.data() + 2 * HD, d, scale);
  auto loss = [&] {
    full_attention_forward(qkv.data(), qkv.data() + HD, qkv.data() + 2 * HD, o.data(), lse.data(), d, scale);
    return lm::testing::dot(o, dout);
  };
  EXPECT_LT(lm::testing::fd_check(qkv, dqkv, loss, 120, 1e-6), 1e-7);
  // float backward against the double one.
  std::vector<float> qf(qkv.begin(), qkv.end()), of(o.size()), lf(lse.size()), df(dout.begin(), dout.end()),
      dqf(qkv.size());
  full_attention_forward(qf.data(), qf.data() + HD, qf.data() + 2 * HD, of.data(), lf.data(), d, 0.5f);
  full_attention_backward(qf.data(), qf.data() + HD, qf.data() + 2 * HD, of.data(), lf.data(), df.data(), dqf.data(),
                          dqf.data() + HD, dqf.data() + 2 * HD, d, 0.5f);
  EXPECT_LT(lm::testing::rel_rms_vec(dqkv, std::vector<double>(dqf.begin(), dqf.end())), 1e-5);
}

TEST(FullAttention, BadDimsAreErrors) {
  const std::vector<int64_t> cu{0, 5, 3};
  FullAttnDims d;
  d.H = 1, d.D = 4, d.cu_seqlens = cu.data(), d.N = 2;
  EXPECT_THROW(check_full_attn_dims(d), lm::Error);
  d.cu_seqlens = nullptr;
  EXPECT_THROW(check_full_attn_dims(d), lm::Error);
}

// The LM head + cross-entropy (forward and backward) on the GPU against the CPU fp32 definition. Inputs the GPU
// reads in bf16 are rounded to bf16 on the host before the CPU reference. Skips without a CUDA device.
//
// Legend: T tokens, d hidden, V vocabulary, Bt token block.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

TEST(OpsBwdCuda, CrossEntropy) {
  REQUIRE_GPU();
  struct CC {
    int64_t T, d, V, Bt;
    int ignore_every;  // every n-th target ignored (0: none)
  };
  // V = 1003: not a multiple of the row kernel's vector width nor of 8 (padded scratch rows); T not a multiple
  // of Bt; Bt 0 (auto: one block here); a block of one token.
  for (const CC cc : {CC{300, 64, 1003, 128, 7}, CC{257, 128, 4096, 0, 0}, CC{40, 32, 515, 1, 3}}) {
    const Vec h = round_bf16(lm::testing::randn<float>(size_t(cc.T * cc.d), uint64_t(cc.V + 1), 1.0));
    const Vec W = round_bf16(lm::testing::randn<float>(size_t(cc.V * cc.d), uint64_t(cc.V + 2), 0.15));
    const Vec u = lm::testing::randu<float>(size_t(cc.T), uint64_t(cc.V + 3), 0.0, 1.0);
    std::vector<int32_t> tg(size_t(cc.T));
    for (int64_t t = 0; t < cc.T; ++t)
      tg[size_t(t)] = (cc.ignore_every && t % cc.ignore_every == 1)
                          ? -100
                          : std::min<int32_t>(int32_t(u[size_t(t)] * float(cc.V)), int32_t(cc.V - 1));
    const int64_t n_valid = ops::cross_entropy_count_valid(tg.data(), cc.T, cc.V);
    const float scale = 1.f / float(n_valid);
    const Vec dW0 = lm::testing::randn<float>(size_t(cc.V * cc.d), uint64_t(cc.V + 4), 1e-3);  // dW accumulates
    Vec dh_ref(size_t(cc.T * cc.d)), dW_ref = dW0;
    const ops::CeStats st = ops::cross_entropy_forward_backward<float>(h.data(), W.data(), tg.data(), cc.T, cc.d, cc.V,
                                                                       scale, dh_ref.data(), dW_ref.data());

    Dev gh(h.size() * 2), gW(W.size() * 2), gt(tg.size() * 4), gdh(dh_ref.size() * 4), gdW(dW0.size() * 4);
    up_bf16(gh, h), up_bf16(gW, W), up(gt, tg), up(gdW, dW0);
    const oc::CeResult r = oc::cross_entropy_forward_backward(gh.p, gW.p, gt.i(), cc.T, cc.d, cc.V, scale, gdh.f(),
                                                              gdW.f(), cc.Bt);
    const Vec dh = down<float>(gdh, dh_ref.size()), dW = down<float>(gdW, dW0.size());
    const oc::CeResult rf = oc::cross_entropy_forward(gh.p, gW.p, gt.i(), cc.T, cc.d, cc.V, cc.Bt);
    kc::synchronize();

    EXPECT_EQ(r.n_valid, st.n_valid);
    EXPECT_EQ(rf.n_valid, st.n_valid);
    const double mean_ref = st.mean(), mean = r.loss_sum / double(r.n_valid);
    const double e_loss = std::fabs(mean - mean_ref) / std::fabs(mean_ref);
    const double e_lossf = std::fabs(rf.loss_sum / double(rf.n_valid) - mean_ref) / std::fabs(mean_ref);
    const double e_dh = err(dh_ref, dh), e_dW = err(minus(dW_ref, dW0), minus(dW, dW0));
    std::printf("CE T%lld d%lld V%lld Bt%lld: loss %.6f (ref %.6f) rel %.1e fwd-only %.1e, dh %.2e, dW %.2e\n",
                (long long)cc.T, (long long)cc.d, (long long)cc.V, (long long)cc.Bt, mean, mean_ref, e_loss, e_lossf,
                e_dh, e_dW);
    EXPECT_LE(e_loss, 1e-3);
    EXPECT_LE(e_lossf, 1e-3);
    EXPECT_EQ(r.loss_sum, rf.loss_sum);  // same logits, same row kernel, fixed summation order
    EXPECT_LE(e_dh, 1e-2);
    EXPECT_LE(e_dW, 1e-2);
    for (int64_t t = 0; t < cc.T; ++t) {
      if (tg[size_t(t)] >= 0) continue;
      for (int64_t c = 0; c < cc.d; ++c) ASSERT_EQ(dh[size_t(t * cc.d + c)], 0.f) << "ignored token " << t;
    }
  }
}

TEST(OpsBwdCuda, CrossEntropyAllIgnored) {
  REQUIRE_GPU();
  const int64_t T = 9, d = 16, V = 40;
  const Vec h = round_bf16(lm::testing::randn<float>(size_t(T * d), 5, 1.0));
  const Vec W = round_bf16(lm::testing::randn<float>(size_t(V * d), 6, 0.1));
  const std::vector<int32_t> tg(size_t(T), -100);
  Dev gh(h.size() * 2), gW(W.size() * 2), gt(tg.size() * 4), gdh(size_t(T * d) * 4), gdW(size_t(V * d) * 4);
  up_bf16(gh, h), up_bf16(gW, W), up(gt, tg);
  kc::device_fill(gdW.p, 0, size_t(V * d) * 4);
  const oc::CeResult r = oc::cross_entropy_forward_backward(gh.p, gW.p, gt.i(), T, d, V, 1.f, gdh.f(), gdW.f(), 4);
  EXPECT_EQ(r.n_valid, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  for (float v : down<float>(gdh, size_t(T * d))) ASSERT_EQ(v, 0.f);
  for (float v : down<float>(gdW, size_t(V * d))) ASSERT_EQ(v, 0.f);
}

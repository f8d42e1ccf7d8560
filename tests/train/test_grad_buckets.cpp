// The gradient buckets of GPU data parallel (train/cuda/data_parallel.hpp, plan_buckets): they tile the trainable
// range with boundaries on the 64-element quantum, stay within the target size where a quantum allows, follow the
// stage runs of the flat layout, and each is sent at the least stage of the parameters it holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "core/error.hpp"
#include "train/cuda/data_parallel.hpp"

namespace lm::train::cuda {
namespace {

// Checks the invariants of a plan of `params` over [0, end) with `target`.
void check_plan(const std::vector<GradRange>& params, size_t end, size_t target) {
  const std::vector<GradRange> b = plan_buckets(params, end, target);
  ASSERT_FALSE(b.empty());
  size_t at = 0;
  for (const GradRange& x : b) {
    EXPECT_EQ(x.begin, at);
    EXPECT_GT(x.end, x.begin);
    EXPECT_EQ(x.begin % kBucketQuantum, 0u);
    EXPECT_EQ(x.end % kBucketQuantum, 0u);
    EXPECT_LE(x.end - x.begin, std::max(target / kBucketQuantum * kBucketQuantum, kBucketQuantum));
    int64_t least = INT64_MAX;
    for (const GradRange& p : params)
      if (p.begin < x.end && p.end > x.begin) least = std::min(least, p.stage);
    EXPECT_EQ(x.stage, least == INT64_MAX ? -1 : least) << "bucket [" << x.begin << ", " << x.end << ")";
    at = x.end;
  }
  EXPECT_EQ(at, end);
}

TEST(GradBuckets, TileTheRangeAndTakeTheLeastStage) {
  // A layout like the GPU model's: layers 0..3 (one big matrix each, then two small tensors), the LM head (stage 4),
  // then the small non-decaying tensors of every layer and the embedding (stage −1); 64-aligned starts, gaps between.
  std::vector<GradRange> p;
  size_t at = 0;
  auto add = [&](size_t n, int64_t stage) {
    p.push_back({at, at + n, stage});
    at = (at + n + 63) / 64 * 64;
  };
  for (int64_t l = 0; l < 4; ++l) add(100000 + size_t(l) * 999, l), add(37, l), add(300, l);
  add(50000, 4);
  add(20000, -1);
  for (int64_t l = 0; l < 4; ++l) add(128, l);
  const size_t end = at;
  for (size_t target : {size_t(64), size_t(1000), size_t(30000), size_t(1) << 20}) check_plan(p, end, target);
  // Big runs split into pieces of at most the target; small neighbours merged: far fewer buckets than tensors.
  const auto b = plan_buckets(p, end, 30000);
  EXPECT_GE(b.size(), 4u * 4u);
  EXPECT_LT(plan_buckets(p, end, size_t(1) << 20).size(), p.size());
  // The last layer's big matrix is a run of stage 3: its pieces go out at stage 3, before layer 2's.
  EXPECT_EQ(b[0].stage, 0);
  bool stage3 = false;
  for (const GradRange& x : b) stage3 |= x.stage == 3;
  EXPECT_TRUE(stage3);
}

TEST(GradBuckets, AStageChangeInsideAQuantumTakesTheLesserStage) {
  // Tensors of stages 5 and 2 meet at element 100 (no alignment between them): the quantum holding both goes out at 2.
  const std::vector<GradRange> p{{0, 100, 5}, {100, 1000, 2}, {1024, 2048, 7}};
  check_plan(p, 2048, 64);
  const auto b = plan_buckets(p, 2048, 64);
  EXPECT_EQ(b[1].begin, 64u);
  EXPECT_EQ(b[1].stage, 2);
  EXPECT_EQ(b.back().stage, 7);
  EXPECT_THROW(plan_buckets(p, 2050, 64), Error);  // (the trainable range ends on the quantum)
}

TEST(GradBuckets, PaddingAloneGoesOutAtTheEnd) {
  const std::vector<GradRange> p{{0, 64, 3}};
  const auto one = plan_buckets(p, 256, 1024);
  ASSERT_EQ(one.size(), 1u);  // (the padding after the last tensor belongs to its run)
  EXPECT_EQ(one[0].stage, 3);
  const auto four = plan_buckets(p, 256, 64);
  ASSERT_EQ(four.size(), 4u);
  EXPECT_EQ(four[0].stage, 3);
  for (size_t i = 1; i < 4; ++i) EXPECT_EQ(four[i].stage, -1);
  check_plan(p, 256, 64);
  check_plan({}, 128, 64);
}

}  // namespace
}  // namespace lm::train::cuda

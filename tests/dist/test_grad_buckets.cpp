// Gradient buckets that overlap the backward (dist::GradBuckets through the CPU engine): with the step's micro-batch
// count known, the last backward starts each bucket's non-blocking all-reduce once its gradients are final; the
// summed gradients equal those of the reduction after the backward and of one all-reduce per parameter (bit for bit
// at 2 ranks, within 1e-6 relative RMS at 4), and buckets are under way before the backward ends. The step's wait for
// the reduction, with and without the overlap, is printed (a measurement, not a check). Alone, or under mpirun with
// 2 and 4 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "dist/comm.hpp"
#include "dist/grad_buckets.hpp"
#include "model/model.hpp"
#include "train/engine.hpp"
#include "testing.hpp"
#include "train/tiny_run.hpp"

using namespace lm;
using lm::testing::rel_rms_vec;

namespace {

// Two sequences of 64 random tokens, different on every rank.
train::Batch random_batch(int64_t V, uint64_t seed) {
  train::Batch b;
  b.seqs = 2, b.seq_len = 64;
  const Rng r{seed, 5};
  for (int64_t i = 0; i < b.seqs * b.seq_len; ++i) b.ids.push_back(int32_t(r.bits(uint64_t(i)).v[0] % V));
  for (int64_t i = 0; i < b.seqs * b.seq_len; ++i)
    b.targets.push_back((i + 1) % b.seq_len ? b.ids[size_t(i + 1)] : -100);
  b.cu_seqlens = {0, b.seq_len, 2 * b.seq_len};
  return b;
}

std::vector<float> grads(model::Model<float>& m) {
  std::vector<float> g;
  for (auto& p : m.params().all())
    if (p.g()) g.insert(g.end(), p.g(), p.g() + p.value.numel());
  return g;
}

}  // namespace

TEST(GradientBuckets, TheReductionRunsUnderTheBackwardAndSumsTheSame) {
  dist::Comm& w = dist::world();
  const model::ModelConfig cfg =
      model::ModelConfig::from_json(io::json::parse(train::tiny::kTinyModel), "tiny model");
  model::Model<float> m(cfg);
  m.params().init(3);
  m.params().enable_grads();
  train::RunConfig rc;
  rc.parallel.dp = w.size();
  rc.parallel.bucket_mb = 16.0 / 1024;  // 16 KiB: a few layers per bucket
  train::OptimConfig oc;
  oc.kind = "adamw";
  train::Optimizer opt(m.params(), cfg, oc);
  auto engine = train::make_cpu_engine(rc, m, opt, w);
  const train::Batch b = random_batch(cfg.vocab_size, 40 + uint64_t(w.rank()));
  int64_t n_valid = b.predicted();
  w.all_reduce_sum(&n_valid, 1);

  // One backward, its gradients summed (a learning rate of 0: the weights stay, and every run sees the same model).
  auto run = [&](int64_t micro_batches, train::StepInfo* info) {
    engine->zero_grads(micro_batches);
    engine->forward_backward(b, n_valid);
    const train::StepInfo i = engine->step(0.0);
    if (info) *info = i;
    return grads(m);
  };
  train::StepInfo overlapped, after;
  const std::vector<float> g_overlap = run(1, &overlapped), g_after = run(0, &after);
  // The reference: the backward's gradients, one blocking all-reduce per parameter.
  m.params().zero_grads();
  m.forward_backward(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), n_valid);
  for (auto& p : m.params().all())
    if (p.g()) w.all_reduce_sum(p.g(), size_t(p.value.numel()));
  const std::vector<float> g_ref = grads(m);

  const double e_overlap = rel_rms_vec(g_ref, g_overlap), e_after = rel_rms_vec(g_ref, g_after);
  EXPECT_LE(e_overlap, w.size() <= 2 ? 0.0 : 1e-6);
  EXPECT_LE(e_after, w.size() <= 2 ? 0.0 : 1e-6);
  if (w.size() > 1) {
    EXPECT_GT(overlapped.buckets, 2);
    EXPECT_GT(overlapped.buckets_early, 0) << "no bucket started before the backward's last phase";
    EXPECT_EQ(after.buckets_early, 0);
  } else {
    EXPECT_EQ(overlapped.buckets, 0);  // one process: nothing to reduce
  }

  // The wait after the backward, with and without the overlap (a measurement).
  double wait_overlap = 0, wait_after = 0;
  const int reps = 3;
  for (int r = 0; r < reps; ++r) {
    train::StepInfo i;
    run(1, &i);
    wait_overlap += i.reduce_wait_s / reps;
    run(0, &i);
    wait_after += i.reduce_wait_s / reps;
  }
  if (w.rank() == 0)
    std::printf("[ measure  ] %d rank(s): %ld gradient buckets, %ld started and %ld done under the backward; "
                "gradients vs one all-reduce per parameter %.1e (overlapped) / %.1e (after the backward); the step "
                "waited %.3f ms for the reduction with the overlap, %.3f ms without\n",
                w.size(), long(overlapped.buckets), long(overlapped.buckets_early), long(overlapped.buckets_hidden),
                e_overlap, e_after, 1e3 * wait_overlap, 1e3 * wait_after);
}

// The buckets themselves: arrays in phase order, buckets of about the given size, each started once its last phase
// is ready; the sums land in the arrays.
TEST(GradientBuckets, StartInPhaseOrderAndSumIntoTheArrays) {
  dist::Comm& w = dist::world();
  std::vector<std::vector<float>> a = {std::vector<float>(300, 1.0f), std::vector<float>(700, 2.0f),
                                       std::vector<float>(100, 3.0f), std::vector<float>(5, 4.0f)};
  // phases 2, 0, 1, 2: the second array is final first
  dist::GradBuckets gb(w, {{a[0].data(), 300, 2}, {a[1].data(), 700, 0}, {a[2].data(), 100, 1}, {a[3].data(), 5, 2}},
                       700 * sizeof(float));
  EXPECT_EQ(gb.num_buckets(), 2u);  // [700 | 100, 300, 5]: a bucket closes once it reaches the size
  gb.ready(0);
  gb.ready(1);
  gb.finish();
  EXPECT_EQ(gb.stats().buckets, 2);
  EXPECT_EQ(gb.stats().started_early, 1);  // the first bucket, at phase 0 (the second needs phase 2, the last)
  const float R = float(w.size());
  EXPECT_EQ(a[0][299], R * 1.0f);
  EXPECT_EQ(a[1][0], R * 2.0f);
  EXPECT_EQ(a[2][50], R * 3.0f);
  EXPECT_EQ(a[3][4], R * 4.0f);
}

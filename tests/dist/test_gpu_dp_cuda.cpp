// Data-parallel training on GPUs over NCCL (train/cuda/data_parallel.hpp, the CUDA engine, the trainer) at the world
// size this binary runs at: alone (one rank, the NCCL path forced by LONGMOE_NCCL=1) or under `mpiexec -n N` with one
// GPU per rank. Exact checks where the arithmetic allows: steps from synthetic gradients (sums exact in fp32) give
// the weights, bf16 copy and AdamW moments of one AdamW over the summed gradient bit for bit, with zero 0 and 1, and
// ZeRO-1's moments survive a save and a load; every bucket goes out during an armed backward; the replicas stay
// identical. Against one process (GPU backward sums are not bit-reproducible): the engine's steps over the shards
// and a whole training run. Skips without a GPU, without NCCL, or with more ranks on the host than GPUs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "core/error.hpp"
#include "dist/comm.hpp"
#include "dist/nccl.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "nccl_testing.hpp"
#include "train/cuda/adamw.hpp"
#include "train/cuda/data_parallel.hpp"
#include "train/engine.hpp"
#include "train/engine_testing.hpp"
#include "train/tiny_run.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;
using model::cuda::GpuModel;

namespace {

#define REQUIRE_NCCL() \
  if (const std::string why = nccl_testing::cannot_run(); !why.empty()) GTEST_SKIP() << why

model::ModelConfig gpu_config() {
  return model::ModelConfig::from_json(io::json::parse(tiny::kTinyGpuModel), "tiny gpu model");
}

// LONGMOE_NCCL=1 while alive: an engine made meanwhile takes the NCCL path also in a job of one process.
struct NcclPath {
  NcclPath() { setenv(env::kNccl, "1", 1); }
  ~NcclPath() { unsetenv(env::kNccl); }
};

template <class T>
std::vector<T> down(const void* d, size_t n) {
  std::vector<T> h(n);
  if (n && cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
    throw Error("test: copy to the host failed");
  return h;
}
void up(void* d, const std::vector<float>& h) {
  if (cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice) != cudaSuccess)
    throw Error("test: copy to the device failed");
}

// Rank r's synthetic gradient of a step: multiples of 2^-10 in [−8, 8]·2^-10 inside the trainable parameters'
// slots, zero elsewhere (their sum over any ranks, in any order, is exact in fp32).
std::vector<float> synthetic_grad(const GpuModel& m, const model::ParamStore<float>& ps, int r, int step) {
  std::vector<float> g(m.flat().P, 0.f);
  for (const auto& p : ps.all()) {
    if (!p.spec.trainable) continue;
    const model::cuda::ParamSlot s = m.slot(p.spec.name);
    for (int64_t i = 0; i < s.numel; ++i)
      g[s.off + size_t(i)] = float(int((s.off + size_t(i)) * 7 + size_t(r) * 3 + size_t(step) * 5) % 17 - 8) / 1024.f;
  }
  return g;
}

std::vector<model::ParamSpec> specs_of(const model::ParamStore<float>& ps) {
  std::vector<model::ParamSpec> s;
  for (const auto& p : ps.all()) s.push_back(p.spec);
  return s;
}

// The moments of every trainable parameter, by name: (m, v).
using Moments = std::map<std::string, std::pair<std::vector<float>, std::vector<float>>>;
Moments sized_moments(const model::ParamStore<float>& ps) {
  Moments r;
  for (const auto& p : ps.all())
    if (p.spec.trainable)
      r[p.spec.name] = {std::vector<float>(size_t(p.spec.numel())), std::vector<float>(size_t(p.spec.numel()))};
  return r;
}
std::map<std::string, std::pair<float*, float*>> out_view(Moments& m) {
  std::map<std::string, std::pair<float*, float*>> r;
  for (auto& [n, mv] : m) r[n] = {mv.first.data(), mv.second.data()};
  return r;
}

TEST(GpuDataParallel, SyntheticStepsEqualOneAdamWBitForBit) {
  REQUIRE_NCCL();
  dist::DeviceComm& dc = nccl_testing::shared_comm();
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const model::ModelConfig c = gpu_config();
  model::Model<float> host(c);
  host.params().init(5);
  const std::vector<model::ParamSpec> specs = specs_of(host.params());
  for (bool zero1 : {false, true}) {
    GpuModel a(c), b(c);
    a.upload(host.params());
    b.upload(host.params());
    cuda::AdamW opt_a(a);
    std::unique_ptr<cuda::AdamW> opt_b = zero1 ? nullptr : std::make_unique<cuda::AdamW>(b);
    cuda::DataParallel dp(b, specs, dc, w, zero1, 256 << 10);
    ASSERT_GT(dp.buckets().size(), 2u);
    for (int step = 1; step <= 3; ++step) {
      std::vector<float> sum(a.flat().P, 0.f);
      for (int r = 0; r < R; ++r) {
        const std::vector<float> g = synthetic_grad(a, host.params(), r, step);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
      }
      up(a.flat().grad, sum);
      up(b.flat().grad, synthetic_grad(b, host.params(), me, step));
      dp.finish();  // (no backward armed: every bucket now)
      const double na = a.grad_norm(), nb = dp.grad_norm();
      if (zero1)
        EXPECT_NEAR(nb, na, 1e-12 * na);  // (the blocks' sums of squares in another order)
      else
        EXPECT_EQ(nb, na);
      cuda::AdamWStep as;
      as.lr = 1e-2, as.weight_decay = 0.5, as.step = step;
      opt_a.step(as);
      if (zero1)
        dp.step(as);
      else
        opt_b->step(as);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const GpuModel::Flat fa = a.flat(), fb = b.flat();
    EXPECT_EQ(down<float>(fb.master, fb.P), down<float>(fa.master, fa.P)) << "zero " << zero1;
    EXPECT_EQ(down<uint16_t>(fb.bf16, fb.P), down<uint16_t>(fa.bf16, fa.P)) << "zero " << zero1;
    Moments want = sized_moments(host.params()), got = sized_moments(host.params());
    for (auto& [n, mv] : want) opt_a.get(n, mv.first.data(), mv.second.data());
    if (zero1)
      dp.save_moments(out_view(got));
    else
      for (auto& [n, mv] : got) opt_b->get(n, mv.first.data(), mv.second.data());
    for (const auto& [n, mv] : want) {
      EXPECT_EQ(got[n].first, mv.first) << n << " m, zero " << zero1;
      EXPECT_EQ(got[n].second, mv.second) << n << " v, zero " << zero1;
    }
    if (!zero1) continue;
    // ZeRO-1's moments through the host and back: each parameter from one rank (train::Optimizer's sharding).
    cuda::DataParallel again(b, specs, dc, w, true, 256 << 10);
    std::map<std::string, std::pair<const float*, const float*>> mine;
    size_t k = 0;
    for (const auto& [n, mv] : got)
      if (int(k++ % size_t(R)) == me) mine[n] = {mv.first.data(), mv.second.data()};
    again.load_moments(mine);
    Moments back = sized_moments(host.params());
    again.save_moments(out_view(back));
    EXPECT_TRUE(back == got) << "the moments changed on their way through the host";
  }
}

TEST(GpuDataParallel, EveryBucketGoesOutDuringAnArmedBackward) {
  REQUIRE_NCCL();
  dist::DeviceComm& dc = nccl_testing::shared_comm();
  dist::Comm& w = dist::world();
  const model::ModelConfig c = gpu_config();
  model::Model<float> host(c);
  host.params().init(5);
  GpuModel m(c);
  m.upload(host.params());
  cuda::DataParallel dp(m, specs_of(host.params()), dc, w, true, 128 << 10);
  // The plan: contiguous buckets over the trainable range, stages within [−1, L].
  size_t at = 0;
  for (const cuda::GradRange& b : dp.buckets()) {
    EXPECT_EQ(b.begin, at);
    EXPECT_GT(b.end, b.begin);
    EXPECT_GE(b.stage, -1);
    EXPECT_LE(b.stage, c.num_hidden_layers);
    at = b.end;
  }
  EXPECT_EQ(at, m.flat().train_end);
  std::vector<int32_t> ids, targets;
  for (int64_t i = 0; i < 128; ++i) {
    ids.push_back(int32_t((i * 37 + w.rank() * 11) % c.vocab_size));
    targets.push_back(int32_t((i * 13 + 1) % c.vocab_size));
  }
  for (int micro = 0; micro < 2; ++micro) {  // the first micro-batch sends nothing, the second everything
    if (micro == 1) dp.arm();
    m.forward_backward(ids.data(), targets.data(), model::Seqs::packed({0, 128}));
    if (micro == 1) dp.disarm();
  }
  EXPECT_EQ(dp.sent_in_backward(), int64_t(dp.buckets().size()));
  dp.finish();
  EXPECT_TRUE(std::isfinite(dp.grad_norm()));
}

using engine_testing::batch;
using engine_testing::Host;

// Every replica's copy of the host weights: the same bytes on every rank.
bool same_on_every_rank(dist::Comm& w, const model::ParamStore<float>& ps) {
  std::vector<float> mine;
  for (const auto& p : ps.all()) mine.insert(mine.end(), p.w(), p.w() + p.spec.numel());
  std::vector<float> all(mine.size() * size_t(w.size()));
  w.all_gather(mine.data(), mine.size() * 4, all.data());
  for (int r = 0; r < w.size(); ++r)
    if (std::memcmp(all.data() + size_t(r) * mine.size(), mine.data(), mine.size() * 4) != 0) return false;
  return true;
}

// The engine over the replicas' shards of each step (two micro-batches each) against one process over the whole
// batch (2R micro-batches): the same norms and losses, and weights within the GPU's run-to-run noise; the replicas'
// weights stay identical. QB where one process can match it (one replica: its router statistics are the step's).
TEST(GpuDataParallel, EngineStepsEqualOneProcess) {
  REQUIRE_NCCL();
  nccl_testing::shared_comm();  // (this rank's GPU)
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const model::ModelConfig c = gpu_config();
  const Batch whole = batch(2 * R, 64, int32_t(c.vocab_size));
  const int64_t n = whole.predicted();
  for (int zero : {0, 1}) {
    RunConfig rc;
    rc.optim.kind = "adamw", rc.optim.lr_adamw = 3e-3, rc.optim.weight_decay = 0.5;
    rc.balance = R == 1 ? Balance::QB : Balance::None;
    rc.parallel.zero = zero;
    Host ref(c, rc.optim), got(c, rc.optim), start(c, rc.optim);
    const auto e_ref = make_engine("cuda", rc, ref.m, *ref.optim, dist::single());
    rc.parallel.dp = R;
    if (zero == 1) got.optim->shard(w);
    std::unique_ptr<Engine> e_dp;
    {
      const NcclPath nccl;
      e_dp = make_engine("cuda", rc, got.m, *got.optim, w);
    }
    EXPECT_NE(e_dp->where().find("data parallel"), std::string::npos) << e_dp->where();
    for (int step = 0; step < 3; ++step) {
      e_ref->zero_grads(2 * R);
      double l_ref = 0, l_dp = 0;
      for (int64_t k = 0; k < 2 * R; ++k) l_ref += e_ref->forward_backward(whole.sequences(k, 1), n).loss_sum;
      e_dp->zero_grads(2);
      for (int64_t k = 2 * me; k < 2 * me + 2; ++k) l_dp += e_dp->forward_backward(whole.sequences(k, 1), n).loss_sum;
      w.all_reduce_sum(&l_dp, 1);
      const StepInfo i_ref = e_ref->step(1.0), i_dp = e_dp->step(1.0);
      e_ref->balance();
      e_dp->balance();
      EXPECT_NEAR(l_dp, l_ref, 1e-3 * std::abs(l_ref)) << "zero " << zero << " step " << step;
      EXPECT_NEAR(i_dp.grad_norm, i_ref.grad_norm, 1e-3 * i_ref.grad_norm) << "zero " << zero << " step " << step;
    }
    e_ref->sync_to_host();
    e_dp->sync_to_host();
    EXPECT_TRUE(same_on_every_rank(w, got.m.params())) << "zero " << zero;
    double diff = 0, moved = 0;
    for (size_t t = 0; t < ref.m.params().all().size(); ++t) {
      const auto &pr = ref.m.params().all()[t], &pg = got.m.params().all()[t], &p0 = start.m.params().all()[t];
      for (int64_t i = 0; i < pr.spec.numel(); ++i) {
        diff += std::pow(double(pg.w()[i]) - pr.w()[i], 2);
        moved += std::pow(double(pr.w()[i]) - p0.w()[i], 2);
      }
    }
    const double err = std::sqrt(diff / moved);
    if (me == 0)
      std::printf("[ measure  ] zero %d, %d replica(s) vs one process, 3 steps: weights differ by %.2e of their "
                  "update (RMS)\n", zero, R, err);
    EXPECT_LT(err, 5e-2) << "zero " << zero;
    EXPECT_EQ(got.optim->step_count(), 3);
  }
}

// ZeRO-1's optimizer state written to the host (train::Optimizer's sharding) and read back by a new engine is the
// same bytes.
TEST(GpuDataParallel, ZeroOneStateThroughTheHostIsUnchanged) {
  REQUIRE_NCCL();
  nccl_testing::shared_comm();
  dist::Comm& w = dist::world();
  const model::ModelConfig c = gpu_config();
  RunConfig rc;
  rc.optim.kind = "adamw", rc.optim.lr_adamw = 3e-3;
  rc.parallel.dp = w.size(), rc.parallel.zero = 1;
  Host h(c, rc.optim);
  h.optim->shard(w);
  const Batch b = batch(2, 64, int32_t(c.vocab_size));
  const NcclPath nccl;
  auto first = make_engine("cuda", rc, h.m, *h.optim, w);
  for (int step = 0; step < 2; ++step) {
    first->zero_grads(1);
    first->forward_backward(b, b.predicted() * w.size());
    first->step(1.0);
    first->balance();
  }
  first->sync_to_host();
  std::map<std::string, std::vector<uint8_t>> saved;
  for (const auto& [name, t] : h.optim->state())
    saved[name] = std::vector<uint8_t>(static_cast<const uint8_t*>(t.raw()), static_cast<const uint8_t*>(t.raw()) +
                                       t.nbytes());
  EXPECT_GT(saved.size(), 1u);
  auto second = make_engine("cuda", rc, h.m, *h.optim, w);  // (reads the state back)
  second->sync_to_host();
  for (const auto& [name, t] : h.optim->state()) {
    const std::vector<uint8_t> now(static_cast<const uint8_t*>(t.raw()),
                                   static_cast<const uint8_t*>(t.raw()) + t.nbytes());
    EXPECT_TRUE(now == saved[name]) << name;
  }
}

// A whole run (tiny_gpu_run, 12 steps) over the replicas against one process: the losses within 1e-2 plus three times
// the difference between two runs of one process up to that step (GPU steps are not bit-reproducible); rank 0 writes
// the run folder, with one optimizer shard per rank (ZeRO-1) when several.
TEST(GpuDataParallel, TrainingRunFollowsOneProcess) {
  REQUIRE_NCCL();
  nccl_testing::shared_comm();
  dist::Comm& w = dist::world();
  const fs::path root = fs::path(::testing::TempDir()) / ("lm_gpu_dp_" + std::to_string(w.size()));
  if (w.rank() == 0) {
    fs::remove_all(root);
    tiny::tiny_gpu_run(root, "");
  }
  w.barrier();
  TrainOptions o;
  o.quiet = true, o.device = "cuda", o.comm = &dist::single();
  const std::string r = std::to_string(w.rank());
  RunConfig one = tiny::tiny_gpu_run(root, (root / ("one-" + r)).string());
  if (w.size() > 1) one.balance = Balance::None;  // (QB over the replicas' rows is not one process's)
  const TrainResult ref = lm::train::train(one, o);
  RunConfig again = one;
  again.out = (root / ("again-" + r)).string();
  const TrainResult ref2 = lm::train::train(again, o);
  RunConfig dp = one;
  dp.out = (root / "dp").string();
  dp.parallel.dp = w.size();
  o.comm = &w;
  TrainResult got;
  {
    const NcclPath nccl;
    got = lm::train::train(dp, o);
  }
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  ASSERT_EQ(ref2.losses.size(), ref.losses.size());
  double noise = 0, worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    noise = std::max(noise, std::abs(ref2.losses[i] - ref.losses[i]));
    worst = std::max(worst, std::abs(got.losses[i] - ref.losses[i]));
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-2 + 3 * noise) << "step " << i + 1 << " (run-to-run " << noise << ")";
  }
  if (w.rank() == 0)
    std::printf("[ measure  ] %d GPU replica(s) vs one GPU, %zu steps: losses %.4f -> %.4f, worst difference %.2e "
                "(one GPU run to run: %.2e)\n", w.size(), ref.losses.size(), ref.losses.front(), ref.losses.back(),
                worst, noise);
  EXPECT_NEAR(got.heldout_loss, ref.heldout_loss, 1e-2 + 3 * noise);
  w.barrier();
  const fs::path last = got.checkpoint;
  EXPECT_TRUE(fs::exists(last / "model.safetensors")) << last;
  EXPECT_TRUE(fs::exists(last / (w.size() > 1 ? "optimizer.index.json" : "optimizer.safetensors"))) << last;
  w.barrier();
}

}  // namespace

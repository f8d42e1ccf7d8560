// `longmoe train --device cuda` end to end on a tiny K3-shaped model (MLA head dims the attention kernels take):
// the loss falls, a run interrupted and resumed on the GPU follows the uninterrupted one, a GPU checkpoint
// continues on the CPU (same files). Skips without a GPU. (The refusals: tests/train, Trainer.DeviceChecksComeFirst.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "io/json.hpp"
#include "model/cuda/gpu_model.hpp"
#include "testing.hpp"
#include "train/tiny_run.hpp"
#include "train/trainer.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;

namespace {

using tiny::tiny_gpu_run;

TEST(TrainCuda, LossFallsResumesAndContinuesOnTheCpu) {
  if (!lm::model::cuda::available()) GTEST_SKIP() << "no CUDA device";
  const lm::testing::ScratchDir scratch("lm_train_cuda");
  const fs::path& root = scratch.path;
  TrainOptions gpu;
  gpu.quiet = true, gpu.device = "cuda";
  const TrainResult full = lm::train::train(tiny_gpu_run(root, (root / "full").string()), gpu);
  ASSERT_EQ(full.steps, 12);
  std::printf("GPU losses %.4f -> %.4f, held-out ppl %.2f\n", full.losses.front(), full.losses.back(),
              full.heldout_ppl);
  EXPECT_LT(full.losses.back(), full.losses.front() - 1.0);  // it learns
  EXPECT_TRUE(std::isfinite(full.heldout_ppl));
  EXPECT_TRUE(fs::exists(root / "full" / "stage-0" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(root / "full" / "stage-0" / "optimizer.safetensors"));

  // GPU runs are not bit-reproducible (reductions that meet in L2: attention's dQ, the expert weight
  // gradients), and the difference grows with the steps of this memorising run: a second uninterrupted run
  // measures it.
  const TrainResult again = lm::train::train(tiny_gpu_run(root, (root / "again").string()), gpu);
  ASSERT_EQ(again.losses.size(), full.losses.size());

  // Interrupted at step 5 (last checkpoint: step 4... then 5 saved at the stop), resumed on the GPU: the same
  // losses up to that run-to-run difference plus 1e-2. (Measured: two uninterrupted runs often agree bit for bit
  // while the resumed one drifts by up to 6.6e-3 at losses near 0.2 from step 7 on: the resume is close but not
  // exact on the GPU, an open item; a resume that lost the optimizer state jumps by far more.)
  RunConfig part = tiny_gpu_run(root, (root / "part").string());
  part.max_steps = 5;
  const TrainResult first = lm::train::train(part, gpu);
  ASSERT_EQ(first.steps, 5);
  part.max_steps = 0;
  TrainOptions resume = gpu;
  resume.resume = true;
  const TrainResult rest = lm::train::train(part, resume);
  ASSERT_EQ(rest.steps, full.steps);
  std::vector<double> joined(first.losses.begin(), first.losses.end());
  joined.insert(joined.end(), rest.losses.begin(), rest.losses.end());
  ASSERT_EQ(joined.size(), full.losses.size());
  double noise = 0;  // the largest run-to-run difference up to the step
  for (size_t i = 0; i < joined.size(); ++i) {
    noise = std::max(noise, std::abs(again.losses[i] - full.losses[i]));
    EXPECT_NEAR(joined[i], full.losses[i], 1e-2 + 3 * noise) << "step " << i + 1 << " (run-to-run " << noise << ")";
  }
  std::printf("resumed vs uninterrupted: run-to-run difference up to %.2e\n", noise);

  // The GPU's checkpoint (weights and AdamW state in train::Optimizer's format) continues on the CPU.
  RunConfig cpu_part = tiny_gpu_run(root, (root / "mixed").string());
  cpu_part.max_steps = 5;
  lm::train::train(cpu_part, gpu);
  cpu_part.max_steps = 7;
  TrainOptions cpu;
  cpu.quiet = true, cpu.resume = true;
  const TrainResult on_cpu = lm::train::train(cpu_part, cpu);
  ASSERT_EQ(on_cpu.losses.size(), 2u);
  EXPECT_NEAR(on_cpu.losses[0], full.losses[5], 2e-2);  // the CPU's fp32 step against the GPU's bf16 one
  EXPECT_NEAR(on_cpu.losses[1], full.losses[6], 2e-2);
}

}  // namespace

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
#include "train/trainer.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;

namespace {

const char* kModel = R"({
  "model_type": "kimi_linear", "vocab_size": 320, "hidden_size": 128, "num_hidden_layers": 4,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 64,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true, "mla_use_output_gate": true,
  "linear_attn_config": {"num_heads": 1, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": true,
                         "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
  "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "intermediate_size": 256, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
  "routed_expert_hidden_size": 64, "latent_moe_use_norm": true, "moe_router_activation_func": "sigmoid",
  "moe_renormalize": true, "routed_scaling_factor": 1.0, "attn_res_block_size": 2, "rms_norm_eps": 1e-5,
  "tie_word_embeddings": false })";

RunConfig run(const fs::path& root, const std::string& out, const char* optimizer = "adamw") {
  if (!fs::exists(root / "model.json")) {
    fs::create_directories(root / "corpus");
    std::ofstream(root / "model.json") << kModel;
    const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red"};
    for (int d = 0; d < 16; ++d) {
      std::ofstream f(root / "corpus" / ("doc" + std::to_string(100 + d) + ".txt"));
      for (int s = 0; s < 40; ++s) {
        for (int w = 0; w < 6; ++w) f << (w ? " " : "") << words[(d + s * 5 + w * 7) % 12];
        f << ".\n";
      }
    }
  }
  io::json j = io::json::parse(R"({
    "model": "", "data": {"path": "", "format": "folder", "heldout_fraction": 0.1},
    "tokenizer": {"vocab_size": 320}, "seed": 3,
    "optimizer": {"kind": "adamw", "lr_adamw": 3e-3},
    "balance": {"kind": "qb"},
    "stages": [{"seq_len": 64, "tokens": 6144, "batch_seqs": 8, "micro_seqs": 4}],
    "eval_every": 0, "eval_batches": 2, "save_every": 4 })");
  j["model"] = (root / "model.json").string();
  j["data"]["path"] = (root / "corpus").string();
  j["optimizer"]["kind"] = optimizer;
  j["out"] = out;
  return RunConfig::from_json(j, "tiny gpu run");
}

TEST(TrainCuda, LossFallsResumesAndContinuesOnTheCpu) {
  if (!lm::model::cuda::available()) GTEST_SKIP() << "no CUDA device";
  const fs::path root = fs::path(::testing::TempDir()) / "lm_train_cuda";
  fs::remove_all(root);
  TrainOptions gpu;
  gpu.quiet = true, gpu.device = "cuda";
  const TrainResult full = lm::train::train(run(root, (root / "full").string()), gpu);
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
  const TrainResult again = lm::train::train(run(root, (root / "again").string()), gpu);
  ASSERT_EQ(again.losses.size(), full.losses.size());

  // Interrupted at step 5 (last checkpoint: step 4... then 5 saved at the stop), resumed on the GPU: the same
  // losses up to that run-to-run difference plus 1e-2. (Measured: two uninterrupted runs often agree bit for bit
  // while the resumed one drifts by up to 6.6e-3 at losses near 0.2 from step 7 on: the resume is close but not
  // exact on the GPU, an open item; a resume that lost the optimizer state jumps by far more.)
  RunConfig part = run(root, (root / "part").string());
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
  RunConfig cpu_part = run(root, (root / "mixed").string());
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

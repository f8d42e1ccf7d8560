#pragma once
// A tiny K3-shaped run for the GPU trainer tests (tests/train/test_train_cuda.cpp, tests/dist/test_gpu_dp_cuda.cpp):
// kTinyGpuModel (4 layers: 3 KDA + 1 MLA with the attention kernels' head dims, latent MoE of 8 experts, AttnRes
// blocks of 2) and tiny_gpu_run, 12 steps of 8 x 64 tokens (AdamW, QB) over a toy corpus of 16 documents written under
// `root` once.
#include <filesystem>
#include <fstream>
#include <string>

#include "io/json.hpp"
#include "train/trainer.hpp"

namespace lm::train::tiny {

namespace fs = std::filesystem;

inline constexpr const char* kTinyGpuModel = R"({
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

inline RunConfig tiny_gpu_run(const fs::path& root, const std::string& out, const char* optimizer = "adamw") {
  if (!fs::exists(root / "model.json")) {
    fs::create_directories(root / "corpus");
    std::ofstream(root / "model.json") << kTinyGpuModel;
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

}  // namespace lm::train::tiny

#pragma once
// A tiny K3-shaped training run on a toy corpus, shared by the trainer tests (tests/train) and the data-parallel
// tests (tests/dist): kTinyModel (4 layers: 3 KDA + 1 MLA, latent MoE of 8 experts, AttnRes), make_corpus (24
// documents of a toy language), tiny_config (a run over them) and tiny_run (two stages, Muon, QB); for the GPU,
// kTinyGpuModel and tiny_gpu_run (one stage, AdamW, QB).
#include <filesystem>
#include <fstream>
#include <string>

#include "core/rng.hpp"
#include "io/json.hpp"
#include "train/trainer.hpp"

namespace lm::train::tiny {

namespace fs = std::filesystem;

inline constexpr const char* kTinyModel = R"({
  "model_type": "kimi_linear", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 4,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": true, "mla_use_output_gate": true,
  "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "use_full_rank_gate": true,
                         "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
  "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "intermediate_size": 64, "first_k_dense_replace": 1, "moe_layer_freq": 1,
  "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 16,
  "routed_expert_hidden_size": 16, "latent_moe_use_norm": true, "moe_router_activation_func": "sigmoid",
  "moe_renormalize": true, "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
  "attn_res_block_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false })";

// A folder of small documents of a toy language with some structure to learn.
inline std::string make_corpus(const fs::path& dir) {
  fs::create_directories(dir);
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "house",
                         "saw", "bird", "sang", "in", "tree", "small", "green"};
  Rng r{99, 0};
  uint64_t n = 0;
  for (int d = 0; d < 24; ++d) {
    std::ofstream f(dir / ("doc" + std::to_string(100 + d) + ".txt"));
    for (int s = 0; s < 30; ++s) {
      const int len = 4 + static_cast<int>(r.bits(n++).v[0] % 6);
      for (int w = 0; w < len; ++w) f << (w ? " " : "") << words[(r.bits(n++).v[0] % 20 + w * 3) % 20];
      f << ".\n";
    }
  }
  return dir.string();
}

// The files of a tiny run under `root` (the model `model_json`, and the corpus that make_corpus writes), made once,
// then the run config `run` (JSON) with their paths and `out` filled in.
template <class MakeCorpus>
RunConfig tiny_config(const fs::path& root, MakeCorpus make_corpus_in, const char* run, const std::string& out,
                      const std::string& ctx, const char* model_json = kTinyModel) {
  if (!fs::exists(root / "model.json")) {
    fs::create_directories(root);
    std::ofstream(root / "model.json") << model_json;
    make_corpus_in(root / "corpus");
  }
  io::json j = io::json::parse(run);
  j["model"] = (root / "model.json").string();
  j["data"]["path"] = (root / "corpus").string();
  j["out"] = out;
  return RunConfig::from_json(j, ctx);
}

inline RunConfig tiny_run(const fs::path& root, const std::string& out) {
  return tiny_config(root, make_corpus, R"({
    "model": "", "data": {"path": "", "format": "folder", "heldout_fraction": 0.1},
    "tokenizer": {"vocab_size": 320}, "seed": 3,
    "optimizer": {"kind": "muon", "lr_adamw": 3e-3, "lr_muon": 3e-3},
    "balance": {"kind": "qb"},
    "stages": [{"seq_len": 32, "tokens": 3072, "batch_seqs": 8, "micro_seqs": 4},
               {"seq_len": 64, "tokens": 2048, "batch_seqs": 4}],
    "eval_every": 5, "eval_batches": 2, "save_every": 4 })", out, "tiny run");
}

// The GPU trainer tests' model (tests/train/test_train_cuda.cpp, tests/dist/test_gpu_dp_cuda.cpp): the MLA head dims
// the attention kernels take (128 + 64 / 128), one 128-wide KDA head, 8 experts; AttnRes blocks of 2.
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

// 16 documents of 40 six-word sentences over 12 words, a fixed pattern (the GPU run memorises it).
inline void make_pattern_corpus(const fs::path& dir) {
  fs::create_directories(dir);
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red"};
  for (int d = 0; d < 16; ++d) {
    std::ofstream f(dir / ("doc" + std::to_string(100 + d) + ".txt"));
    for (int s = 0; s < 40; ++s) {
      for (int w = 0; w < 6; ++w) f << (w ? " " : "") << words[(d + s * 5 + w * 7) % 12];
      f << ".\n";
    }
  }
}

// The tiny GPU run: 12 steps of 8 x 64 tokens (micro-batches of 4), AdamW (or `optimizer`), QB.
inline RunConfig tiny_gpu_run(const fs::path& root, const std::string& out, const char* optimizer = "adamw") {
  RunConfig c = tiny_config(root, make_pattern_corpus, R"({
    "model": "", "data": {"path": "", "format": "folder", "heldout_fraction": 0.1},
    "tokenizer": {"vocab_size": 320}, "seed": 3,
    "optimizer": {"kind": "adamw", "lr_adamw": 3e-3},
    "balance": {"kind": "qb"},
    "stages": [{"seq_len": 64, "tokens": 6144, "batch_seqs": 8, "micro_seqs": 4}],
    "eval_every": 0, "eval_batches": 2, "save_every": 4 })", out, "tiny gpu run", kTinyGpuModel);
  c.optim.kind = optimizer;
  return c;
}

}  // namespace lm::train::tiny

#pragma once
// The trainer: a run config (JSON) -> tokenizer, data, model, optimiser, load balancing, a staged
// context curriculum, metrics, checkpoints that resume bit for bit.
//
// Run directory layout (`out`):
//   config.json, tokenizer.model        the model config actually trained (vocab from the tokenizer)
//   run.json                            the run config, as resolved
//   metrics.jsonl                       one line per step (+ eval lines), see train/plot.hpp
//   ckpt/step-00000123/                 checkpoints: config.json, model.safetensors (HF names),
//                                       tokenizer.model, optimizer.safetensors, trainer_state.json
//   stage-<i>/                          the checkpoint that closed curriculum stage i
//   latest                              text file naming the newest complete checkpoint (relative)
// A checkpoint is written into a temporary folder and renamed into place, and `latest` is replaced
// atomically afterwards: a run killed while saving keeps its previous checkpoint loadable.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/json.hpp"
#include "ops/moe/balance.hpp"
#include "train/optim.hpp"
#include "train/schedule.hpp"

namespace lm::train {

enum class Balance { QB, Sign, Aux, None };

struct StageConfig {
  int64_t seq_len = 512;
  int64_t tokens = 0;       // training tokens in this stage (rounded to whole steps)
  int64_t batch_seqs = 8;   // sequences per optimiser step
  int64_t micro_seqs = 0;   // sequences per forward/backward (0: the whole batch at once)
  ScheduleConfig schedule;
};

struct RunConfig {
  std::string model;                      // HF config.json (vocab_size is taken from the tokenizer)
  std::string data;                       // corpus path
  std::string data_format = "auto";       // auto | text | folder | jsonl | brown
  double heldout_fraction = 0.05;
  int tokenizer_vocab = 4096;
  std::string tokenizer;                  // an existing tokenizer.model to use instead of training one
  std::string out = "runs/default";
  uint64_t seed = 1;
  OptimConfig optim;
  Balance balance = Balance::QB;
  std::string qb_estimator = "exact";     // exact | hist
  int64_t qb_bins = 256;
  double sign_gamma = 1e-3;
  double aux_coef = 1e-2;
  std::vector<StageConfig> stages;
  int64_t log_every = 1;                  // metrics lines (every step by default: MaxVio per step)
  int64_t eval_every = 200;               // steps; 0 = only at stage ends
  int64_t eval_batches = 8;               // held-out batches for the periodic eval (stage ends: all)
  int64_t save_every = 500;               // steps; 0 = only at stage ends
  int64_t keep_checkpoints = 2;
  int64_t max_steps = 0;                  // stop after this many steps in total (tests, experiments)

  static RunConfig from_json(const io::json& j, const std::string& ctx);
  static RunConfig load(const std::string& path);
  io::json to_json() const;
  void validate(const std::string& ctx) const;
};

struct TrainOptions {
  bool resume = false;
  bool quiet = false;      // no progress bar (tests)
  bool sample = true;      // print a short greedy sample at the end
};

struct TrainResult {
  int64_t steps = 0, tokens = 0;
  double final_train_loss = 0;
  double heldout_loss = 0, heldout_ppl = 0, unigram_ppl = 0;
  double tokens_per_s = 0;
  std::vector<double> losses;  // per step, for tests (resume equality)
  std::string checkpoint;      // the last checkpoint written
};

TrainResult train(const RunConfig& cfg, const TrainOptions& opt);

// Newest complete checkpoint of a run directory (via `latest`), or `path` itself when it already is
// a checkpoint folder (holds config.json and model.safetensors). Throws when neither.
std::string resolve_checkpoint(const std::string& path);

}  // namespace lm::train

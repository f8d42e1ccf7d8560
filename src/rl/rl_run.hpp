#pragma once
// The RL loop of `longmoe rl --config X` (docs/rl.md "longmoe rl"): from a checkpoint (sft), iterations of
//   rollouts (rl/rollout.hpp) of prompts_per_iter groups of grpo.group_size trajectories on the current weights,
//   up to the iteration's token deadline (unfinished trajectories are paused and continue next iteration; a group
//   trains once all its trajectories have ended) -> one GRPO step (rl/grpo.hpp) with the trainer's optimiser
//   over the completed groups -> metrics.jsonl, samples.jsonl; a held-out evaluation (greedy, success rate) at the
//   start and every eval.every iterations; checkpoints (train::save_checkpoint, with rl_state.json: the paused
//   trajectories, counters) that --resume continues exactly.
//
// Run folder: run.json (the config as resolved), metrics.jsonl (step = iterations done), samples.jsonl, ckpt/,
// latest, summary.json.
#include <cstdint>
#include <string>
#include <vector>

#include "io/json.hpp"
#include "rl/grpo.hpp"
#include "rl/rollout.hpp"
#include "train/optim.hpp"

namespace lm::rl {

struct RlConfig {
  std::string init;  // checkpoint or run folder (its latest): the initial policy, its config and tokenizer
  std::string out = "runs/rl";
  std::vector<TaskKind> kinds = {TaskKind::Lookup};  // training tasks, taken in turn
  int64_t task_size = 0;             // operations / facts (0: the kind's default of rl-demos: 4 / 20)
  uint64_t task_seed = 1000000;      // training task n has seed task_seed + n
  int64_t eval_tasks = 64;           // held-out tasks (seeds eval_seed + i), greedy
  uint64_t eval_seed = 2000000;
  int64_t eval_every = 5;            // iterations; 0: only at the start and the end
  int64_t iterations = 20;
  int64_t prompts_per_iter = 8;      // open groups per iteration
  int64_t iteration_tokens = 0;      // the token deadline of an iteration's rollouts (0: none)
  int64_t micro_trajectories = 8;    // trajectories per forward/backward
  int64_t epochs = 1;                // optimiser steps per batch of rollouts (the metrics are the last one's)
  double lr = 1e-5;                  // constant (AdamW unless optimizer says otherwise)
  train::OptimConfig optim;
  GrpoConfig grpo;
  RolloutConfig rollout;
  int64_t samples_per_iter = 2;      // trajectories written to samples.jsonl per iteration
  int64_t save_every = 5;            // iterations; the last one always
  int64_t keep_checkpoints = 2;
  int64_t max_iterations = 0;        // stop after this many in this process (tests): a checkpoint, no summary
  int64_t context = 0;               // tokens per trajectory at most (0: the model's limit; 8192 on the GPU)

  static RlConfig from_json(const io::json& j, const std::string& ctx);  // strict: unknown fields are errors
  io::json to_json() const;
};

struct RlOptions {
  bool resume = false, overwrite = false, quiet = false;
  std::string device = "cpu";  // cpu, or cuda: training steps and rollouts on the GPU (AdamW; docs/rl.md)
};

struct RlResult {
  int64_t iterations = 0;                 // done in all (resumed runs included)
  std::vector<io::json> metrics;          // the iteration rows of this process
  std::vector<double> eval_success;       // each evaluation of this process, in order
  double first_eval = -1, last_eval = -1; // held-out success rate at the start of the run and at its end
  double seconds = 0;
  std::string checkpoint;
  bool interrupted = false;               // stopped by SIGINT / SIGTERM after an iteration (a checkpoint was saved)
};

RlResult run_rl(const RlConfig& c, const RlOptions& o);

}  // namespace lm::rl

#pragma once
// Rollouts of agentic episodes by an inference engine on the policy's current weights (docs/rl.md "longmoe rl"; the
// CPU Session or the GPU model's slots): a batch of trajectories decoded together (one Engine::decode over every live
// sequence per token), each
// multi-turn: the model writes an assistant turn until <|end|>, the turn is read by rl::episode_turn (a tool call
// answered by the task's Toolbox, an answer that ends the episode, budgets), the tool turn and the next
// <|assistant|> are rendered by the one chat template (io::chat_tokens) and prefilled, and so on.
//
// Every token of a trajectory is recorded with its mask (1: the policy sampled it, incl. a turn's closing <|end|>;
// 0: prompt, tool results, template tokens) and, where masked in, the sampler's log-probability: the
// logp_old of GRPO (rl/grpo.hpp).
// Partial rollouts: `deadline` caps the tokens generated in one call over the whole batch; a trajectory still
// running then is paused with everything it recorded, and the next call continues it: its tokens are prefilled
// on the then-current weights and sampling resumes at its draw counter (Sampler::seek; the sampler stream is the
// trajectory's id), so with unchanged weights a paused trajectory continues exactly as an unpaused one would.
#include <cstdint>
#include <string>
#include <vector>

#include "infer/engine.hpp"
#include "io/json.hpp"
#include "io/tokenizer.hpp"
#include "rl/episode.hpp"
#include "rl/tasks.hpp"

namespace lm::rl {

struct RolloutConfig {
  Budget budget;                 // per trajectory: assistant turns, tool calls, generated tokens
  int64_t max_turn_tokens = 256; // tokens of one assistant turn; a longer turn is cut (its <|end|> added unmasked)
  float temperature = 1.0f;      // 0: greedy (evaluation)
  uint64_t seed = 1;             // sampler seed; the stream is the trajectory's id
  std::string system;            // a system turn before the task (empty: none)
  static RolloutConfig from_json(const io::json& j, const std::string& ctx);  // strict
  io::json to_json() const;
};

// The task of a trajectory, by what makes it (make_task), so a paused trajectory can be saved and rebuilt.
struct TaskRef {
  TaskKind kind = TaskKind::Arithmetic;
  uint64_t seed = 0;
  int64_t size = 0;
  Task make() const { return make_task(kind, seed, size); }
};

struct Trajectory {
  int64_t id = 0;  // the sampler stream: unique per trajectory of a run
  TaskRef task;
  std::vector<int32_t> tokens;  // prompt, turns, tool results: the whole sequence so far
  std::vector<uint8_t> mask;    // [tokens] 1 where the policy sampled the token
  std::vector<double> logp;     // [tokens] the sampler's log-prob where mask = 1, else 0
  int64_t turn_start = 0;       // first token of the assistant turn in progress
  int64_t drawn = 0;            // sampler draws so far
  double entropy_sum = 0;       // of the sampling distribution, summed over the sampled tokens
  int64_t iterations = 0;       // rollout calls it has taken part in
  Episode episode;              // turns so far, tool calls, generated tokens; end and reward once done
  bool done() const { return !episode.end.empty(); }
  int64_t generated() const { return episode.tokens + (static_cast<int64_t>(tokens.size()) - turn_start); }
  io::json to_json() const;     // everything needed to continue it
  static Trajectory from_json(const io::json& j, const std::string& ctx);
};

// A new trajectory: the prompt rendered (system, user turn = task_prompt, then <|assistant|>).
Trajectory start_trajectory(const io::Tokenizer& tok, const RolloutConfig& c, int64_t id, const TaskRef& task);

struct RolloutStats {
  int64_t generated = 0;  // tokens sampled in this call
  int64_t paused = 0;     // trajectories left unfinished at the deadline
};

// Runs every unfinished trajectory of `batch` until it ends or `deadline` tokens (> 0; 0: none) have been generated
// in this call over the batch. The engine's model is the policy (its current weights); it must hold a sequence per
// unfinished trajectory (GpuEngine's max_sequences), which the call opens and closes.
RolloutStats rollout(infer::Engine& s, const io::Tokenizer& tok, const RolloutConfig& c,
                     std::vector<Trajectory*> batch, int64_t deadline = 0);

}  // namespace lm::rl

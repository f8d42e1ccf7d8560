#pragma once
// The files the trainer keeps in a run folder (layout: train/trainer.hpp): checkpoints with their
// trainer_state.json, metrics.jsonl and summary.json.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "io/json.hpp"
#include "model/config.hpp"
#include "model/params.hpp"
#include "train/data.hpp"
#include "train/optim.hpp"
#include "train/trainer.hpp"

namespace lm::train {

// trainer_state.json: where a checkpoint stands in the curriculum and in the training stream.
struct TrainerState {
  int64_t stage = 0, step_in_stage = 0;  // the next step to run
  int64_t global_step = 0, tokens = 0;   // done so far
  // The stage whose passkey documents the loader's stream holds (the position is in that stream): a stage
  // switch moves the stream on, so a stage-end checkpoint still names the previous stage.
  int64_t data_stage = 0;
  Position position;
  uint64_t data_fingerprint = 0;
};

// What says a run folder holds a run: "ckpt/step-..." folders, `latest`, summary.json (empty: none).
std::vector<std::string> run_markers(const std::filesystem::path& out);
// Removes a run's checkpoints, stage folders, `latest`, metrics and summary from `out` (the files of a new run
// replace the rest).
void clear_run(const std::filesystem::path& out);

// A resumed run's trainer_state.json (`j`; ctx names the file) for a run whose stage s has stage_steps[s] steps.
// Every counter is range-checked (a step inside its stage, no negative counts). The data fingerprint it holds must
// be fingerprint(data_stage), computed once the stages are known to be in range.
// With `finished_ok` (the run's summary.json is missing) a state past the last stage is accepted: the run had
// finished and only its summary is left to write.
TrainerState read_trainer_state(const io::json& j, const std::string& ctx, const std::vector<int64_t>& stage_steps,
                                const std::function<uint64_t(int64_t data_stage)>& fingerprint,
                                bool finished_ok = false);

// What a checkpoint holds besides its trainer state.
struct CheckpointContent {
  const model::ModelConfig& config;
  std::string tokenizer;  // the tokenizer.model file to copy
  const model::ParamStore<float>& params;
  const Optimizer& optim;
  dist::Comm* comm = nullptr;  // the job's replicas (null: one process); rank 0 writes the checkpoint
  bool sharded = false;        // the optimiser is sharded over comm (ZeRO-1): every rank writes its shard
  // More files of the checkpoint, name -> contents (e.g. the RL loop's rl_state.json), written into the temporary
  // folder with the rest, so they appear with the checkpoint or not at all.
  std::vector<std::pair<std::string, std::string>> extra_files = {};
  // Expert parallel (null: off): the ranks of this rank's expert-parallel group, which hold every routed expert once
  // between them. The ranks of one group (those with `writes_experts`, rank 0's among them) each write their
  // experts as one model shard, rank 0's with every other tensor, listed by one model.safetensors.index.json.
  dist::Comm* experts = nullptr;
  bool writes_experts = false;
};

// Writes out/ckpt/step-<global_step> (config.json, tokenizer.model, model.safetensors, the optimiser state,
// trainer_state.json) into a temporary folder renamed into place, then points out/latest at it; also_as
// (non-empty) hard-links it as out/<also_as>. Keeps the newest `keep` step folders. Returns its path.
// The optimiser state is optimizer.safetensors, or with a sharded optimiser on several ranks one
// optimizer-<r>-of-<R>.safetensors per rank (each written atomically by its rank into the temporary folder, between
// two barriers) listed by optimizer.index.json. The weights are model.safetensors, or with experts sharded one
// model-<k>-of-<ep>.safetensors per expert-parallel rank plus model.safetensors.index.json (any world size, and one
// process, reads them back by name). Collective when comm has several ranks: every rank calls it.
std::string save_checkpoint(const std::filesystem::path& out, const CheckpointContent& c, const TrainerState& st,
                            int64_t keep, const std::string& also_as);

// Hard-links the files of checkpoint folder `ckpt` as out/<as> (a stage-end checkpoint that pruning never removes),
// atomically: built in out/.tmp-<as>, renamed into place (a previous out/<as> renamed aside first), folder fsynced.
void link_checkpoint(const std::filesystem::path& out, const std::filesystem::path& ckpt, const std::string& as);
// On resume from the stage-end checkpoint `ckpt`: makes out/<as> again unless it holds that checkpoint (its
// trainer_state.json names the same global step), and removes what a killed link left (.tmp-<as>, .old-<as>).
// Returns whether it relinked.
bool relink_stage_if_needed(const std::filesystem::path& out, const std::filesystem::path& ckpt,
                            const std::string& as);

// The optimiser state files of checkpoint folder `dir`: optimizer.safetensors, or the shards optimizer.index.json
// lists (any world size reads them: Optimizer::load_state takes its own parameters' tensors from them). lm::Error
// naming the folder when neither is there, or a listed shard is missing.
std::vector<std::string> optimizer_files(const std::filesystem::path& dir);

// SIGINT / SIGTERM while a run's loop is going (train, sft, rl): the first one asks the loop to stop after the
// current step and save a checkpoint (a stopped run is one --resume away from continuing); a second one exits at
// once. The handlers are installed for the scope's lifetime.
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  using Handler = void (*)(int);
  Handler old_int_, old_term_;
};
bool interrupt_requested();  // a SIGINT or SIGTERM arrived inside the current InterruptScope

// metrics.jsonl, a JSON object a line, flushed line by line (a killed run keeps what it logged). A new
// run starts it empty; a resumed one first drops the lines of steps after its checkpoint's global_step
// (and a torn last line).
class MetricsLog {
 public:
  MetricsLog(const std::filesystem::path& path, bool resume, int64_t global_step);
  void write(const io::json& row);

 private:
  std::ofstream f_;
};

// Whether out/summary.json is the summary of the run at `global_step` (a run stopped early by max_steps writes one
// too, which a longer continuation replaces).
bool summary_of_step(const std::filesystem::path& out, int64_t global_step);
// out/summary.json: the headline figures of a finished (not interrupted) run, for people and scripts
// (docs/experiments.md).
void write_summary(const std::filesystem::path& out, const RunConfig& cfg, const TrainResult& r);

}  // namespace lm::train

#pragma once
// The trainer: a run config (JSON) -> tokenizer, data, model, optimiser, load balancing, a staged
// context curriculum, metrics, checkpoints that resume bit for bit.
//
// Run directory layout (`out`):
//   config.json, tokenizer.model        the model config actually trained (vocab from the tokenizer)
//   run.json                            the run config, as resolved
//   metrics.jsonl                       one line per step (+ eval lines), see plot/panels.hpp
//   ckpt/step-00000123/                 checkpoints: config.json, model.safetensors (HF names),
//                                       tokenizer.model, optimizer.safetensors, trainer_state.json
//   stage-<i>/                          the checkpoint that closed curriculum stage i
//   latest                              text file naming the newest complete checkpoint (relative)
// A checkpoint is written into a temporary folder and renamed into place, and `latest` is replaced
// atomically afterwards: a run killed while saving keeps its previous checkpoint loadable.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dist/comm.hpp"
#include "io/checkpoint.hpp"
#include "io/json.hpp"
#include "io/retrieval.hpp"
#include "ops/moe/balance.hpp"
#include "train/optim.hpp"
#include "train/schedule.hpp"

namespace lm::train {

enum class Balance { QB, Sign, Aux, None };
const char* balance_name(Balance b);  // qb, sign, aux, none (balance.kind in a run config)

struct StageConfig {
  int64_t seq_len = 512;
  int64_t tokens = 0;       // training tokens in this stage (rounded to whole steps)
  int64_t batch_seqs = 8;   // sequences per optimiser step
  int64_t micro_seqs = 0;   // sequences per forward/backward (0: the whole batch at once)
  // A long-context stage: documents share each sequence's context, and passkey documents fill whole windows
  // (Loader::set_concat) instead of being mixed into the stream.
  bool concat_documents = false;
  ScheduleConfig schedule;
  int64_t steps() const { return std::max<int64_t>(1, tokens / (batch_seqs * seq_len)); }  // optimiser steps
  // With dp data-parallel replicas: each runs replica_seqs(dp) sequences of every step, in micro-batches of
  // replica_micro(dp) (micro_seqs, or the whole share when that is smaller or micro_seqs is 0).
  int64_t replica_seqs(int64_t dp) const { return batch_seqs / dp; }
  int64_t replica_micro(int64_t dp) const { return std::min(micro_seqs ? micro_seqs : batch_seqs, replica_seqs(dp)); }
};

// How the processes of a job (`mpirun -np N`) share a run: dp data-parallel replicas, each running batch_seqs / dp
// sequences of every step (gradients summed across them before the optimiser step), or cp context-parallel ranks,
// each running its segment of every sequence (Model::set_context_parallel; dp 1 only so far). The world size must be
// the product dp · cp.
struct ParallelConfig {
  int64_t dp = 1;
  // ZeRO stage over the data-parallel replicas: 1 (default) shards the optimiser state (Optimizer::shard; the
  // checkpoints then hold one optimiser shard per rank), 0 keeps a whole copy on every replica.
  int zero = 1;
  // Routed experts split over groups of ep replicas (dist/moe_ep.hpp; ep divides dp and the experts): replicas
  // [g·ep, (g+1)·ep) form expert-parallel group g, rank j of a group holding experts [j·E/ep, (j+1)·E/ep) (weights,
  // gradients and optimiser state) and running them over the rows its whole group routes there. The replicas that
  // hold the same experts (dp / ep of them) sum those gradients and shard that optimiser state; the checkpoints hold
  // one model shard per expert-parallel rank (the HF index layout). Needs zero 1.
  int64_t ep = 1;
  // Rows per expert and source rank in the expert-parallel buffers, as a multiple of the balanced load m·k/E (m a
  // micro-batch's tokens per rank): assignments beyond it are dropped (deterministically: an expert's first rows in
  // token order are kept) and counted (metrics "ep_dropped"). 0 (default): m rows, nothing ever dropped.
  double ep_capacity = 0;
  // Context parallel: every sequence of a step split into cp contiguous segments, rank r taking tokens
  // [r·T/cp, (r+1)·T/cp) (each sequence one document window: stages with concat_documents).
  int64_t cp = 1;
  // Gradients are summed over the ranks in buckets of about this many MiB, each started as soon as the backward has
  // made its gradients final (dist::GradBuckets), so the reduction runs under the rest of the backward.
  double bucket_mb = 4;
  int64_t world() const { return dp * cp; }
};

struct RunConfig {
  std::string model;                      // HF config.json (vocab_size is taken from the tokenizer)
  // A checkpoint (or run folder: its latest) whose weights a new run starts from instead of random ones (sft);
  // stored resolved to the checkpoint folder. "model" and "tokenizer.model" default to its config.json and
  // tokenizer.model; another tokenizer is refused (the weights read its ids). The optimiser state starts fresh.
  std::string init;
  std::string data;                       // corpus path
  // auto | text | folder | jsonl | brown (io/corpus.hpp), or chat: demonstrations (io::read_demos), rendered by
  // the chat template with the loss on the assistant's tokens only (TokenizedDocs::loss_mask); needs a tokenizer
  // (init or tokenizer.model) and no passkey documents.
  std::string data_format = "auto";
  double heldout_fraction = 0.05;
  // Synthetic passkey documents' share of the training tokens, per stage at its seq_len
  // (train/synthetic.hpp); 0: none. In [0, 0.9]. The held-out split stays pure corpus.
  double passkey_fraction = 0;
  // Synthetic multi-needle documents' share of the sequences of concat_documents stages (every stage must be one;
  // train/synthetic.hpp); 0: none. In [0, 0.9], with passkey_fraction at most 0.9 together.
  double multi_needle_fraction = 0;
  double synthetic_fraction() const { return passkey_fraction + multi_needle_fraction; }
  // The loss weight of the answer tokens of those whole-window retrieval documents (concat_documents stages, the
  // key or number and "."): each counts answer_weight times, so that a few tokens per sequence still steer the
  // step; 1: like every other target. In [1, 1000]; not with context or expert parallel.
  double answer_weight = 1;
  // Images (issue 22 item 4: SPEC §9 trained jointly): a Fashion-MNIST folder (io::read_fashion_mnist) whose train
  // split's images, captioned from their labels (train/captions.hpp), fill `image_fraction` of every step's
  // sequences; the rest are the corpus as before. Needs a model config with vision_config; the tokenizer trained
  // here then has <|image|>, which becomes media_placeholder_token_id. "": text only.
  std::string images;
  int64_t image_size = 56;      // px: each 28x28 item is upscaled to image_size², a multiple of patch·merge
  double image_fraction = 0;    // of a step's batch_seqs, rounded; in [0, 0.9]
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
  ParallelConfig parallel;
  // Retrieval measured on each stage's checkpoint (stage-<i>/retrieval.jsonl) once training ends; empty: none.
  io::RetrievalOptions eval_retrieval;

  static RunConfig from_json(const io::json& j, const std::string& ctx);
  static RunConfig load(const std::string& path);
  io::json to_json() const;
  void validate(const std::string& ctx) const;
  std::vector<int64_t> stage_steps() const;  // each stage's steps()
};

struct TrainOptions {
  bool resume = false;
  bool quiet = false;      // no progress bar (tests)
  // A run folder belongs to one run: a new run (no resume) into a folder that holds another one (checkpoints,
  // `latest` or summary.json) is refused, unless `overwrite`, which removes that run's checkpoints, `latest`,
  // metrics and summary first.
  bool overwrite = false;
  // The job's processes (null: dist::world(), MPI under mpirun); its size must be RunConfig::parallel.world().
  // Rank 0 alone writes the run folder and logs.
  dist::Comm* comm = nullptr;
  // "cuda": forward, backward, AdamW and Quantile Balancing on the GPU (model/cuda/gpu_model); needs
  // optimizer.kind "adamw" and balance qb (exact estimator) or none. Checkpoints are the same files either way.
  std::string device = "cpu";
};

struct TrainResult {
  int64_t steps = 0, tokens = 0;
  double final_train_loss = 0;
  double heldout_loss = 0, heldout_ppl = 0, unigram_ppl = 0;
  double tokens_per_s = 0;
  std::vector<double> losses;  // per step, for tests (resume equality)
  std::string checkpoint;      // the last checkpoint written
  // MoE balance, per step of this process: MaxVio of the worst MoE layer (empty without MoE layers).
  std::vector<double> maxvio_worst;
  bool interrupted = false;        // stopped by SIGINT/SIGTERM (a checkpoint was saved; no summary.json)
  int64_t ep_dropped = 0;          // assignments expert parallel's buffers dropped, over the steps of this process
  int64_t first_step = 0;          // global step of maxvio_worst[0] / losses[0] (non-zero after --resume)
  double train_seconds = 0;        // time in optimiser steps (no evaluation, no saving)
  std::vector<double> stage_heldout_ppl;  // held-out perplexity at the end of each stage finished here
  // Per stage run here (with passkey_fraction > 0): the share of synthetic passkey documents in the
  // stage's first epoch of the training stream, in tokens and in documents.
  std::vector<double> stage_passkey_token_fraction, stage_passkey_doc_fraction;
};

// Run-level figures of a TrainResult: the first step whose worst-layer MaxVio is below `below`
// (-1: never), and the median worst-layer MaxVio over the steps after `after` (NaN when none).
struct BalanceSummary {
  int64_t first_step_below = -1;
  double median_after = 0;
  double max_after = 0;
};
BalanceSummary summarize_balance(const TrainResult& r, double below, int64_t after);

TrainResult train(const RunConfig& cfg, const TrainOptions& opt);

using io::resolve_checkpoint;  // a run folder -> its newest checkpoint (io/checkpoint.hpp)

}  // namespace lm::train

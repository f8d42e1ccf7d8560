#pragma once
// The training engine: a step's device work behind one interface, so that the step loop (trainer.cpp)
// is the same on every device. Per optimiser step the trainer calls
//   zero_grads, forward_backward per micro-batch, step, balance, then reads expert_loads and aux_loss;
// loss serves the held-out evaluation and sync_to_host precedes each checkpoint.
// The host model and optimiser belong to the trainer (checkpoints are written from them): an engine starts
// from their weights and state and, when it keeps its own copy on a device, writes that back in sync_to_host.
//
// Implementations: engine_cpu.cpp (model::Model<float> + train::Optimizer + the host Balancer) and
// engine_cuda.cpp (model::cuda::GpuModel: forward, backward, AdamW and Quantile Balancing on the GPU; data parallel
// over NCCL).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "dist/comm.hpp"
#include "model/model.hpp"
#include "train/data.hpp"
#include "train/optim.hpp"
#include "train/trainer.hpp"

namespace lm::model::cuda {
class GpuModel;
}

namespace lm::train {

// A NaN or Inf loss or gradient: what() says which and where ("the loss became nan on the GPU"); the
// trainer adds the step and the last checkpoint to the message.
class NonFinite : public Error {
 public:
  using Error::Error;
};

struct LossStats {
  double loss_sum = 0;  // cross-entropy summed over the batch's targets
  int64_t n_valid = 0;  // targets of the batch (kIgnore excluded)
};

// A batch with Batch::weights (data.answer_weight) as forward_backward_logp's gradient (the CPU engine; the GPU
// model takes the weights itself, GpuModel::forward_backward): the loss is the weighted
// cross-entropy Σ_t w_t (−log p_t) / n_valid_total over the targets >= 0, so dL/dlogp_t = −w_t / n_valid_total (0
// elsewhere); *loss_sum receives Σ −log p_t over them, unweighted, the figure an unweighted step reports.
model::Model<float>::LogpGrad weighted_loss(const Batch& b, int64_t n_valid_total, double* loss_sum);

class Engine {
 public:
  virtual ~Engine() = default;

  // Where the steps run, for the log ("on the GPU", "2 threads").
  virtual std::string where() const = 0;
  // Steps of micro-batches of `rows` tokens follow (a new stage): the engine fits its memory to them and says how
  // (the GPU's memory plan), or returns nothing. lm::Error when they cannot fit.
  virtual std::string plan(int64_t /*rows*/) { return {}; }
  // Device memory in use now, in bytes (the GPU: as cudaMemGetInfo reports it, so with the scratch pool's retained
  // blocks: about the peak since the plan), or -1 without a device. The log sets it beside the plan's prediction.
  virtual double device_memory_in_use() const { return -1; }
  // A new step of `micro_batches` forward_backward calls (0: not said): zero gradients and no expert loads or router
  // statistics yet. Knowing which call is the last lets a data-parallel engine reduce gradients during its
  // backward (without it they are all reduced in step()).
  virtual void zero_grads(int64_t micro_batches = 0) = 0;
  // One micro-batch: forward, cross-entropy normalised by the step's n_valid_total targets (so that
  // accumulation equals one big batch; each weighted by b.weights when it has them: weighted_loss), backward into
  // the gradients; adds the micro-batch's expert loads
  // and router statistics to the step's. NonFinite on a NaN/Inf loss (naming the first bad layer where it can).
  // With `media`: the batch's images, in placeholder order (the model's splice; the tower gets its gradient).
  virtual LossStats forward_backward(const Batch& b, int64_t n_valid_total,
                                     const model::Media<float>* media = nullptr) = 0;
  // Loss only (held-out evaluation).
  virtual LossStats loss(const Batch& b, const model::Media<float>* media = nullptr) = 0;
  // Global-norm clip and the optimiser update, learning rates times the schedule's lr_factor.
  // NonFinite on a NaN/Inf gradient; weights and optimiser state are then unchanged.
  virtual StepInfo step(double lr_factor) = 0;
  // Every MoE layer's selection bias from the step's routing (RunConfig::balance), used from the next step on.
  virtual void balance() = 0;
  // Tokens routed to each expert in this step: [MoE layers, in model order][E].
  virtual const std::vector<std::vector<int64_t>>& expert_loads() const = 0;
  // The MoE layers' auxiliary losses summed over the step's micro-batches (non-zero with balance aux).
  virtual double aux_loss() const = 0;
  // Token-expert assignments that expert parallel's fixed-capacity buffers dropped in this step, over every rank.
  virtual int64_t ep_dropped() const { return 0; }
  // The engine's weights and optimiser state into the host model and optimiser (before a checkpoint).
  virtual void sync_to_host() = 0;

  // RL (rl/rl_run.cpp), as model::Model: per-row log p of the batch's targets (0 where < 0) without a backward; and
  // one forward whose log-probs `dloss` turns into dL/dlogp_t, the backward accumulating the gradients.
  virtual std::vector<float> target_logprobs(const Batch& b) = 0;
  virtual std::vector<float> forward_backward_logp(const Batch& b, const model::Model<float>::LogpGrad& dloss) = 0;
  // The CUDA engine's GPU model (its bf16 weights serve a GPU inference engine: rollouts on the current policy
  // without a copy); null on the CPU.
  virtual model::cuda::GpuModel* gpu_model() { return nullptr; }
};

// lm::Error unless `device` (cpu | cuda) can run `cfg`; called before anything is written.
void check_device(const std::string& device, const RunConfig& cfg);
// The engine for `device` (check_device first) over the host model and optimiser, which hold the starting
// weights and state and must outlive it.
// `comm`: the data-parallel replicas (each engine sums its gradients and router statistics across them); with experts
// sharded over expert-parallel groups (Model::set_expert_parallel), the routed experts' gradients are summed over
// `expert_dp` instead, the ranks that hold the same experts.
std::unique_ptr<Engine> make_engine(const std::string& device, const RunConfig& cfg, model::Model<float>& host,
                                    Optimizer& optim, dist::Comm& comm, dist::Comm* expert_dp = nullptr);

// The two implementations behind make_engine / check_device.
std::unique_ptr<Engine> make_cpu_engine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim,
                                        dist::Comm& comm, dist::Comm* expert_dp = nullptr);
// The CUDA engine over `comm`'s replicas: one GPU per process, the gradients summed over NCCL (train/cuda/
// data_parallel.hpp) when comm has several processes or LONGMOE_NCCL=1 (core/env.hpp).
std::unique_ptr<Engine> make_cuda_engine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim,
                                         dist::Comm& comm);
void check_cuda_run(const RunConfig& cfg);

}  // namespace lm::train

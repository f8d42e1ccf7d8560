#pragma once
// Data parallel GpuModel replicas over NCCL (dist/nccl.hpp): the gradients of a step's last micro-batch are summed
// over the replicas in buckets, each sent as soon as the backward has written it (GpuModel::set_grad_ready), on the
// communicator's stream while the backward goes on; then the global-norm clip and AdamW, and Quantile Balancing over
// every replica's router statistics. Two modes, as parallel.zero says:
//   zero 0  all-reduce: every replica holds the summed gradient and whole AdamW moments (train/cuda/adamw.hpp) and
//           takes the same step.
//   zero 1  ZeRO-1: reduce-scatter; replica r holds the summed gradient and the AdamW moments of block r of every
//           bucket only (1/R of the state), steps it, and the new fp32 weights are all-gathered bucket by bucket
//           (each gather beside the next bucket's update), then cast to the bf16 copy.
// Checkpoints keep train::Optimizer's format and sharding (optim.hpp: each parameter's state on its owner rank):
// load_moments and save_moments move the moments between that and the buckets' blocks with collectives.
// Plain C++ (no CUDA types); device pointers. Without CUDA, DataParallel's entry points throw.
//
// Legend: P elements of the flat arrays (GpuModel::flat(): [0, train_end) trainable), R replicas, r this one;
//         bucket j = [b_j, e_j), n_j = e_j − b_j elements (a multiple of kBucketQuantum), c_j = n_j / R its block.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/comm.hpp"
#include "dist/nccl.hpp"
#include "model/params.hpp"
#include "train/cuda/adamw.hpp"

namespace lm::model::cuda {
class GpuModel;
}

namespace lm::train::cuda {

// Bucket boundaries are multiples of this (the flat layout aligns each tensor to 64 elements), so that a bucket
// splits into R equal blocks for every R dividing it.
inline constexpr size_t kBucketQuantum = 64;

// A range of the flat arrays whose gradients are final once the backward has passed `stage` (GpuModel::grad_stage).
struct GradRange {
  size_t begin = 0, end = 0;
  int64_t stage = 0;
};

// Buckets covering [0, train_end) (train_end a multiple of kBucketQuantum): each parameter range belongs to
// stage runs split into pieces of at most `target` elements, consecutive small pieces merged up to `target`; a
// bucket's stage is the least of its parameters' (it can be sent once that stage is passed). Boundaries are
// multiples of kBucketQuantum (rounded down where a stage run starts inside a quantum). Pure.
std::vector<GradRange> plan_buckets(std::vector<GradRange> params, size_t train_end, size_t target);

class DataParallel {
 public:
  // `specs`: every parameter of `model` (their slots give the ranges); `dc` over the job's replicas, `host` the same
  // ranks (counts, the ZeRO-1 norm). zero1 needs every bucket's size divisible by R (R dividing 64: lm::Error
  // otherwise). bucket_bytes: fp32 gradient bytes per bucket at most (bigger ones only where a quantum is bigger).
  DataParallel(model::cuda::GpuModel& model, const std::vector<model::ParamSpec>& specs, dist::DeviceComm& dc,
               dist::Comm& host, bool zero1, size_t bucket_bytes);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // The next backward is the step's last: its buckets go out as its stages complete. disarm() after it.
  void arm();
  void disarm();
  // Sends every bucket not yet sent (all of them when no backward was armed), and makes the null stream wait for the
  // reductions. Once per step, before grad_norm and step.
  void finish();
  // The global L2 norm of the summed gradients, the same double on every replica.
  double grad_norm();
  // zero1 only: AdamW on this replica's blocks, then the weights gathered and the bf16 copy refreshed.
  void step(const AdamWStep& a);
  // Quantile Balancing from every replica's router statistics of the last forward (GpuModel::balance).
  void balance();

  // zero1 only, collective: the moments of the parameters in `mine` (name -> host m, v of its numel) into the
  // blocks; each parameter must come from one rank (its owner in train::Optimizer's sharding).
  void load_moments(const std::map<std::string, std::pair<const float*, const float*>>& mine);
  // zero1 only, collective: the moments of the parameters in `mine` out of every replica's blocks.
  void save_moments(const std::map<std::string, std::pair<float*, float*>>& mine);

  bool zero1() const { return zero1_; }
  const std::vector<GradRange>& buckets() const { return buckets_; }
  // Buckets sent during the last armed backward (the rest waited for finish()).
  int64_t sent_in_backward() const { return sent_in_backward_; }
  size_t state_bytes() const;  // the AdamW moments held here (zero1)

 private:
  struct Impl;
  bool zero1_;
  std::vector<GradRange> buckets_;
  int64_t sent_in_backward_ = 0;
  std::unique_ptr<Impl> p_;
};

}  // namespace lm::train::cuda

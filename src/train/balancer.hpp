#pragma once
// Load balancing of the MoE layers on the host (SPEC §5, ops/moe/balance.hpp): per step, each MoE layer's
// expert loads and router statistics, added up over the step's micro-batches, then the layer's new selection
// bias, installed for the next step:
//   qb    Quantile Balancing from the router scores of the whole step: exact (every [m, E] score kept) or
//         hist (counts per bin of the biased margins)
//   sign  DeepSeek's auxiliary-loss-free update from the loads
//   aux   no bias update: the layers add an auxiliary loss (aux_coef) to their gradients
//   none  nothing
// The CUDA engine keeps only the loads here: its Quantile Balancing reads the scores on the device.
//
// Legend: m tokens routed in the step, E experts, k experts per token.
#include <cstdint>
#include <vector>

#include "dist/comm.hpp"
#include "model/model.hpp"
#include "ops/moe/balance.hpp"
#include "train/trainer.hpp"

namespace lm::train {

class Balancer {
 public:
  // Finds m's MoE layers (and sets their aux_coef for balance aux); m must outlive the balancer.
  Balancer(const RunConfig& cfg, model::Model<float>& m);

  void clear();  // a new step
  // loads[li] += l [E]: the loads of MoE layer li (its index in layers()) in one micro-batch.
  void add_loads(size_t li, const int64_t* l);
  // After a forward of `rows` tokens on the host model: every MoE layer's loads, router statistics (qb)
  // and auxiliary loss.
  void accumulate(int64_t rows);
  // Data parallel (and every layout whose ranks route different tokens): the loads, router statistics and auxiliary
  // loss summed (scores gathered) over the ranks, so that update() sees the whole step. One all-reduce per MoE layer
  // carries its loads, dropped assignments and (the histogram estimator) counts, whatever the number of tokens.
  void reduce(dist::Comm& comm);
  // The new bias of every MoE layer of the host model from the step's statistics (qb, sign).
  void update();

  const std::vector<int64_t>& layers() const { return layers_; }  // MoE layer indices
  const std::vector<std::vector<int64_t>>& loads() const { return loads_; }
  double aux_loss() const { return aux_; }
  // Token-expert assignments the expert-parallel buffers dropped in the step (beyond their capacity), all layers.
  int64_t dropped() const {
    int64_t n = 0;
    for (int64_t d : dropped_) n += d;
    return n;
  }

 private:
  model::Model<float>& m_;
  Balance kind_;
  bool hist_;
  ops::QbHistogram h_;
  double gamma_;
  int64_t E_ = 0, k_ = 0;
  std::vector<int64_t> layers_;
  std::vector<std::vector<float>> scores_;    // per MoE layer: [m, E] of the step (exact QB)
  std::vector<std::vector<int64_t>> counts_;  // per MoE layer: histogram counts (hist QB)
  std::vector<std::vector<int64_t>> loads_;   // per MoE layer: [E] selections this step
  std::vector<int64_t> dropped_;               // per MoE layer: assignments dropped by expert parallel
  double aux_ = 0;                            // summed in micro-batch, then layer order
};

}  // namespace lm::train

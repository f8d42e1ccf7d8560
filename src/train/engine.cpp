// The engine factory: the device named on the command line -> its engine (train/engine.hpp).
#include "train/engine.hpp"

#include <algorithm>

namespace lm::train {

void check_device(const std::string& device, const RunConfig& cfg) {
  LM_CHECK(device == "cpu" || device == "cuda", "train: --device must be cpu or cuda, not '{}'", device);
  if (device == "cuda") check_cuda_run(cfg);
}

model::Model<float>::LogpGrad weighted_loss(const Batch& b, int64_t n_valid_total, double* loss_sum) {
  LM_CHECK(b.weights.size() == b.targets.size(), "batch: {} loss weights for {} targets", b.weights.size(),
           b.targets.size());
  return [&b, n_valid_total, loss_sum](const std::vector<float>& logp) {
    LM_CHECK(logp.size() == b.targets.size(), "weighted loss: {} log-probs for {} targets", logp.size(),
             b.targets.size());
    const double inv = 1.0 / static_cast<double>(std::max<int64_t>(n_valid_total, 1));
    std::vector<float> g(logp.size(), 0.f);
    double sum = 0;
    for (size_t t = 0; t < logp.size(); ++t)
      if (b.targets[t] >= 0) sum -= logp[t], g[t] = static_cast<float>(-b.weights[t] * inv);
    *loss_sum = sum;
    return g;
  };
}

std::unique_ptr<Engine> make_engine(const std::string& device, const RunConfig& cfg, model::Model<float>& host,
                                    Optimizer& optim, dist::Comm& comm, dist::Comm* expert_dp) {
  check_device(device, cfg);
  return device == "cuda" ? make_cuda_engine(cfg, host, optim, comm)
                          : make_cpu_engine(cfg, host, optim, comm, expert_dp);
}

}  // namespace lm::train

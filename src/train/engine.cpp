// The engine factory: the device named on the command line -> its engine (train/engine.hpp).
#include "train/engine.hpp"

namespace lm::train {

void check_device(const std::string& device, const RunConfig& cfg) {
  LM_CHECK(device == "cpu" || device == "cuda", "train: --device must be cpu or cuda, not '{}'", device);
  if (device == "cuda") check_cuda_run(cfg);
}

std::unique_ptr<Engine> make_engine(const std::string& device, const RunConfig& cfg, model::Model<float>& host,
                                    Optimizer& optim, dist::Comm& comm, dist::Comm* expert_dp) {
  check_device(device, cfg);
  return device == "cuda" ? make_cuda_engine(cfg, host, optim, comm)
                          : make_cpu_engine(cfg, host, optim, comm, expert_dp);
}

}  // namespace lm::train

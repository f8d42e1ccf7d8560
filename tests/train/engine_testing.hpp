#pragma once
// Helpers of the training-engine tests (tests/train/test_engine.cpp, tests/dist/test_gpu_dp_cuda.cpp): a batch of
// fixed-pattern sequences and a host model with its optimiser.
#include <cstdint>
#include <memory>

#include "model/model.hpp"
#include "train/data.hpp"
#include "train/optim.hpp"

namespace lm::train::engine_testing {

// B sequences of T tokens of a fixed pattern; each predicts its next token (the last predicts nothing).
inline Batch batch(int64_t B, int64_t T, int32_t vocab) {
  Batch b;
  b.seqs = B, b.seq_len = T;
  for (int64_t s = 0; s < B; ++s) {
    for (int64_t t = 0; t < T; ++t) b.ids.push_back(static_cast<int32_t>((s * 7 + t * t * 3 + t) % vocab));
    for (int64_t t = 0; t < T; ++t) b.targets.push_back(t + 1 < T ? b.ids[s * T + t + 1] : kIgnore);
  }
  for (int64_t s = 0; s <= B; ++s) b.cu_seqlens.push_back(s * T);
  return b;
}

// A host model and optimiser, initialised and ready for gradients.
struct Host {
  Host(const model::ModelConfig& c, const OptimConfig& oc) : m(c) {
    m.params().init(3);
    m.params().enable_grads();
    optim = std::make_unique<Optimizer>(m.params(), c, oc);
  }
  model::Model<float> m;
  std::unique_ptr<Optimizer> optim;
};

}  // namespace lm::train::engine_testing

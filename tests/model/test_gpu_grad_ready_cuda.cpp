// GpuModel::set_grad_ready, the hook a data-parallel reducer sends gradients from while the backward goes on: every
// stage from L down to −1 is announced once, in order, and a parameter's gradient copied on the walk's stream when
// its stage (GpuModel::grad_stage) is announced is its final gradient, bit for bit (nothing writes it later), for
// AttnRes and plain residuals, layers recomputed and states offloaded. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "io/json.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "train/tiny_run.hpp"

using namespace lm;
using namespace lm::model;

namespace {

// The GPU trainer tests' tiny model, with AttnRes or plain residuals.
ModelConfig config(bool attn_res) {
  io::json j = io::json::parse(train::tiny::kTinyGpuModel);
  if (!attn_res) j.erase("attn_res_block_size");
  return ModelConfig::from_json(j, "grad ready test");
}

TEST(GpuGradReady, EveryStageOnceInOrderAndItsGradientsFinal) {
  if (!cuda::available()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    bool attn_res;
    std::vector<bool> keep;
    bool offload;
  };
  for (const Case& cs : {Case{true, {}, false}, Case{false, {true, false, true, false}, false},
                         Case{true, {false, true, false, true}, true}}) {
    const ModelConfig c = config(cs.attn_res);
    const int64_t L = c.num_hidden_layers;
    Model<float> host(c);
    host.params().init(7);
    cuda::GpuModel gpu(c);
    gpu.upload(host.params());
    gpu.set_keep_layers(cs.keep);
    gpu.set_offload_states(cs.offload);
    const cuda::GpuModel::Flat f = gpu.flat();
    float* snap = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&snap), f.P * 4), cudaSuccess);
    ASSERT_EQ(cudaMemset(snap, 0xff, f.P * 4), cudaSuccess);  // NaN: a parameter never announced shows
    std::vector<int64_t> seen;
    gpu.set_grad_ready([&](int64_t stage) {
      seen.push_back(stage);
      for (const auto& p : host.params().all()) {
        if (!p.spec.trainable || cuda::GpuModel::grad_stage(p.spec, L) != stage) continue;
        const cuda::ParamSlot s = gpu.slot(p.spec.name);
        // (the null stream: after every write the backward has queued so far)
        ASSERT_EQ(cudaMemcpyAsync(snap + s.off, f.grad + s.off, size_t(s.numel) * 4, cudaMemcpyDeviceToDevice, nullptr),
                  cudaSuccess);
      }
    });
    std::vector<int32_t> ids, targets;
    for (int64_t i = 0; i < 256; ++i) {
      ids.push_back(int32_t((i * 37 + i * i) % c.vocab_size));
      targets.push_back(i % 13 == 4 ? -100 : int32_t((i * 11 + 5) % c.vocab_size));
    }
    gpu.zero_grads();
    gpu.forward_backward(ids.data(), targets.data(), Seqs::packed({0, 100, 256}));
    gpu.set_grad_ready(nullptr);
    std::vector<int64_t> want;
    for (int64_t s = L; s >= -1; --s) want.push_back(s);
    EXPECT_EQ(seen, want) << "attn_res " << cs.attn_res;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got(f.P), final_grad(f.P);
    ASSERT_EQ(cudaMemcpy(got.data(), snap, f.P * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(final_grad.data(), f.grad, f.P * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t nonzero = 0;
    for (const auto& p : host.params().all()) {
      if (!p.spec.trainable) continue;
      const cuda::ParamSlot s = gpu.slot(p.spec.name);
      EXPECT_EQ(std::memcmp(got.data() + s.off, final_grad.data() + s.off, size_t(s.numel) * 4), 0)
          << p.spec.name << " (stage " << cuda::GpuModel::grad_stage(p.spec, L) << ") attn_res " << cs.attn_res
          << " offload " << cs.offload;
      for (int64_t i = 0; i < s.numel; ++i) nonzero += final_grad[s.off + size_t(i)] != 0.f;
    }
    EXPECT_GT(nonzero, 0);
    cudaFree(snap);
  }
}

// The stages of a model's parameters: decoder layers by index, the top (LM head, final norm, output AttnRes) at L,
// the embedding and the vision tower at the end (−1).
TEST(GpuGradReady, StagesOfTheParameters) {
  const ModelConfig c = config(true);
  const int64_t L = c.num_hidden_layers;
  for (const ParamSpec& s : model_param_specs(c)) {
    const int64_t st = cuda::GpuModel::grad_stage(s, L);
    if (s.name == "model.embed_tokens.weight") EXPECT_EQ(st, -1);
    else if (s.name == "lm_head.weight" || s.name == "model.norm.weight" || s.name.rfind("model.output_", 0) == 0)
      EXPECT_EQ(st, L) << s.name;
    else
      EXPECT_EQ(st, s.layer) << s.name;
  }
  ParamSpec tower;
  tower.component = Component::VisionTower, tower.layer = 2;
  EXPECT_EQ(cuda::GpuModel::grad_stage(tower, L), -1);
}

}  // namespace

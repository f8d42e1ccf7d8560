#pragma once
// The whole K3 / Kimi Linear decoder on one NVIDIA GPU (SPEC §1–§6): the same wiring as model::Model
// (model.cpp), with bf16 GEMM operands and activations, fp32 accumulation, an fp32 residual stream and AttnRes
// block sums, fp32 master weights, gradients and AdamW state. Plain C++ (no CUDA types), so the CLI includes it
// on machines without CUDA; every entry point then throws lm::Error ("built without CUDA").
//
// Legend: rows tokens of the batch (the layout of `Seqs`), d hidden, V vocabulary, P parameters.
// Device memory: flat fp32 arrays [P] (master, grad, AdamW m, v) and their bf16 copy [P]; the expert weights
// of each MoE layer lie as W13 [E, 2I, l] = per expert [w1; w3] and W2 [E, l, I] (the grouped-GEMM layouts),
// a dense FFN's gate_proj/up_proj as one [2I, d]. Activations kept for the backward are reused between steps.
// Kernels: cuBLAS for dense GEMMs (ops/gemm/cuda), the KDA, attention and MoE kernels of ops/*/cuda, and the
// elementwise ops (RMSNorm, AttnRes, embedding, cross-entropy, GLU, short conv) of ops/*/cuda.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/config.hpp"
#include "model/model.hpp"
#include "model/param_names.hpp"
#include "model/params.hpp"
#include "model/seqs.hpp"

namespace lm::model::cuda {

// True when longmoe was built with CUDA and a device is usable.
bool available();
// True when longmoe was built with CUDA (nvcc found at build time).
bool built_with_cuda();

struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  int64_t step = 1;         // 1-based, for the bias corrections
  double grad_scale = 1.0;  // gradients are multiplied by this first (the global-norm clip)
};

class GpuModel {
 public:
  // `decays` says which trainable parameters get weight decay (null: every tensor with ndim >= 2).
  explicit GpuModel(const ModelConfig& c, std::function<bool(const ParamSpec&)> decays = nullptr);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const;
  int64_t num_params() const;
  size_t device_bytes() const;  // parameters, optimiser state and kept activations now allocated

  void upload(const ParamStore<float>& ps);           // master weights (and their bf16 copy) from the host
  void download(ParamStore<float>& ps) const;         // master weights to the host
  void download_grads(ParamStore<float>& ps) const;   // gradients to the host (ps.enable_grads() first)
  void zero_grads();

  struct LossStats {
    double loss_sum = 0;
    int64_t n_valid = 0;
  };
  // Forward, mean cross-entropy over targets >= 0, backward into the gradients (accumulated, scaled by
  // 1 / n_valid, or 1 / n_valid_total when > 0). Host ids / targets [rows]; lm::Error for ids or targets
  // out of range (nothing on the device changes then).
  LossStats forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s, int64_t n_valid_total = 0);
  // Loss only.
  LossStats loss(const int32_t* ids, const int32_t* targets, const Seqs& s);

  // AdamW over every trainable parameter (fp32 master, then the bf16 copy).
  void adamw(const AdamWStep& a);
  // Quantile Balancing: each MoE layer's e_score_correction_bias from the last forward's routing.
  void balance();
  // Global L2 norm of the trainable parameters' gradients (double, deterministic).
  double grad_norm() const;
  // AdamW moments of one parameter (host arrays of its numel), for checkpoints in train::Optimizer's format.
  void get_adam(const std::string& name, float* m, float* v) const;
  void set_adam(const std::string& name, const float* m, const float* v);
  // Tokens routed to each expert of MoE layer `layer` in the last forward [E].
  std::vector<int64_t> expert_loads(int64_t layer) const;
  // Final hidden after the norm [rows, d] (bf16 rounded) of the last forward, for tests.
  std::vector<float> final_hidden() const;

  // Seconds per finer section ("kda.core.bwd", "moe.experts.fwd", ...) accumulated while profiling.
  std::vector<std::pair<std::string, double>> detail_profile() const;

  // When true, each part synchronises the device and adds its wall time to `profile`.
  bool profiling = false;
  Profile profile;

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace lm::model::cuda

#pragma once
// AdamW on the GPU over a GpuModel's flat parameter arrays (model/cuda/gpu_model.hpp: GpuModel::flat()): the fused
// update kernel (adamw.cu) and train::cuda::AdamW (adamw.cpp), which owns the moments m, v, steps every trainable
// parameter as train::Optimizer's AdamW does (optim.hpp) and reads or writes one parameter's moments for
// checkpoints. Plain C++ (no CUDA types), so the CLI includes it on machines without CUDA; device pointers; stream
// is a cudaStream_t as void*. Without CUDA every entry point throws lm::Error ("built without CUDA").
//
// Legend: P elements of the model's flat arrays, [0, decay_end) decaying and [decay_end, train_end) other trainable
//         ones (the QB biases after train_end are not stepped); n elements of one launch; t the 1-based step.
//   m = b1 m + (1−b1) g;  v = b2 v + (1−b2) g²;  w −= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd w);  wb = bf16(w)
//   bc1 = 1 − b1^t, bc2 = 1 − b2^t; g is multiplied by gscale first (the global-norm clip).
#include <cstddef>
#include <cstdint>
#include <string>

namespace lm::model::cuda {
class GpuModel;
}

namespace lm::train::cuda {

// One step's hyperparameters.
struct AdamWStep {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  int64_t step = 1;         // 1-based, for the bias corrections
  double grad_scale = 1.0;  // gradients are multiplied by this first (the global-norm clip)
};

// The kernel's arguments: AdamW on n fp32 master weights w with moments m, v and gradient g, then the bf16 copy wb.
struct AdamWArgs {
  float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.f, bc1 = 1.f, bc2 = 1.f, gscale = 1.f;
};
void adamw_update(float* w, const float* g, float* m, float* v, void* wb, int64_t n, const AdamWArgs& a,
                  void* stream = nullptr);
// The kernel's arguments of a step (bias corrections from a.step); wd is left 0: each launch sets its own.
AdamWArgs adamw_args(const AdamWStep& a);

// The optimiser of a GpuModel (which must outlive it): moments fp32 [P] each, zero at the start.
class AdamW {
 public:
  explicit AdamW(model::cuda::GpuModel& model);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // AdamW over every trainable parameter (fp32 master, then the bf16 copy), two launches (with and without weight
  // decay) on the default stream; then the model refreshes what derives from the bf16 copy.
  void step(const AdamWStep& a);
  // The moments of one parameter (host arrays of its numel), for checkpoints in train::Optimizer's format.
  void get(const std::string& name, float* m, float* v) const;
  void set(const std::string& name, const float* m, const float* v);
  size_t device_bytes() const;  // the moments

 private:
  model::cuda::GpuModel& model_;
  float* m_ = nullptr;
  float* v_ = nullptr;
  size_t P_ = 0;
};

}  // namespace lm::train::cuda

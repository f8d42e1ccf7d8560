// train::cuda::AdamW (adamw.hpp): the moments m, v of a GpuModel's flat arrays on the device, the two launches of
// a step (decaying tensors, then the other trainable ones) and one parameter's moments to or from the host.
//
// Legend: P elements of the model's flat arrays (GpuModel::flat()); a parameter's slot: its offset and numel in them.
#include "train/cuda/adamw.hpp"

#include "core/error.hpp"
#include "model/cuda/gpu_model.hpp"

#include <cmath>

namespace lm::train::cuda {
AdamWArgs adamw_args(const AdamWStep& a) {
  AdamWArgs k;
  k.lr = static_cast<float>(a.lr), k.b1 = static_cast<float>(a.beta1), k.b2 = static_cast<float>(a.beta2);
  k.eps = static_cast<float>(a.eps), k.gscale = static_cast<float>(a.grad_scale);
  k.bc1 = static_cast<float>(1.0 - std::pow(a.beta1, static_cast<double>(a.step)));
  k.bc2 = static_cast<float>(1.0 - std::pow(a.beta2, static_cast<double>(a.step)));
  return k;
}
}  // namespace lm::train::cuda

#ifndef LONGMOE_HAVE_CUDA

namespace lm::train::cuda {
[[noreturn]] static void no_cuda() { throw Error("longmoe was built without CUDA (nvcc was not found at build time)"); }
AdamW::AdamW(model::cuda::GpuModel& model) : model_(model) { no_cuda(); }
AdamW::~AdamW() = default;
void AdamW::step(const AdamWStep&) { no_cuda(); }
void AdamW::get(const std::string&, float*, float*) const { no_cuda(); }
void AdamW::set(const std::string&, const float*, const float*) { no_cuda(); }
size_t AdamW::device_bytes() const { no_cuda(); }
}  // namespace lm::train::cuda

#else

#include <cuda_runtime_api.h>

#include "core/cuda/check.hpp"

namespace lm::train::cuda {

namespace {
constexpr cu::Checker ck{"gpu model"};
float* alloc_zeros(size_t n) {
  void* p = nullptr;
  ck(cudaMalloc(&p, n * 4), fmt::format("cudaMalloc of {:.1f} MiB", n * 4 / 1048576.0).c_str());
  ck(cudaMemset(p, 0, n * 4), "memset");
  return static_cast<float*>(p);
}
}  // namespace

AdamW::AdamW(model::cuda::GpuModel& model) : model_(model), P_(model.flat().P) {
  m_ = alloc_zeros(P_);
  try {
    v_ = alloc_zeros(P_);
  } catch (...) {
    cudaFree(m_);
    throw;
  }
}
AdamW::~AdamW() {
  if (m_) cudaFree(m_);
  if (v_) cudaFree(v_);
}

void AdamW::step(const AdamWStep& a) {
  const model::cuda::GpuModel::Flat f = model_.flat();
  AdamWArgs k = adamw_args(a);
  auto run = [&](size_t b, size_t e, float wd) {
    k.wd = wd;
    adamw_update(f.master + b, f.grad + b, m_ + b, v_ + b, static_cast<uint16_t*>(f.bf16) + b,
                 static_cast<int64_t>(e - b), k);
  };
  run(0, f.decay_end, static_cast<float>(a.weight_decay));
  run(f.decay_end, f.train_end, 0.f);
  model_.weights_updated();
}

void AdamW::get(const std::string& name, float* m, float* v) const {
  const model::cuda::ParamSlot s = model_.slot(name);
  ck(cudaDeviceSynchronize(), "get_adam");
  ck(cudaMemcpy(m, m_ + s.off, size_t(s.numel) * 4, cudaMemcpyDeviceToHost), "get_adam");
  ck(cudaMemcpy(v, v_ + s.off, size_t(s.numel) * 4, cudaMemcpyDeviceToHost), "get_adam");
}

void AdamW::set(const std::string& name, const float* m, const float* v) {
  const model::cuda::ParamSlot s = model_.slot(name);
  ck(cudaMemcpy(m_ + s.off, m, size_t(s.numel) * 4, cudaMemcpyHostToDevice), "set_adam");
  ck(cudaMemcpy(v_ + s.off, v, size_t(s.numel) * 4, cudaMemcpyHostToDevice), "set_adam");
}

size_t AdamW::device_bytes() const { return P_ * 2 * 4; }

}  // namespace lm::train::cuda

#endif

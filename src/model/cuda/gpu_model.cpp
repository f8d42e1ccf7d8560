// The public API of GpuModel (gpu_model.hpp) over GpuModel::Impl (gpu_model_impl.hpp, whose parts lie in layout.cpp,
// kda_mixer.cpp, mla.cpp, ffn.cpp, moe.cpp and stack.cpp): weights to and from the host, a training step's forward,
// loss and backward, the flat arrays for the optimiser (train/cuda/adamw.hpp), Quantile Balancing, the gradient norm
// and the test and profiling read-outs; without CUDA, stubs that throw lm::Error.
//
// Legend: rows tokens, d hidden, V vocabulary, P parameter elements of the flat arrays (fp32 master and grad, bf16
//         copy); E experts of an MoE layer.
#include "model/cuda/gpu_model.hpp"

#include "core/error.hpp"

#ifndef LONGMOE_HAVE_CUDA

namespace lm::model::cuda {
bool available() { return false; }
bool built_with_cuda() { return false; }
struct GpuModel::Impl {};
[[noreturn]] static void no_cuda() { throw Error("longmoe was built without CUDA (nvcc was not found at build time)"); }
GpuModel::GpuModel(const ModelConfig&, std::function<bool(const ParamSpec&)>) { no_cuda(); }
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { no_cuda(); }
int64_t GpuModel::num_params() const { no_cuda(); }
size_t GpuModel::device_bytes() const { no_cuda(); }
void GpuModel::upload(const ParamStore<float>&) { no_cuda(); }
void GpuModel::download(ParamStore<float>&) const { no_cuda(); }
void GpuModel::download_grads(ParamStore<float>&) const { no_cuda(); }
void GpuModel::zero_grads() { no_cuda(); }
GpuModel::LossStats GpuModel::forward_backward(const int32_t*, const int32_t*, const Seqs&, int64_t) { no_cuda(); }
GpuModel::LossStats GpuModel::loss(const int32_t*, const int32_t*, const Seqs&) { no_cuda(); }
GpuModel::Flat GpuModel::flat() const { no_cuda(); }
ParamSlot GpuModel::slot(const std::string&) const { no_cuda(); }
void GpuModel::weights_updated() { no_cuda(); }
void GpuModel::balance() { no_cuda(); }
double GpuModel::grad_norm() const { no_cuda(); }
std::vector<int64_t> GpuModel::expert_loads(int64_t) const { no_cuda(); }
std::vector<float> GpuModel::final_hidden() const { no_cuda(); }
std::vector<std::pair<std::string, double>> GpuModel::detail_profile() const { no_cuda(); }
void GpuModel::reserve_caches(int64_t, int64_t) { no_cuda(); }
int64_t GpuModel::cache_slots() const { no_cuda(); }
int64_t GpuModel::slot_tokens(int64_t) const { no_cuda(); }
size_t GpuModel::cache_bytes() const { no_cuda(); }
std::vector<float> GpuModel::prefill(int64_t, const int32_t*, int64_t, std::vector<float>*) { no_cuda(); }
std::vector<float> GpuModel::decode(int64_t, int64_t, const int32_t*) { no_cuda(); }
void GpuModel::copy_slot(int64_t, int64_t) { no_cuda(); }
}  // namespace lm::model::cuda

#else

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "model/cuda/gpu_model_impl.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::model::cuda {

bool available() { return kc::device_count() > 0; }
bool built_with_cuda() { return true; }

GpuModel::GpuModel(const ModelConfig& c, std::function<bool(const ParamSpec&)> decays)
    : p_(std::make_unique<Impl>(c, decays)) {
  p_->prof = &profile;
}
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { return p_->c; }
int64_t GpuModel::num_params() const {
  int64_t n = 0;
  for (const auto& s : p_->specs) n += s.numel();
  return n;
}
size_t GpuModel::device_bytes() const { return p_->P * (2 * 4 + 2) + p_->wT.bytes + p_->act_bytes(); }

void GpuModel::upload(const ParamStore<float>& ps) {
  for (const auto& prm : ps.all()) {
    const auto& s = p_->slot(prm.spec.name);
    ck(cudaMemcpy(p_->M(prm.spec.name), prm.w(), size_t(s.numel) * 4, cudaMemcpyHostToDevice), "upload");
  }
  cast_f32_bf16(as<float>(p_->master.p), p_->wbf.p, static_cast<int64_t>(p_->P));
  p_->refresh_transposed();
  ck(cudaDeviceSynchronize(), "upload");
}
void GpuModel::download(ParamStore<float>& ps) const {
  ck(cudaDeviceSynchronize(), "download");
  for (auto& prm : ps.all())
    ck(cudaMemcpy(prm.w(), p_->M(prm.spec.name), size_t(p_->slot(prm.spec.name).numel) * 4, cudaMemcpyDeviceToHost),
       "download");
}
void GpuModel::download_grads(ParamStore<float>& ps) const {
  LM_CHECK(ps.has_grads(), "download_grads: the store has no gradients");
  ck(cudaDeviceSynchronize(), "download");
  for (auto& prm : ps.all())
    if (prm.g())
      ck(cudaMemcpy(prm.g(), p_->G(prm.spec.name), size_t(p_->slot(prm.spec.name).numel) * 4,
                    cudaMemcpyDeviceToHost),
         "download grads");
}
void GpuModel::zero_grads() { ck(cudaMemsetAsync(p_->grad.p, 0, p_->P * 4, nullptr), "zero grads"); }

GpuModel::LossStats GpuModel::forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                               int64_t n_valid_total) {
  LM_CHECK(targets, "forward_backward: targets are required");
  Impl& m = *p_;
  m.profiling = profiling;
  m.training = true;
  const int64_t n_here = m.forward(ids, targets, s);
  m.training = false;
  const int64_t n_norm = n_valid_total > 0 ? n_valid_total : n_here;
  float* d_hn = grow<float>(m.scratch.d_hn, size_t(m.rows) * m.d * 4);
  oc::CeResult r;
  {
    Impl::Timed t(m.part(Profile::LmHead, true));
    r = oc::cross_entropy_forward_backward(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows,
                                           m.d, m.V, n_norm > 0 ? 1.f / static_cast<float>(n_norm) : 0.f, d_hn,
                                           m.G("lm_head.weight"));
  }
  m.backward(d_hn);
  return LossStats{r.loss_sum, r.n_valid};
}

GpuModel::LossStats GpuModel::loss(const int32_t* ids, const int32_t* targets, const Seqs& s) {
  LM_CHECK(targets, "loss: targets are required");
  Impl& m = *p_;
  m.profiling = profiling;
  m.training = false;
  m.forward(ids, targets, s);
  Impl::Timed t(m.part(Profile::LmHead, false));
  const oc::CeResult r = oc::cross_entropy_forward(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p),
                                                   m.rows, m.d, m.V);
  return LossStats{r.loss_sum, r.n_valid};
}

GpuModel::Flat GpuModel::flat() const {
  const Impl& m = *p_;
  return Flat{as<float>(m.master.p), as<float>(m.grad.p), m.wbf.p, m.P, m.decay_end, m.train_end};
}
ParamSlot GpuModel::slot(const std::string& name) const { return p_->slot(name); }
void GpuModel::weights_updated() { p_->refresh_transposed(); }

void GpuModel::balance() {
  Impl& m = *p_;
  for (int64_t i = 0; i < m.L; ++i) {
    if (!m.plan[i].moe()) continue;
    const std::string b = m.P_(i) + ".block_sparse_moe.gate.e_score_correction_bias";
    oc::qb_update(got<float>(m.acts[i].moe.scores, i, "scores"), got<float>(m.acts[i].moe.alpha, i, "alpha"), m.M(b),
                  m.rows, m.c.num_experts, m.c.num_experts_per_token);
  }
}

double GpuModel::grad_norm() const {
  return std::sqrt(sum_squares(as<float>(p_->grad.p), static_cast<int64_t>(p_->train_end)));
}

std::vector<int64_t> GpuModel::expert_loads(int64_t layer) const {
  const Impl& m = *p_;
  LM_CHECK(layer >= 0 && layer < m.L && m.plan[layer].moe(), "expert_loads: layer {} is not an MoE layer", layer);
  ck(cudaEventSynchronize(m.offsets_h[layer].done), "expert loads");
  std::vector<int64_t> r(m.c.num_experts);
  for (int64_t e = 0; e < m.c.num_experts; ++e) r[e] = m.offsets_h[layer].p[e + 1] - m.offsets_h[layer].p[e];
  return r;
}

std::vector<std::pair<std::string, double>> GpuModel::detail_profile() const {
  return {p_->detail.begin(), p_->detail.end()};
}

std::vector<float> GpuModel::final_hidden() const {
  Impl& m = *p_;
  std::vector<uint16_t> b(size_t(m.rows) * m.d);
  ck(cudaMemcpy(b.data(), got(m.top.hn, "hn"), b.size() * 2, cudaMemcpyDeviceToHost), "final hidden");
  std::vector<float> r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = bf16_to_f32(b[i]);
  return r;
}

}  // namespace lm::model::cuda

#endif

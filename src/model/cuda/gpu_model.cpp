// The public API of GpuModel (gpu_model.hpp) over GpuModel::Impl (gpu_model_impl.hpp, whose parts lie in layout.cpp,
// kda_mixer.cpp, mla.cpp, ffn.cpp, moe.cpp and stack.cpp): weights to and from the host, a training step's forward,
// loss and backward, the flat arrays for the optimiser (train/cuda/adamw.hpp), Quantile Balancing, the gradient norm
// and the test and profiling read-outs; without CUDA, stubs that throw lm::Error.
//
// Legend: rows tokens, d hidden, V vocabulary, P parameter elements of the flat arrays (fp32 master and grad, bf16
//         copy); E experts of an MoE layer.
#include "model/cuda/gpu_model.hpp"

#include "core/error.hpp"

namespace lm::model::cuda {
// The backward (stack.cpp) ends with the embedding and the tower's blocks (whose `layer` is their block index).
int64_t GpuModel::grad_stage(const ParamSpec& s, int64_t layers) {
  if (s.component == Component::Embedding || is_vision_component(s.component)) return -1;
  return s.layer >= 0 ? s.layer : layers;
}
}  // namespace lm::model::cuda

#ifndef LONGMOE_HAVE_CUDA

namespace lm::model::cuda {
bool available() { return false; }
bool built_with_cuda() { return false; }
struct GpuModel::Impl {};
[[noreturn]] static void no_cuda() { throw Error("longmoe was built without CUDA (nvcc was not found at build time)"); }
size_t device_memory_used() { no_cuda(); }
size_t device_memory_total() { no_cuda(); }
double device_copy_bandwidth() { no_cuda(); }
void profiler_range(bool) { no_cuda(); }
GpuModel::GpuModel(const ModelConfig&, std::function<bool(const ParamSpec&)>) { no_cuda(); }
GpuModel::GpuModel(const ModelConfig&, Inference) { no_cuda(); }
bool GpuModel::inference_only() const { no_cuda(); }
void GpuModel::init_random(uint64_t, double) { no_cuda(); }
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { no_cuda(); }
int64_t GpuModel::num_params() const { no_cuda(); }
size_t GpuModel::device_bytes() const { no_cuda(); }
void GpuModel::upload(const ParamStore<float>&) { no_cuda(); }
void GpuModel::download(ParamStore<float>&) const { no_cuda(); }
void GpuModel::download_grads(ParamStore<float>&) const { no_cuda(); }
void GpuModel::zero_grads() { no_cuda(); }
GpuModel::LossStats GpuModel::forward_backward(const int32_t*, const int32_t*, const Seqs&, int64_t,
                                               const Media<float>*, std::span<const float>) {
  no_cuda();
}
void GpuModel::set_keep_layers(std::vector<bool>) { no_cuda(); }
std::vector<bool> GpuModel::keep_layers() const { no_cuda(); }
void GpuModel::set_offload_states(bool) { no_cuda(); }
bool GpuModel::offload_states() const { no_cuda(); }
GpuTrainingMemory GpuModel::plan_memory(int64_t) { no_cuda(); }
GpuModel::LossStats GpuModel::loss(const int32_t*, const int32_t*, const Seqs&, const Media<float>*) { no_cuda(); }
std::vector<float> GpuModel::media_features(const Media<float>&, int64_t*) { no_cuda(); }
std::vector<float> GpuModel::target_logprobs(const int32_t*, const int32_t*, const Seqs&) { no_cuda(); }
std::vector<float> GpuModel::forward_backward_logp(const int32_t*, const int32_t*, const Seqs&, const LogpGrad&) {
  no_cuda();
}
int32_t GpuModel::media_placeholder() const { no_cuda(); }
GpuModel::Flat GpuModel::flat() const { no_cuda(); }
void GpuModel::balance(const std::function<RouterRows(const RouterRows&)>&) { no_cuda(); }
void GpuModel::set_grad_ready(std::function<void(int64_t)>) { no_cuda(); }
ParamSlot GpuModel::slot(const std::string&) const { no_cuda(); }
void GpuModel::weights_updated() { no_cuda(); }
void GpuModel::balance() { no_cuda(); }
double GpuModel::grad_norm() const { no_cuda(); }
std::vector<int64_t> GpuModel::expert_loads(int64_t) const { no_cuda(); }
std::vector<float> GpuModel::final_hidden() const { no_cuda(); }
std::vector<std::pair<std::string, double>> GpuModel::detail_profile() const { no_cuda(); }
void GpuModel::reserve_caches(int64_t, int64_t, int64_t) { no_cuda(); }
int64_t GpuModel::free_cache_tokens() const { no_cuda(); }
int64_t GpuModel::blocks_needed(int64_t, int64_t) const { no_cuda(); }
void GpuModel::set_decode_graphs(bool) { no_cuda(); }
bool GpuModel::decode_graphs() const { no_cuda(); }
int64_t GpuModel::decode_captures() const { no_cuda(); }
std::string GpuModel::decode_graph_nodes() const { no_cuda(); }
int64_t GpuModel::cache_slots() const { no_cuda(); }
int64_t GpuModel::slot_tokens(int64_t) const { no_cuda(); }
size_t GpuModel::cache_bytes() const { no_cuda(); }
std::vector<float> GpuModel::prefill(int64_t, const int32_t*, int64_t, std::vector<float>*, std::span<const float>) {
  no_cuda();
}
std::vector<float> GpuModel::extend(int64_t, const int32_t*, int64_t, std::vector<float>*, std::span<const float>) {
  no_cuda();
}
std::vector<float> GpuModel::decode(int64_t, int64_t, const int32_t*) { no_cuda(); }
void GpuModel::decode(int64_t, int64_t, const int32_t*, float*) { no_cuda(); }
void GpuModel::copy_slot(int64_t, int64_t) { no_cuda(); }
void GpuModel::release_slot(int64_t) { no_cuda(); }
void GpuModel::reserve_snapshots(int64_t) { no_cuda(); }
int64_t GpuModel::snapshot_count() const { no_cuda(); }
size_t GpuModel::snapshot_bytes() const { no_cuda(); }
void GpuModel::save_snapshot(int64_t, int64_t) { no_cuda(); }
void GpuModel::load_snapshot(int64_t, int64_t) { no_cuda(); }
void GpuModel::drop_snapshot(int64_t) { no_cuda(); }
int64_t GpuModel::snapshot_tokens(int64_t) const { no_cuda(); }
}  // namespace lm::model::cuda

#else

#include <cuda_profiler_api.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>
#include <unistd.h>  // sysconf: the host memory

#include "core/cuda/device.hpp"
#include "core/half.hpp"
#include "core/rng.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "model/cuda/gpu_model_impl.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::model::cuda {

bool available() { return kc::device_count() > 0; }
bool built_with_cuda() { return true; }
size_t device_memory_used() {
  size_t free = 0, total = 0;
  ck(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total - free;
}
size_t device_memory_total() {
  size_t free = 0, total = 0;
  ck(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return total;
}
double device_copy_bandwidth() {
  const double bw = cu::copy_bandwidth();
  LM_CHECK(bw > 0, "gpu model: the device copy bandwidth could not be measured");
  return bw;
}
void profiler_range(bool on) { ck(on ? cudaProfilerStart() : cudaProfilerStop(), "profiler range"); }

GpuModel::GpuModel(const ModelConfig& c, std::function<bool(const ParamSpec&)> decays)
    : p_(std::make_unique<Impl>(c, decays, false)) {
  p_->prof = &profile;
}
GpuModel::GpuModel(const ModelConfig& c, Inference) : p_(std::make_unique<Impl>(c, nullptr, true)) {
  p_->prof = &profile;
}
bool GpuModel::inference_only() const { return p_->infer_only; }

void GpuModel::init_random(uint64_t seed, double init_scale) {
  Impl& m = *p_;
  LM_CHECK(m.infer_only, "gpu model: init_random is for inference-only models (a training run starts from "
           "ParamStore::init and upload)");
  int64_t L = 1;
  for (const ParamSpec& s : m.specs) L = std::max<int64_t>(L, s.layer + 1);
  std::vector<float> h;
  std::vector<uint16_t> hb;
  for (size_t ti = 0; ti < m.specs.size(); ++ti) {
    const ParamSpec& s = m.specs[ti];
    const Rng r = Rng{seed, 0}.fork(ti);
    const double sd = init_normal_sd(s, L, init_scale);
    void* wb = m.W(s.name);
    if (!Impl::fp32_read(s) && sd > 0) {  // the big matrices: drawn on the device
      fill_normal_bf16(wb, s.numel(), float(sd), (seed << 20) ^ ti);
      continue;
    }
    h.resize(size_t(s.numel()));
    if (sd > 0) {
      for (int64_t i = 0; i < s.numel(); ++i) h[size_t(i)] = float(sd * r.normal_f64(uint64_t(i)));
    } else {
      init_fixed(s, r, h.data());
    }
    hb.resize(h.size());
    for (size_t i = 0; i < h.size(); ++i) hb[i] = f32_to_bf16(h[i]);
    ck(cudaMemcpy(wb, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice), "init");
    ck(cudaMemcpy(m.M(s.name), h.data(), h.size() * 4, cudaMemcpyHostToDevice), "init");
  }
  ck(cudaDeviceSynchronize(), "init");
}
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { return p_->c; }
int64_t GpuModel::num_params() const {
  int64_t n = 0;
  for (const auto& s : p_->specs) n += s.numel();
  return n;
}
size_t GpuModel::device_bytes() const {
  return p_->master.bytes + p_->grad.bytes + p_->wbf.bytes + p_->small.bytes + p_->wT.bytes + p_->act_bytes();
}

void GpuModel::upload(const ParamStore<float>& ps) {
  if (p_->infer_only) {  // bf16 on the host, one tensor at a time; the small ones in fp32 too
    std::vector<uint16_t> hb;
    for (const auto& prm : ps.all()) {
      const int64_t n = p_->slot(prm.spec.name).numel;
      hb.resize(size_t(n));
      for (int64_t i = 0; i < n; ++i) hb[size_t(i)] = f32_to_bf16(prm.w()[i]);
      ck(cudaMemcpy(p_->W(prm.spec.name), hb.data(), size_t(n) * 2, cudaMemcpyHostToDevice), "upload");
      if (Impl::fp32_read(prm.spec))
        ck(cudaMemcpy(p_->M(prm.spec.name), prm.w(), size_t(n) * 4, cudaMemcpyHostToDevice), "upload");
    }
    ck(cudaDeviceSynchronize(), "upload");
    return;
  }
  for (const auto& prm : ps.all()) {
    const auto& s = p_->slot(prm.spec.name);
    ck(cudaMemcpy(p_->M(prm.spec.name), prm.w(), size_t(s.numel) * 4, cudaMemcpyHostToDevice), "upload");
  }
  cast_f32_bf16(as<float>(p_->master.p), p_->wbf.p, static_cast<int64_t>(p_->P));
  p_->refresh_transposed();
  ck(cudaDeviceSynchronize(), "upload");
}
void GpuModel::download(ParamStore<float>& ps) const {
  LM_CHECK(!p_->infer_only, "gpu model: an inference-only model has no fp32 weights to download");
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
void GpuModel::zero_grads() { ck(cudaMemsetAsync(p_->grad.p, 0, p_->P * 4, p_->walk()), "zero grads"); }

GpuModel::LossStats GpuModel::forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                               int64_t n_valid_total, const Media<float>* media,
                                               std::span<const float> weights) {
  LM_CHECK(targets, "forward_backward: targets are required");
  LM_CHECK(weights.empty() || std::ssize(weights) == s.rows(), "forward_backward: {} weights for {} rows",
           weights.size(), s.rows());
  Impl& m = *p_;
  const Impl::SpliceScope splice{m, {media, nullptr, 0}};
  LM_CHECK(!m.infer_only, "gpu model: an inference-only model cannot train (it holds bf16 weights only)");
  LM_CHECK(ffn_rows >= 1, "gpu model: ffn_rows must be >= 1 (got {})", ffn_rows);
  m.ffn_rows = ffn_rows;
  m.profiling = profiling;
  m.training = true;  // through the backward (layer_acts: a recompute's buffers)
  const ClearOnExit leave{m.training};
  const int64_t n_here = m.forward(ids, targets, s);
  const int64_t n_norm = n_valid_total > 0 ? n_valid_total : n_here;
  float* d_hn = grow<float>(m.scratch.d_hn, size_t(m.rows) * m.d * 4);
  const float inv = n_norm > 0 ? 1.f / static_cast<float>(n_norm) : 0.f;
  oc::CeResult r;
  if (weights.empty()) {
    Impl::Timed t(m.part(Profile::LmHead, true));
    r = oc::cross_entropy_forward_backward(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows,
                                           m.d, m.V, inv, d_hn, m.G("lm_head.weight"));
  } else {  // (the same pass with a scale per row)
    std::vector<float> scale(weights.begin(), weights.end());
    for (float& x : scale) x *= inv;
    float* sd = grow<float>(m.scratch.rl_scale, scale.size() * 4);
    ck(cudaMemcpy(sd, scale.data(), scale.size() * 4, cudaMemcpyHostToDevice), "row scales");
    Impl::Timed t(m.part(Profile::LmHead, true));
    r = oc::cross_entropy_backward_rows(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows,
                                        m.d, m.V, sd, d_hn, m.G("lm_head.weight"));
  }
  m.backward(d_hn);
  return LossStats{r.loss_sum, r.n_valid};
}

void GpuModel::set_keep_layers(std::vector<bool> keep) {
  Impl& m = *p_;
  LM_CHECK(keep.empty() || int64_t(keep.size()) == m.L, "gpu model: a memory plan of {} layers for a model of {}",
           keep.size(), m.L);
  m.keep.assign(keep.begin(), keep.end());
}
std::vector<bool> GpuModel::keep_layers() const {
  const Impl& m = *p_;
  std::vector<bool> r(size_t(m.L), true);
  for (size_t i = 0; i < m.keep.size(); ++i) r[i] = m.keep[i] != 0;
  return r;
}

void GpuModel::set_offload_states(bool on) { p_->offload = on; }
bool GpuModel::offload_states() const { return p_->offload; }

GpuTrainingMemory GpuModel::plan_memory(int64_t rows) {
  const double host = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  GpuTrainingMemory m = gpu_training_plan(p_->c, rows, 0.97 * double(device_memory_total()), 0.5 * host);
  p_->release_activations();  // (the plan counts only its own buffers)
  set_keep_layers(m.keep);
  set_offload_states(m.offload);
  return m;
}

GpuModel::LossStats GpuModel::loss(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                   const Media<float>* media) {
  LM_CHECK(targets, "loss: targets are required");
  Impl& m = *p_;
  const Impl::SpliceScope splice{m, {media, nullptr, 0}};
  m.profiling = profiling;
  m.training = false;
  m.forward(ids, targets, s);
  Impl::Timed t(m.part(Profile::LmHead, false));
  const oc::CeResult r = oc::cross_entropy_forward(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p),
                                                   m.rows, m.d, m.V);
  return LossStats{r.loss_sum, r.n_valid};
}

std::vector<float> GpuModel::target_logprobs(const int32_t* ids, const int32_t* targets, const Seqs& s) {
  LM_CHECK(targets, "target_logprobs: targets are required");
  Impl& m = *p_;
  m.profiling = profiling;
  m.training = false;
  m.forward(ids, targets, s);
  std::vector<float> lp(size_t(m.rows));
  oc::cross_entropy_rows(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows, m.d, m.V,
                         lp.data());
  for (float& x : lp) x = -x;  // (ignored rows hold 0)
  return lp;
}

std::vector<float> GpuModel::forward_backward_logp(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                                   const LogpGrad& dloss) {
  LM_CHECK(targets, "forward_backward_logp: targets are required");
  Impl& m = *p_;
  LM_CHECK(!m.infer_only, "gpu model: an inference-only model cannot train (it holds bf16 weights only)");
  m.ffn_rows = ffn_rows;
  m.profiling = profiling;
  m.training = true;
  const ClearOnExit leave{m.training};
  m.forward(ids, targets, s);
  std::vector<float> lp(size_t(m.rows));
  {
    Impl::Timed t(m.part(Profile::LmHead, false));
    oc::cross_entropy_rows(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows, m.d, m.V,
                           lp.data());
  }
  for (float& x : lp) x = -x;
  std::vector<float> scale = dloss(lp);
  LM_CHECK(std::ssize(scale) == m.rows, "forward_backward_logp: dloss gave {} values for {} rows", scale.size(),
           m.rows);
  for (float& x : scale) x = -x;  // loss_t = −logp_t
  float* sd = grow<float>(m.scratch.rl_scale, size_t(m.rows) * 4);
  ck(cudaMemcpy(sd, scale.data(), scale.size() * 4, cudaMemcpyHostToDevice), "row scales");
  float* d_hn = grow<float>(m.scratch.d_hn, size_t(m.rows) * m.d * 4);
  {
    Impl::Timed t(m.part(Profile::LmHead, true));
    oc::cross_entropy_backward_rows(got(m.top.hn, "hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows, m.d,
                                    m.V, sd, d_hn, m.G("lm_head.weight"));
  }
  m.backward(d_hn);
  return lp;
}

std::vector<float> GpuModel::media_features(const Media<float>& media, int64_t* rows) {
  Impl& m = *p_;
  LM_CHECK(m.placeholder >= 0, "images need 'vision_config.media_placeholder_token_id' (the prompt token their "
           "features replace) and a model with a vision tower");
  m.profiling = profiling;
  int64_t M = 0;
  const auto* f = static_cast<const uint16_t*>(m.vision_forward(media, &M));
  std::vector<uint16_t> b(size_t(M * m.d));
  ck(cudaMemcpy(b.data(), f, b.size() * 2, cudaMemcpyDeviceToHost), "media features");
  std::vector<float> r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = bf16_to_f32(b[i]);
  if (rows) *rows = M;
  return r;
}
int32_t GpuModel::media_placeholder() const { return p_->placeholder; }

GpuModel::Flat GpuModel::flat() const {
  const Impl& m = *p_;
  LM_CHECK(!m.infer_only, "gpu model: an inference-only model has no optimiser view");
  return Flat{as<float>(m.master.p), as<float>(m.grad.p), m.wbf.p, m.P, m.decay_end, m.train_end};
}
ParamSlot GpuModel::slot(const std::string& name) const { return p_->slot(name); }
void GpuModel::weights_updated() { p_->refresh_transposed(); }

void GpuModel::balance() { balance([](const RouterRows& mine) { return mine; }); }
void GpuModel::balance(const std::function<RouterRows(const RouterRows&)>& gather) {
  Impl& m = *p_;
  for (int64_t i = 0; i < m.L; ++i) {
    if (!m.plan[i].moe()) continue;
    const std::string b = m.P_(i) + ".block_sparse_moe.gate.e_score_correction_bias";
    const RouterRows all = gather(
        RouterRows{got<float>(m.acts[i].moe.scores, i, "scores"), got<float>(m.acts[i].moe.alpha, i, "alpha"), m.rows});
    oc::qb_update(all.scores, all.alpha, m.M(b), all.rows, m.c.num_experts, m.c.num_experts_per_token);
  }
}

void GpuModel::set_grad_ready(std::function<void(int64_t)> hook) { p_->grad_ready = std::move(hook); }

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

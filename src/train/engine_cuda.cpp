// The CUDA training engine: model::cuda::GpuModel runs forward, backward, AdamW and Quantile Balancing on the
// GPU. The host model and optimiser hold the weights and AdamW state it starts from and receive the GPU's
// (sync_to_host) for each checkpoint, so the files are the same as the CPU engine's.
// Plain C++: without CUDA, GpuModel's entry points throw ("built without CUDA"), and check_cuda_run refuses first.
#include <cmath>
#include <map>

#include "model/cuda/gpu_model.hpp"
#include "train/cuda/adamw.hpp"
#include "train/balancer.hpp"
#include "train/engine.hpp"

namespace lm::train {

void check_cuda_run(const RunConfig& cfg) {
  LM_CHECK(cfg.optim.kind == "adamw",
           "train --device cuda: optimizer.kind must be \"adamw\" (Muon runs on the CPU only), not \"{}\"",
           cfg.optim.kind);
  LM_CHECK(cfg.balance == Balance::None || (cfg.balance == Balance::QB && cfg.qb_estimator == "exact"),
           "train --device cuda: balance must be qb with the exact estimator, or none (got {})",
           balance_name(cfg.balance));
  LM_CHECK(model::cuda::available(), "train --device cuda: no usable CUDA device{}",
           model::cuda::built_with_cuda() ? "" : " (longmoe was built without CUDA: nvcc was not found)");
}

namespace {

const char* kAdamM = "optim.adamw.m.";  // train::Optimizer's state names (optim.hpp)
const char* kAdamV = "optim.adamw.v.";

class CudaEngine final : public Engine {
 public:
  // The host's weights and AdamW moments, moved to the device.
  CudaEngine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim)
      : oc_(cfg.optim),
        balance_(cfg.balance),
        host_(host),
        optim_(optim),
        bal_(cfg, host),
        t_(optim.step_count()),
        gm_(host.config(), [mc = host.config(), oc = cfg.optim](const model::ParamSpec& s) {
          return param_rule(s, mc, oc).decay;
        }),
        adam_(gm_) {
    gm_.upload(host.params());
    std::map<std::string, Tensor> st;
    for (auto& [name, t] : optim.state()) st.emplace(name, t);
    for (const auto& pr : host.params().all()) {
      auto im = st.find(kAdamM + pr.spec.name), iv = st.find(kAdamV + pr.spec.name);
      if (im != st.end() && iv != st.end())
        adam_.set(pr.spec.name, im->second.data<float>(), iv->second.data<float>());
    }
  }

  std::string where() const override { return "on the GPU"; }
  std::string plan(int64_t rows) override { return model::gpu_training_summary(gm_.plan_memory(rows), gm_.config()); }

  void zero_grads(int64_t) override {
    gm_.zero_grads();
    bal_.clear();
  }

  // The loads come from the GPU; Quantile Balancing reads the scores there.
  LossStats forward_backward(const Batch& b, int64_t n_valid_total, const model::Media<float>* media) override {
    const auto st = gm_.forward_backward(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens),
                                         n_valid_total, media);
    if (!std::isfinite(st.loss_sum)) throw NonFinite(fmt::format("the loss became {} on the GPU", st.loss_sum));
    for (size_t li = 0; li < bal_.layers().size(); ++li) bal_.add_loads(li, gm_.expert_loads(bal_.layers()[li]).data());
    return {st.loss_sum, st.n_valid};
  }

  LossStats loss(const Batch& b, const model::Media<float>* media) override {
    const auto st = gm_.loss(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), media);
    return {st.loss_sum, st.n_valid};
  }

  // AdamW as train::Optimizer does it: global-norm clip, then the update (and the bf16 copy).
  StepInfo step(double lr_factor) override {
    StepInfo info;
    info.grad_norm = gm_.grad_norm();
    if (!std::isfinite(info.grad_norm)) throw NonFinite("a gradient became NaN/Inf on the GPU");
    if (oc_.clip > 0 && info.grad_norm > oc_.clip) info.clip_coef = oc_.clip / (info.grad_norm + 1e-6);
    info.lr_adamw = info.lr_muon = oc_.lr_adamw * lr_factor;
    cuda::AdamWStep as;
    as.lr = info.lr_adamw, as.beta1 = oc_.beta1, as.beta2 = oc_.beta2, as.eps = oc_.eps;
    as.weight_decay = oc_.weight_decay, as.step = ++t_, as.grad_scale = info.clip_coef;
    adam_.step(as);
    return info;
  }

  void balance() override {
    if (balance_ == Balance::QB) gm_.balance();
  }
  const std::vector<std::vector<int64_t>>& expert_loads() const override { return bal_.loads(); }
  double aux_loss() const override { return 0; }  // balance aux is refused on the GPU

  // The GPU's weights and AdamW state, in train::Optimizer's format (step count and both moments).
  void sync_to_host() override {
    gm_.download(host_.params());
    std::map<std::string, Tensor> st;
    st.emplace("optim.step", Tensor::from_vector<int64_t>({t_}, {1}));
    for (const auto& [name, t] : optim_.state()) {
      if (name.rfind(kAdamM, 0) != 0) continue;
      const std::string pn = name.substr(std::string(kAdamM).size());
      Tensor mt = Tensor::empty(t.shape(), DType::F32), vt = Tensor::empty(t.shape(), DType::F32);
      adam_.get(pn, mt.data<float>(), vt.data<float>());
      st.emplace(name, std::move(mt));
      st.emplace(kAdamV + pn, std::move(vt));
    }
    optim_.load_state(st, "GPU optimizer state");
  }

  std::vector<float> target_logprobs(const Batch& b) override {
    return gm_.target_logprobs(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens));
  }
  std::vector<float> forward_backward_logp(const Batch& b, const model::Model<float>::LogpGrad& dloss) override {
    return gm_.forward_backward_logp(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), dloss);
  }
  model::cuda::GpuModel* gpu_model() override { return &gm_; }

 private:
  const OptimConfig oc_;
  const Balance balance_;
  model::Model<float>& host_;
  Optimizer& optim_;
  Balancer bal_;
  int64_t t_;  // AdamW steps taken (bias corrections)
  model::cuda::GpuModel gm_;
  cuda::AdamW adam_;  // gm_'s AdamW moments
};

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim) {
  return std::make_unique<CudaEngine>(cfg, host, optim);
}

}  // namespace lm::train

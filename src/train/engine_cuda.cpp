// The CUDA training engine: model::cuda::GpuModel runs forward, backward, AdamW and Quantile Balancing on the
// GPU. The host model and optimiser hold the weights and AdamW state it starts from and receive the GPU's
// (sync_to_host) for each checkpoint, so the files are the same as the CPU engine's.
// Data parallel (a job of several processes, one GPU each): train::cuda::DataParallel sums the gradients over NCCL
// while the last micro-batch's backward runs, and with parallel.zero 1 shards AdamW's moments over the replicas
// (train::Optimizer's own sharding in the checkpoints); Quantile Balancing reads every replica's router statistics.
// Plain C++: without CUDA, GpuModel's entry points throw ("built without CUDA"), and check_cuda_run refuses first.
#include <cmath>
#include <map>

#include "core/env.hpp"
#include "dist/nccl.hpp"
#include "model/cuda/gpu_model.hpp"
#include "train/balancer.hpp"
#include "train/cuda/adamw.hpp"
#include "train/cuda/data_parallel.hpp"
#include "train/engine.hpp"

namespace lm::train {

void check_cuda_run(const RunConfig& cfg) {
  LM_CHECK(cfg.optim.kind == "adamw",
           "train --device cuda: optimizer.kind must be \"adamw\" (Muon runs on the CPU only), not \"{}\"",
           cfg.optim.kind);
  LM_CHECK(cfg.balance == Balance::None || (cfg.balance == Balance::QB && cfg.qb_estimator == "exact"),
           "train --device cuda: balance must be qb with the exact estimator, or none (got {})",
           balance_name(cfg.balance));
  LM_CHECK(cfg.parallel.ep == 1, "train --device cuda: expert parallelism (parallel.ep {}) runs on the CPU only so "
           "far; the GPU runs data parallel (parallel.dp) alone", cfg.parallel.ep);
  LM_CHECK(cfg.parallel.cp == 1, "train --device cuda: context parallelism (parallel.cp {}) runs on the CPU only so "
           "far; the GPU runs data parallel (parallel.dp) alone", cfg.parallel.cp);
  LM_CHECK(cfg.parallel.dp == 1 || dist::built_with_nccl(), "train --device cuda: parallel.dp {} sums the gradients "
           "over NCCL, and longmoe was built without it (set LONGMOE_NCCL_ROOT to NCCL's folder and rebuild)",
           cfg.parallel.dp);
  LM_CHECK(cfg.parallel.dp == 1 || cfg.parallel.zero == 0 || cuda::kBucketQuantum % size_t(cfg.parallel.dp) == 0,
           "train --device cuda: parallel.zero 1 splits every gradient bucket into dp equal blocks, which needs dp "
           "dividing {} (got dp {}); use parallel.zero 0", cuda::kBucketQuantum, cfg.parallel.dp);
  LM_CHECK(model::cuda::available(), "train --device cuda: no usable CUDA device{}",
           model::cuda::built_with_cuda() ? "" : " (longmoe was built without CUDA: nvcc was not found)");
}

namespace {

const char* kAdamM = "optim.adamw.m.";  // train::Optimizer's state names (optim.hpp)
const char* kAdamV = "optim.adamw.v.";

// The GPU of this process: in a data-parallel job, its index among the job's processes on its host.
int pick_device(dist::Comm& comm, bool data_parallel) { return data_parallel ? dist::use_local_device(comm) : 0; }

class CudaEngine final : public Engine {
 public:
  // The host's weights and AdamW moments, moved to the device.
  CudaEngine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim, dist::Comm& comm)
      : oc_(cfg.optim),
        balance_(cfg.balance),
        host_(host),
        optim_(optim),
        comm_(comm),
        nccl_(comm.size() > 1 || env::nccl()),
        device_(pick_device(comm, nccl_)),
        bal_(cfg, host),
        t_(optim.step_count()),
        gm_(host.config(), [mc = host.config(), oc = cfg.optim](const model::ParamSpec& s) {
          return param_rule(s, mc, oc).decay;
        }) {
    gm_.upload(host.params());
    if (nccl_) {
      dc_ = dist::DeviceComm::make(comm);
      std::vector<model::ParamSpec> specs;
      for (const auto& pr : host.params().all()) specs.push_back(pr.spec);
      dp_ = std::make_unique<cuda::DataParallel>(gm_, specs, *dc_, comm, cfg.parallel.zero == 1,
                                                 size_t(std::max(env::dp_bucket_mb(), 1)) << 20);
    }
    if (!dp_ || !dp_->zero1()) adam_ = std::make_unique<cuda::AdamW>(gm_);
    // The moments this rank holds on the host (all of them, or its train::Optimizer shard under ZeRO-1).
    std::map<std::string, Tensor> st;
    for (auto& [name, t] : optim.state()) st.emplace(name, t);
    std::map<std::string, std::pair<const float*, const float*>> mine;
    for (const auto& pr : host.params().all()) {
      auto im = st.find(kAdamM + pr.spec.name), iv = st.find(kAdamV + pr.spec.name);
      if (im == st.end() || iv == st.end()) continue;
      if (adam_) adam_->set(pr.spec.name, im->second.data<float>(), iv->second.data<float>());
      else if (optim.owner(pr.spec.name) == comm.rank())  // (each parameter from one rank)
        mine.emplace(pr.spec.name, std::pair{im->second.data<float>(), iv->second.data<float>()});
    }
    if (!adam_) dp_->load_moments(mine);
  }

  std::string where() const override {
    if (!dp_) return "on the GPU";
    return fmt::format("on {} GPU{}, data parallel over {}{}", dc_->size(), dc_->size() == 1 ? "" : "s",
                       dc_->name(), dp_->zero1() ? ", ZeRO-1" : "");
  }
  std::string plan(int64_t rows) override { return model::gpu_training_summary(gm_.plan_memory(rows), gm_.config()); }
  double device_memory_in_use() const override { return static_cast<double>(model::cuda::device_memory_used()); }

  void zero_grads(int64_t micro_batches) override {
    gm_.zero_grads();
    bal_.clear();
    micro_left_ = micro_batches;
  }

  // The loads come from the GPU; Quantile Balancing reads the scores there. Data parallel: the step's last
  // micro-batch sends its gradients while its backward runs.
  LossStats forward_backward(const Batch& b, int64_t n_valid_total, const model::Media<float>* media) override {
    const bool last = dp_ && micro_left_ == 1;
    if (micro_left_ > 0) --micro_left_;
    if (last) dp_->arm();
    struct Disarm {
      cuda::DataParallel* dp;
      ~Disarm() {
        if (dp) dp->disarm();
      }
    } disarm{last ? dp_.get() : nullptr};
    const auto st = gm_.forward_backward(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens),
                                         n_valid_total, media, b.weights);
    if (!std::isfinite(st.loss_sum)) throw NonFinite(fmt::format("the loss became {} on the GPU", st.loss_sum));
    for (size_t li = 0; li < bal_.layers().size(); ++li) bal_.add_loads(li, gm_.expert_loads(bal_.layers()[li]).data());
    return {st.loss_sum, st.n_valid};
  }

  LossStats loss(const Batch& b, const model::Media<float>* media) override {
    const auto st = gm_.loss(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), media);
    return {st.loss_sum, st.n_valid};
  }

  // AdamW as train::Optimizer does it: global-norm clip, then the update (and the bf16 copy). Data parallel: the
  // summed gradients (every replica the same norm, so all throw NonFinite or none).
  StepInfo step(double lr_factor) override {
    if (dp_) dp_->finish();
    StepInfo info;
    info.grad_norm = dp_ ? dp_->grad_norm() : gm_.grad_norm();
    if (!std::isfinite(info.grad_norm)) throw NonFinite("a gradient became NaN/Inf on the GPU");
    if (oc_.clip > 0 && info.grad_norm > oc_.clip) info.clip_coef = oc_.clip / (info.grad_norm + 1e-6);
    info.lr_adamw = info.lr_muon = oc_.lr_adamw * lr_factor;
    cuda::AdamWStep as;
    as.lr = info.lr_adamw, as.beta1 = oc_.beta1, as.beta2 = oc_.beta2, as.eps = oc_.eps;
    as.weight_decay = oc_.weight_decay, as.step = ++t_, as.grad_scale = info.clip_coef;
    if (adam_)
      adam_->step(as);
    else
      dp_->step(as);
    return info;
  }

  // Data parallel: every replica's routing (so that all install the same biases) and the summed loads.
  void balance() override {
    if (balance_ == Balance::QB) {
      if (dp_)
        dp_->balance();
      else
        gm_.balance();
    }
    if (comm_.size() > 1) bal_.reduce(comm_);
  }
  const std::vector<std::vector<int64_t>>& expert_loads() const override { return bal_.loads(); }
  double aux_loss() const override { return 0; }  // balance aux is refused on the GPU

  // The GPU's weights and AdamW state, in train::Optimizer's format (step count and the moments this rank holds).
  void sync_to_host() override {
    gm_.download(host_.params());
    std::map<std::string, Tensor> st;
    st.emplace("optim.step", Tensor::from_vector<int64_t>({t_}, {1}));
    std::map<std::string, std::pair<float*, float*>> mine;
    for (const auto& [name, t] : optim_.state()) {
      if (name.rfind(kAdamM, 0) != 0) continue;
      const std::string pn = name.substr(std::string(kAdamM).size());
      Tensor mt = Tensor::empty(t.shape(), DType::F32), vt = Tensor::empty(t.shape(), DType::F32);
      if (adam_) adam_->get(pn, mt.data<float>(), vt.data<float>());
      else mine.emplace(pn, std::pair{mt.data<float>(), vt.data<float>()});
      st.emplace(name, std::move(mt));
      st.emplace(kAdamV + pn, std::move(vt));
    }
    if (!adam_) dp_->save_moments(mine);  // (collective: every rank, its own parameters)
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
  dist::Comm& comm_;
  const bool nccl_;  // data parallel over NCCL
  int device_;       // (chosen before gm_ allocates)
  Balancer bal_;
  int64_t t_;  // AdamW steps taken (bias corrections)
  model::cuda::GpuModel gm_;
  std::unique_ptr<dist::DeviceComm> dc_;      // data parallel: the replicas' GPUs
  std::unique_ptr<cuda::DataParallel> dp_;    // data parallel: the gradient sums (and ZeRO-1's AdamW)
  std::unique_ptr<cuda::AdamW> adam_;         // gm_'s AdamW moments, all of them (not under ZeRO-1)
  int64_t micro_left_ = 0;                    // forward_backward calls left in this step (zero_grads)
};

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim,
                                         dist::Comm& comm) {
  return std::make_unique<CudaEngine>(cfg, host, optim, comm);
}

}  // namespace lm::train

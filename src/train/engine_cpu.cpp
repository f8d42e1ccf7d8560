// The CPU training engine: model::Model<float> (fp32; OpenBLAS + OpenMP), train::Optimizer (AdamW / Muon)
// and the host Balancer, all working on the trainer's host model and optimiser themselves.
#include <cmath>
#include <regex>

#include "core/parallel.hpp"
#include "dist/grad_buckets.hpp"
#include "train/balancer.hpp"
#include "train/engine.hpp"

namespace lm::train {

namespace {

// "model.layers.12.block_sparse_moe.experts.3.w1.weight" -> "layer 12 (MoE), parameter '...'".
std::string describe_param(const std::string& name, const model::ModelConfig& c) {
  static const std::regex re(R"(model\.layers\.(\d+)\.([a-z_]+))");
  std::smatch m;
  if (!std::regex_search(name, m, re)) return "'" + name + "'";
  const int64_t i = std::stoll(m[1].str());
  const std::string part = m[2].str();
  std::string what = part == "self_attn" ? (c.is_kda(i) ? "KDA mixer" : "MLA mixer")
                     : part == "block_sparse_moe" ? "MoE"
                     : part == "mlp" ? "dense FFN"
                                     : part;
  return fmt::format("layer {} ({}), parameter '{}'", i, what, name);
}

// The backward phase after which a parameter's gradient is final (Model::on_grads_final): 0 the head's, L − i decoder
// layer i's, L + 1 the embedding's and the tower's.
int64_t grad_phase(const model::ParamSpec& s, int64_t L) {
  if (s.component == model::Component::Embedding || model::is_vision_component(s.component)) return L + 1;
  return s.layer >= 0 ? L - s.layer : 0;
}

class CpuEngine final : public Engine {
 public:
  CpuEngine(const RunConfig& cfg, model::Model<float>& m, Optimizer& optim, dist::Comm& comm, dist::Comm* expert_dp)
      : m_(m), optim_(optim), bal_(cfg, m), comm_(comm) {
    // The gradient buckets, each summed over communicators of their own: their non-blocking all-reduces then never
    // interleave with the blocking collectives that the backward itself runs (context and expert parallel).
    const auto bytes = static_cast<size_t>(cfg.parallel.bucket_mb * 1048576.0);
    const int64_t L = m_.num_layers();
    std::vector<dist::GradBuckets::Array> replicated, experts;
    for (auto& p : m_.params().all())
      if (p.g())
        (expert_dp && p.spec.component == model::Component::RoutedExpert ? experts : replicated)
            .push_back({p.g(), static_cast<size_t>(p.value.numel()), grad_phase(p.spec, L)});
    if (comm_.size() > 1) {
      rep_comm_ = comm_.split(0, comm_.rank());
      buckets_.push_back(std::make_unique<dist::GradBuckets>(*rep_comm_, std::move(replicated), bytes));
    }
    if (expert_dp && expert_dp->size() > 1) {
      exp_comm_ = expert_dp->split(0, expert_dp->rank());
      buckets_.push_back(std::make_unique<dist::GradBuckets>(*exp_comm_, std::move(experts), bytes));
    }
  }

  std::string where() const override {
    if (m_.context_parallel())
      return fmt::format("{} threads in each of {} context-parallel ranks", num_threads(), comm_.size());
    if (dist::Comm* ep = m_.expert_parallel())
      return fmt::format("{} threads in each of {} data-parallel replicas, experts split over groups of {}",
                         num_threads(), comm_.size(), ep->size());
    return comm_.size() > 1 ? fmt::format("{} threads in each of {} data-parallel replicas", num_threads(), comm_.size())
                            : fmt::format("{} threads", num_threads());
  }

  void zero_grads(int64_t micro_batches) override {
    m_.params().zero_grads();
    bal_.clear();
    calls_left_ = micro_batches;
  }

  // Context parallel: `b` is this rank's segment of each sequence (Batch::segment); the gradients and router
  // statistics are this rank's share, summed over the ranks by step() and balance() as data parallel's are.
  LossStats forward_backward(const Batch& b, int64_t n_valid_total, const model::Media<float>* media) override {
    const bool cp = m_.context_parallel() != nullptr;
    const model::Seqs seqs = cp ? model::Seqs::batch(b.seqs, b.seq_len) : model::Seqs::packed(b.cu_seqlens);
    // The step's last backward starts the reduction of every bucket as soon as its gradients are final.
    struct Hook {
      model::Model<float>& m;
      ~Hook() { m.on_grads_final = nullptr; }
    } hook{m_};
    if (--calls_left_ == 0 && !buckets_.empty()) {
      const int64_t L = m_.num_layers();
      m_.on_grads_final = [this, L](int64_t i) {
        for (auto& gb : buckets_) gb->ready(i < 0 ? L + 1 : L - i);
      };
    }
    model::Model<float>::LossStats st;
    if (b.weights.empty()) {
      st = m_.forward_backward(b.ids.data(), b.targets.data(), seqs, n_valid_total, media);
    } else {
      LM_CHECK(!cp && !m_.expert_parallel() && !media, "weighted targets: not with context or expert parallel or "
               "images");
      m_.forward_backward_logp(b.ids.data(), b.targets.data(), seqs, weighted_loss(b, n_valid_total, &st.loss_sum));
      st.n_valid = m_.count_targets(b.targets.data(), b.tokens());
    }
    // (no diagnosis under cp or ep: its forward is collective, and the other ranks are not in it)
    if (!std::isfinite(st.loss_sum))
      throw NonFinite(cp || m_.expert_parallel() ? fmt::format("the loss of this rank's batch became {}", st.loss_sum)
                                                 : diagnose_loss(b, seqs, st.loss_sum));
    bal_.accumulate(b.tokens());
    return {st.loss_sum, st.n_valid};
  }

  // Held-out batches are packed (documents in a sequence): under context parallel every rank evaluates the whole
  // batch in one piece, so every rank has the loss of one process.
  LossStats loss(const Batch& b, const model::Media<float>* media) override {
    dist::Comm* cp = m_.context_parallel();
    m_.set_context_parallel(nullptr);
    struct Restore {
      model::Model<float>& m;
      dist::Comm* cp;
      ~Restore() { m.set_context_parallel(cp); }
    } restore{m_, cp};
    const auto st = m_.loss(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), media);
    return {st.loss_sum, st.n_valid};
  }

  StepInfo step(double lr_factor) override {
    // Data parallel: the replicas' gradients summed (each is already normalised by the step's global target count),
    // so every replica takes the same step and the weights stay identical. The buckets the last backward started
    // have been running under it; the rest start now.
    StepInfo bs;
    for (auto& b : buckets_) {
      b->finish();
      bs.buckets += b->stats().buckets, bs.buckets_early += b->stats().started_early;
      bs.buckets_hidden += b->stats().done_early, bs.reduce_wait_s += b->stats().wait_seconds;
    }
    try {
      StepInfo info = optim_.step(lr_factor);
      info.buckets = bs.buckets, info.buckets_early = bs.buckets_early, info.buckets_hidden = bs.buckets_hidden;
      info.reduce_wait_s = bs.reduce_wait_s;
      return info;
    } catch (const Error&) {  // name the parameter; any other failure stays as it was
      if (const auto bad = nonfinite_grad(m_.params()))
        throw NonFinite(fmt::format("a gradient became NaN/Inf in {}", describe_param(*bad, m_.config())));
      throw;
    }
  }

  void balance() override {
    if (comm_.size() > 1) bal_.reduce(comm_);  // the whole step's loads and router statistics
    bal_.update();
  }
  const std::vector<std::vector<int64_t>>& expert_loads() const override { return bal_.loads(); }
  double aux_loss() const override { return bal_.aux_loss(); }
  int64_t ep_dropped() const override { return bal_.dropped(); }
  void sync_to_host() override {}  // the host model and optimiser are the engine's own

  std::vector<float> target_logprobs(const Batch& b) override {
    LM_CHECK(!m_.context_parallel() && !m_.expert_parallel(), "RL: context and expert parallel are not supported");
    return m_.target_logprobs(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens));
  }
  std::vector<float> forward_backward_logp(const Batch& b, const model::Model<float>::LogpGrad& dloss) override {
    LM_CHECK(!m_.context_parallel() && !m_.expert_parallel(), "RL: context and expert parallel are not supported");
    return m_.forward_backward_logp(b.ids.data(), b.targets.data(), model::Seqs::packed(b.cu_seqlens), dloss);
  }

 private:
  // The first layer whose output is no longer finite (a forward of the same batch, keeping every layer's output).
  std::string diagnose_loss(const Batch& b, const model::Seqs& seqs, double loss_sum) {
    const model::ModelConfig& c = m_.config();
    model::ForwardResult<float> fr;
    m_.forward(b.ids.data(), seqs, model::ForwardOptions{true, false, false}, &fr);
    for (size_t i = 0; i < fr.hidden.size(); ++i)
      for (float x : fr.hidden[i])
        if (!std::isfinite(x))
          return fmt::format("the loss became {}; the first non-finite activation is the output of layer {} ({} "
                             "mixer, {})",
                             loss_sum, i, c.is_kda(static_cast<int64_t>(i)) ? "KDA" : "MLA",
                             c.is_moe(static_cast<int64_t>(i)) ? "MoE" : "dense FFN");
    return fmt::format("the loss became {} (every layer's output is finite: the LM head overflowed)", loss_sum);
  }

  model::Model<float>& m_;
  Optimizer& optim_;
  Balancer bal_;
  dist::Comm& comm_;
  std::unique_ptr<dist::Comm> rep_comm_, exp_comm_;              // the buckets' own communicators
  std::vector<std::unique_ptr<dist::GradBuckets>> buckets_;      // replicated parameters; sharded experts
  int64_t calls_left_ = 0;                                       // forward_backward calls left in the step
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const RunConfig& cfg, model::Model<float>& host, Optimizer& optim,
                                        dist::Comm& comm, dist::Comm* expert_dp) {
  return std::make_unique<CpuEngine>(cfg, host, optim, comm, expert_dp);
}

}  // namespace lm::train

#include "train/balancer.hpp"

#include <algorithm>
#include <cstring>

namespace lm::train {

Balancer::Balancer(const RunConfig& cfg, model::Model<float>& m)
    : m_(m), kind_(cfg.balance), hist_(cfg.qb_estimator == "hist"), gamma_(cfg.sign_gamma) {
  h_.bins = cfg.qb_bins;
  for (int64_t i = 0; i < m.config().num_hidden_layers; ++i)
    if (m.moe(i)) {
      layers_.push_back(i);
      if (kind_ == Balance::Aux) m.moe(i)->aux_coef = cfg.aux_coef;
    }
  E_ = m.config().num_experts;
  k_ = m.config().num_experts_per_token;
  scores_.resize(layers_.size());
  counts_.resize(layers_.size());
  loads_.resize(layers_.size());
  dropped_.assign(layers_.size(), 0);
}

void Balancer::clear() {
  for (auto& s : scores_) s.clear();
  for (auto& c : counts_) c.clear();
  for (auto& l : loads_) l.assign(E_, 0);
  dropped_.assign(layers_.size(), 0);
  aux_ = 0;
}

void Balancer::add_loads(size_t li, const int64_t* l) {
  for (int64_t e = 0; e < E_; ++e) loads_[li][e] += l[e];
}

void Balancer::accumulate(int64_t rows) {
  for (size_t li = 0; li < layers_.size(); ++li) {
    auto* moe = m_.moe(layers_[li]);
    std::vector<int64_t> l(E_);
    ops::expert_loads(moe->topk_idx().data(), rows, k_, E_, l.data());
    add_loads(li, l.data());
    if (kind_ == Balance::QB) {
      if (hist_) {
        counts_[li].resize(E_ * ops::qb_hist_slots(h_), 0);
        ops::qb_hist_accumulate(moe->scores().data(), moe->bias(), static_cast<const float*>(nullptr), rows, E_, k_,
                                h_, counts_[li].data());
      } else {
        scores_[li].insert(scores_[li].end(), moe->scores().begin(), moe->scores().end());
      }
    }
    aux_ += moe->last_aux_loss;
    dropped_[li] += moe->last_dropped();
  }
}

void Balancer::reduce(dist::Comm& comm) {
  std::vector<int64_t> msg;
  for (size_t li = 0; li < layers_.size(); ++li) {
    // One all-reduce per layer: the loads, the dropped assignments, then the histogram counts (hist QB).
    const bool hist = kind_ == Balance::QB && hist_;
    if (hist) counts_[li].resize(E_ * ops::qb_hist_slots(h_), 0);
    msg.assign(loads_[li].begin(), loads_[li].end());
    msg.push_back(dropped_[li]);
    if (hist) msg.insert(msg.end(), counts_[li].begin(), counts_[li].end());
    comm.all_reduce_sum(msg.data(), msg.size());
    std::copy_n(msg.begin(), E_, loads_[li].begin());
    dropped_[li] = msg[size_t(E_)];
    if (hist) std::copy(msg.begin() + E_ + 1, msg.end(), counts_[li].begin());
    if (kind_ == Balance::QB && !hist) {  // every replica's rows, in rank order (the exact estimator needs no order)
      const std::vector<char> all = comm.all_gather_v(scores_[li].data(), scores_[li].size() * sizeof(float));
      scores_[li].resize(all.size() / sizeof(float));
      std::memcpy(scores_[li].data(), all.data(), all.size());
    }
  }
  if (kind_ == Balance::Aux) comm.all_reduce_sum(&aux_, 1);
}

void Balancer::update() {
  for (size_t li = 0; li < layers_.size(); ++li) {
    float* b = m_.moe(layers_[li])->bias();
    if (kind_ == Balance::QB) {
      if (hist_) {
        std::vector<float> beta(E_);
        ops::qb_beta_from_hist(counts_[li].data(), b, beta.data(), E_, k_, h_);
        ops::qb_bias_from_beta(beta.data(), b, E_);
      } else {
        const int64_t m = static_cast<int64_t>(scores_[li].size()) / E_;
        ops::qb_update_exact(scores_[li].data(), b, static_cast<const float*>(nullptr), b, m, E_, k_);
      }
    } else if (kind_ == Balance::Sign) {
      ops::bias_sign_update(loads_[li].data(), b, E_, static_cast<float>(gamma_));
    }
  }
}

}  // namespace lm::train

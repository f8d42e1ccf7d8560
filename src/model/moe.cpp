// Stable LatentMoE (SPEC §5): sigmoid router in fp32 with a selection-only bias, top-k with
// renormalisation and scaling, latent down-projection, routed experts computed expert by expert over
// their gathered tokens with GEMMs, fp32 combine, latent RMSNorm, up-projection, shared experts.
// Without routed_expert_hidden_size the experts run at full width (Kimi Linear) with no projections.
//
// Legend: rows tokens, d hidden, E experts, k per token, I expert width, l latent width (= d when not
//         latent), a = rows·k token-expert assignments in expert order.
//   logits = x W_rᵀ [rows, E]; s = σ(logits); sel = topk(s + b); p = renorm(s_sel)·scale   [rows, k]
//   z  = x W_downᵀ [rows, l];  zs = gather(z) [a, l];  eo = E_j(zs rows of j) [a, l]
//   u  = Σ_sel p · eo [rows, l];  y = RMSNorm_l(u) W_upᵀ + Shared(x)
#include <algorithm>
#include <cmath>

#include "core/parallel.hpp"
#include "model/layers.hpp"
#include "model/linear.hpp"
#include "ops/moe/balance.hpp"
#include "ops/moe/permute.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::model {

template <class F>
LatentMoe<F>::LatentMoe(const ModelConfig& c, ParamStore<F>& ps, int layer)
    : c_(c),
      d_(c.hidden_size),
      E_(c.num_experts),
      k_(c.num_experts_per_token),
      I_(c.moe_intermediate_size),
      l_(c.expert_width()),
      latent_(c.has_latent_moe()),
      p_(glu_params(c)) {
  const std::string B = "model.layers." + std::to_string(layer) + ".block_sparse_moe.";
  Wr = &ps.at(B + "gate.weight");
  bias_ = &ps.at(B + "gate.e_score_correction_bias");
  const ExpertShard& shard = ps.experts();
  e0_ = shard.all() ? 0 : shard.first;
  El_ = shard.all() ? E_ : shard.count;
  for (int64_t j = e0_; j < e0_ + El_; ++j) {
    const std::string e = B + "experts." + std::to_string(j) + ".";
    W1.push_back(&ps.at(e + "w1.weight"));
    W3.push_back(&ps.at(e + "w3.weight"));
    W2.push_back(&ps.at(e + "w2.weight"));
  }
  if (latent_) {
    Wdown = &ps.at(B + "routed_expert_down_proj.weight");
    if (c.latent_moe_use_norm) lnorm = &ps.at(B + "routed_expert_norm.weight");
    Wup = &ps.at(B + "routed_expert_up_proj.weight");
  }
  if (c.num_shared_experts > 0) {
    shared_owned_ = std::make_unique<DenseFfn<F>>(c, ps, B + "shared_experts", c.shared_intermediate_size());
    shared_ = shared_owned_.get();
  }
  rc_.k = k_;
  rc_.renormalize = c.moe_renormalize;
  rc_.routed_scaling_factor = c.routed_scaling_factor;
  ea_.resize(El_);
}

template <class F>
void LatentMoe<F>::set_expert_parallel(dist::Comm* ep, double capacity_factor) {
  LM_CHECK(capacity_factor >= 0 && std::isfinite(capacity_factor), "expert parallel: capacity factor {} must be >= 0",
           capacity_factor);
  if (ep) {
    const int R = ep->size();
    LM_CHECK(E_ % R == 0 && e0_ == ep->rank() * (E_ / R) && El_ == E_ / R,
             "expert parallel over {} ranks: rank {} must hold experts [{}, {}) of {}, this layer holds [{}, {})", R,
             ep->rank(), ep->rank() * (E_ / std::max(R, 1)), (ep->rank() + 1) * (E_ / std::max(R, 1)), E_, e0_,
             e0_ + El_);
  }
  ep_ = ep;
  capacity_ = capacity_factor;
}

template <class F>
void LatentMoe<F>::forward(const F* x, F* y, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, E = E_, k = k_, l = l_;
  x_.assign(x, x + rows * d);
  logits_.resize(rows * E), scores_.resize(rows * E), topk_w_.resize(rows * k), topk_idx_.resize(rows * k);
  linear_forward(x, Wr->w(), logits_.data(), rows, d, E);
  ops::RouterOutputs<F> ro;
  ro.topk_idx = topk_idx_.data(), ro.topk_w = topk_w_.data(), ro.scores = scores_.data();
  ops::router_forward(logits_.data(), bias_->w(), rows, E, rc_, ro);
  if (aux_coef > 0) last_aux_loss = ops::aux_loss_forward(logits_.data(), topk_idx_.data(), rows, E, k, aux_coef);

  const F* z = x;
  if (latent_) {
    z_.resize(rows * l);
    linear_forward(x, Wdown->w(), z_.data(), rows, d, l);
    z = z_.data();
  }
  offsets_.resize(E + 1), perm_rows_.resize(rows * k), perm_pos_.resize(rows * k);
  ops::moe_build_permutation(topk_idx_.data(), rows, k, E, offsets_.data(), perm_rows_.data(), perm_pos_.data());
  zs_.resize(rows * k * l), eo_.resize(rows * k * l);
  ops::moe_gather(z, perm_rows_.data(), zs_.data(), rows, k, l);
  if (ep_) {
    dist::plan_dispatch(*ep_, offsets_.data(), E, dist::expert_capacity(rows, k, E, capacity_), ex_);
    dist::dispatch(*ep_, ex_, zs_.data(), l, gz_);
    geo_.resize(gz_.size());
    experts_forward(gz_.data(), ex_.local_offsets.data(), geo_.data());
    dist::combine(*ep_, ex_, geo_.data(), l, eo_.data());
  } else {
    LM_CHECK(El_ == E, "MoE layer: this rank holds experts [{}, {}) of {} only; it runs under expert parallel", e0_,
             e0_ + El_, E);
    experts_forward(zs_.data(), offsets_.data(), eo_.data());
  }
  u_.resize(rows * l);
  ops::moe_combine(eo_.data(), topk_w_.data(), perm_pos_.data(), u_.data(), rows, k, l);
  if (latent_) {
    const F* un = u_.data();
    if (lnorm) {
      un_.resize(rows * l), u_rstd_.resize(rows);
      ops::rmsnorm_forward(u_.data(), lnorm->w(), un_.data(), u_rstd_.data(), rows, l,
                           static_cast<F>(c_.rms_norm_eps));
      un = un_.data();
    }
    linear_forward(un, Wup->w(), y, rows, l, d);
  } else {
    std::copy(u_.begin(), u_.end(), y);
  }
  if (shared_) shared_->forward(x, y, s, true);
}

// Each expert runs single-threaded GEMMs over its own rows (no shared writes).
template <class F>
void LatentMoe<F>::experts_forward(const F* xs, const int64_t* offs, F* eo) {
  const int64_t l = l_;
  parallel_for_dynamic(El_, [&](int64_t j) {
    const int64_t r0 = offs[j], rows = offs[j + 1] - r0;
    glu_ffn_forward(xs + r0 * l, rows, l, I_, W1[j]->w(), W3[j]->w(), W2[j]->w(), p_, eo + r0 * l, false, ea_[j]);
  });
}
template <class F>
void LatentMoe<F>::experts_backward(const F* xs, const int64_t* offs, const F* d_eo, F* dxs) {
  const int64_t l = l_;
  parallel_for_dynamic(El_, [&](int64_t j) {
    const int64_t r0 = offs[j], rows = offs[j + 1] - r0;
    glu_ffn_backward(xs + r0 * l, rows, l, I_, W1[j]->w(), W3[j]->w(), W2[j]->w(), p_, d_eo + r0 * l, dxs + r0 * l,
                     false, W1[j]->g(), W3[j]->g(), W2[j]->g(), ea_[j]);
  });
}

template <class F>
void LatentMoe<F>::backward(const F* dy, F* dx, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, E = E_, k = k_, l = l_;
  const F* x = x_.data();
  Buf<F> du(rows * l);
  if (latent_) {
    if (lnorm) {
      Buf<F> dun(rows * l);
      linear_backward(un_.data(), Wup->w(), dy, dun.data(), Wup->g(), rows, l, d);
      ops::rmsnorm_backward(u_.data(), lnorm->w(), u_rstd_.data(), dun.data(), du.data(), lnorm->g(), rows, l,
                            static_cast<F>(c_.rms_norm_eps));
    } else {
      linear_backward(u_.data(), Wup->w(), dy, du.data(), Wup->g(), rows, l, d);
    }
  } else {
    std::copy(dy, dy + rows * d, du.begin());
  }
  Buf<F> d_eo(rows * k * l), d_topk_w(rows * k), d_zs(rows * k * l);
  ops::moe_combine_backward(eo_.data(), topk_w_.data(), perm_pos_.data(), du.data(), d_eo.data(), d_topk_w.data(), rows,
                            k, l);
  if (ep_) {
    Buf<F> gd_eo, gdz(gz_.size());
    dist::dispatch(*ep_, ex_, d_eo.data(), l, gd_eo);  // (the forward's plan: the same rows travel)
    experts_backward(gz_.data(), ex_.local_offsets.data(), gd_eo.data(), gdz.data());
    dist::combine(*ep_, ex_, gdz.data(), l, d_zs.data());
  } else {
    experts_backward(zs_.data(), offsets_.data(), d_eo.data(), d_zs.data());
  }
  // Router: gradient through the unbiased scores of the selected experts (and the aux loss).
  Buf<F> d_logits(rows * E);
  ops::router_backward(logits_.data(), topk_idx_.data(), d_topk_w.data(), d_logits.data(), rows, E, rc_, false);
  if (aux_coef > 0)
    ops::aux_loss_backward(logits_.data(), topk_idx_.data(), d_logits.data(), rows, E, k, aux_coef, true);
  linear_backward(x, Wr->w(), d_logits.data(), dx, Wr->g(), rows, d, E, false);
  if (latent_) {
    Buf<F> dz(rows * l);
    ops::moe_gather_backward(d_zs.data(), perm_pos_.data(), dz.data(), rows, k, l, false);
    linear_backward(x, Wdown->w(), dz.data(), dx, Wdown->g(), rows, d, l, true);
  } else {
    ops::moe_gather_backward(d_zs.data(), perm_pos_.data(), dx, rows, k, l, true);
  }
  if (shared_) shared_->backward(dy, dx, s, true);
}

template class LatentMoe<float>;
template class LatentMoe<double>;

}  // namespace lm::model

// The decoder stack (SPEC §1, §6) forward and backward, with Block AttnRes or plain residuals.
//
// Legend: rows tokens, d hidden, V vocabulary, L layers.
// The wiring is the stack plan's (model/stack.hpp): prefix = the partial block sum, blocks_ = the closed
// sources (blocks_[0] = embedding); the backward walks the same plan in reverse.
#include "model/model.hpp"

#include <algorithm>
#include <chrono>

#include "core/error.hpp"
#include "ops/attnres/attnres.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "ops/embedding/embedding.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::model {

const char* Profile::name(int k) {
  static const char* n[] = {"embedding", "kda", "mla", "dense_ffn", "moe", "attnres", "norm", "lm_head", "vision"};
  return k >= 0 && k < kNum ? n[k] : "?";
}

namespace {
struct Timer {
  double& acc;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Timer(double& a) : acc(a) {}
  ~Timer() { acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};
template <class F>
void add_into(F* y, const F* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}
}  // namespace

template <class F>
Model<F>::Model(const ModelConfig& c, ExpertShard experts) : cfg_(c), ps_(cfg_, experts) {
  cfg_.validate("model config");
  plan_ = StackPlan::build(cfg_);
  const int64_t L = cfg_.num_hidden_layers;
  mixers_.reserve(L);
  denses_.resize(L);
  moes_.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    const int li = static_cast<int>(i);
    if (plan_[i].kda()) mixers_.emplace_back(std::in_place_type<KdaMixer<F>>, cfg_, ps_, li);
    else mixers_.emplace_back(std::in_place_type<GatedMla<F>>, cfg_, ps_, li);
    const std::string P = "model.layers." + std::to_string(i);
    if (plan_[i].moe()) moes_[i] = std::make_unique<LatentMoe<F>>(cfg_, ps_, li);
    else denses_[i] = std::make_unique<DenseFfn<F>>(cfg_, ps_, P + ".mlp", cfg_.intermediate_size);
    ln1_.push_back(&ps_.at(P + ".input_layernorm.weight"));
    ln2_.push_back(&ps_.at(P + ".post_attention_layernorm.weight"));
    if (plan_.attn_res) {
      attn_w_.push_back(&ps_.at(P + ".self_attention_res_proj.weight"));
      attn_g_.push_back(&ps_.at(P + ".self_attention_res_norm.weight"));
      mlp_w_.push_back(&ps_.at(P + ".mlp_res_proj.weight"));
      mlp_g_.push_back(&ps_.at(P + ".mlp_res_norm.weight"));
    }
  }
  embed_ = &ps_.at("model.embed_tokens.weight");
  lm_head_ = &ps_.at("lm_head.weight");
  final_norm_ = &ps_.at("model.norm.weight");
  if (plan_.attn_res) {
    out_w_ = &ps_.at("model.output_attn_res_proj.weight");
    out_g_ = &ps_.at("model.output_attn_res_norm.weight");
  }
  if (cfg_.vision) {
    tower_ = std::make_unique<VisionTower<F>>(*cfg_.vision, ps_);
    if (const auto id = cfg_.vision->media_placeholder_token_id) placeholder_ = static_cast<int32_t>(*id);
  }
}

template <class F>
Buf<F> Model<F>::media_features(const Media<F>& media, int64_t* rows) {
  LM_CHECK(tower_, "this model has no vision tower (its config has no vision_config); it takes no images");
  LM_CHECK(placeholder_ >= 0,
           "images need 'vision_config.media_placeholder_token_id' (the prompt token their features replace), "
           "which this config does not set");
  const VisionConfig& v = *cfg_.vision;
  const int64_t P = v.patch_dim(), d = cfg_.hidden_size;
  const auto n_px = static_cast<int64_t>(media.pixel_values.size());
  LM_CHECK(n_px % P == 0, "pixel_values holds {} values, not a whole number of patches of 3 x {} x {} = {}", n_px,
           v.patch_size, v.patch_size, P);
  const VisionBatch b = VisionBatch::make(v, media.grids, n_px / P, "the images' grids");
  Buf<F> features(b.merged() * d);
  {
    Timer t(profile.fwd[Profile::Vision]);
    tower_->forward(media.pixel_values.data(), b, features.data());
  }
  if (rows) *rows = b.merged();
  return features;
}

template <class F>
void Model<F>::splice_forward(const int32_t* ids, int64_t rows, const Media<F>* media, F* emb) {
  media_rows_.clear();
  const bool has_media = media && !media->empty();
  if (!tower_) {
    LM_CHECK(!has_media, "forward: this model has no vision tower (its config has no vision_config); it takes no images");
    return;
  }
  for (int64_t i = 0; placeholder_ >= 0 && i < rows; ++i)
    if (ids[i] == placeholder_) media_rows_.push_back(i);
  const auto n_placeholders = static_cast<int64_t>(media_rows_.size());
  if (!has_media) {
    LM_CHECK(n_placeholders == 0,
             "forward: the prompt has {} media placeholder token(s) (id {}) but no image to fill them", n_placeholders,
             placeholder_);
    return;
  }
  int64_t M = 0;
  const Buf<F> features = media_features(*media, &M);
  const int64_t d = cfg_.hidden_size;
  const VisionConfig& v = *cfg_.vision;
  LM_CHECK(n_placeholders == M,
           "forward: the prompt has {} media placeholder token(s) (id {}), but its {} image(s) give {} feature rows; a "
           "prompt carries one placeholder per feature row, (h/{})·(w/{}) per image of h x w patches",
           n_placeholders, placeholder_, media->grids.size(), M, v.merge_h, v.merge_w);
  for (int64_t j = 0; j < M; ++j) std::copy_n(features.data() + j * d, d, emb + media_rows_[j] * d);
}

template <class F>
void Model<F>::splice_backward(F* d_emb) {
  if (media_rows_.empty()) return;
  const int64_t M = static_cast<int64_t>(media_rows_.size()), d = cfg_.hidden_size;
  Buf<F> dfeatures(M * d);
  for (int64_t j = 0; j < M; ++j) {
    F* row = d_emb + media_rows_[j] * d;
    std::copy_n(row, d, dfeatures.data() + j * d);
    std::fill_n(row, d, F(0));  // the placeholder's embedding row was replaced: it gets no gradient
  }
  if (!ps_.has_grads()) return;
  Timer t(profile.bwd[Profile::Vision]);
  tower_->backward(dfeatures.data());
}

template <class F>
const int32_t* Model<F>::loss_targets(const int32_t* targets, int64_t rows) {
  if (placeholder_ < 0 || std::find(targets, targets + rows, placeholder_) == targets + rows) return targets;
  masked_targets_.assign(targets, targets + rows);
  std::replace(masked_targets_.begin(), masked_targets_.end(), placeholder_, int32_t{-1});
  return masked_targets_.data();
}

template <class F>
int64_t Model<F>::count_targets(const int32_t* targets, int64_t rows) const {
  const int64_t n = ops::cross_entropy_count_valid(targets, rows, cfg_.vocab_size);
  return placeholder_ < 0 ? n : n - std::count(targets, targets + rows, placeholder_);
}

template <class F>
void Model<F>::read(const std::vector<const F*>& src, const Param<F>* w, const Param<F>* g, int64_t rows, F* h) {
  Timer t(profile.fwd[Profile::AttnRes]);
  ops::attnres_forward(src.data(), static_cast<int64_t>(src.size()), rows, cfg_.hidden_size, w->w(), g->w(),
                       static_cast<F>(cfg_.rms_norm_eps), h);
}

template <class F>
void Model<F>::read_backward(const std::vector<const F*>& src, const std::vector<F*>& dsrc, Param<F>* w, Param<F>* g,
                             int64_t rows, const F* dh) {
  Timer t(profile.bwd[Profile::AttnRes]);
  ops::attnres_backward(src.data(), static_cast<int64_t>(src.size()), rows, cfg_.hidden_size, w->w(), g->w(),
                        static_cast<F>(cfg_.rms_norm_eps), dh, dsrc.data(), w->g(), g->g());
}

template <class F>
void Model<F>::set_context_parallel(dist::Comm* comm) {
  cp_ = comm;
  for (auto& m : mixers_) std::visit([&](auto& x) { x.cp = comm; }, m);
}

template <class F>
void Model<F>::set_expert_parallel(dist::Comm* ep, double capacity_factor) {
  for (auto& m : moes_)
    if (m) m->set_expert_parallel(ep, capacity_factor);
  ep_ = ep;
}

template <class F>
void Model<F>::forward(const int32_t* ids, const Seqs& s, const ForwardOptions& opt, ForwardResult<F>* out,
                       const Media<F>* media) {
  forward_impl(ids, s, opt, out, media);
}

template <class F>
void Model<F>::forward_impl(const int32_t* ids, const Seqs& s, const ForwardOptions& opt, ForwardResult<F>* out,
                            const Media<F>* media) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const F eps = static_cast<F>(cfg_.rms_norm_eps);
  LM_CHECK(rows > 0, "forward: empty batch");
  if (cp_) {
    LM_CHECK(s.cu.empty(), "forward: context parallel runs B sequences split in segments (Seqs::batch); packed "
                           "(varlen) batches are not supported");
    LM_CHECK(!media || media->empty(), "forward: context parallel does not take media (images)");
  }
  ids_.assign(ids, ids + rows);
  Buf<F> emb(rows * d);
  {
    Timer t(profile.fwd[Profile::Embedding]);
    ops::embedding_forward(ids, rows, embed_->w(), V, d, emb.data());
  }
  splice_forward(ids, rows, media, emb.data());
  acts_.resize(L);
  if (out) {
    out->hidden.assign(opt.hidden ? L : 0, {});
    out->topk.assign(opt.topk ? L : 0, {});
  }
  auto mixer_fwd = [&](int64_t i, const F* xn, F* a) {
    if (auto* k = kda(i)) {
      Timer t(profile.fwd[Profile::Kda]);
      k->forward(xn, a, s);
    } else {
      Timer t(profile.fwd[Profile::Mla]);
      mla(i)->forward(xn, a, s);
    }
  };
  auto ffn_fwd = [&](int64_t i, const F* yn, F* f) {
    if (moes_[i]) {
      Timer t(profile.fwd[Profile::Moe]);
      moes_[i]->forward(yn, f, s);
      if (out && opt.topk) out->topk[i] = moes_[i]->topk_idx();
    } else {
      Timer t(profile.fwd[Profile::DenseFfn]);
      denses_[i]->forward(yn, f, s);
    }
  };
  auto norm = [&](const Buf<F>& x, const Param<F>* w, Buf<F>& y, Buf<F>& rstd) {
    Timer t(profile.fwd[Profile::Norm]);
    y.resize(rows * d), rstd.resize(rows);
    ops::rmsnorm_forward(x.data(), w->w(), y.data(), rstd.data(), rows, d, eps);
  };
  Buf<F> a(rows * d), f(rows * d);
  if (plan_.attn_res) {
    blocks_.clear();
    Buf<F> prefix = std::move(emb);
    // The first `closed` closed blocks and the partial sum.
    auto sources = [&](int64_t closed) {
      std::vector<const F*> src;
      for (int64_t j = 0; j < closed; ++j) src.push_back(blocks_[j].data());
      src.push_back(prefix.data());
      return src;
    };
    for (int64_t i = 0; i < L; ++i) {
      const LayerPlan& lp = plan_[i];
      LayerActs& A = acts_[i];
      A.prefix_in = prefix;
      if (lp.attn_closed == 0) {
        A.x_in = prefix;
      } else {
        A.x_in.resize(rows * d);
        read(sources(lp.attn_closed), attn_w_[i], attn_g_[i], rows, A.x_in.data());
      }
      if (lp.opens_block) blocks_.push_back(prefix);
      norm(A.x_in, ln1_[i], A.xn, A.rstd1);
      mixer_fwd(i, A.xn.data(), a.data());
      if (lp.opens_block) prefix = a;
      else add_into(prefix.data(), a.data(), rows * d);
      A.prefix_mid = prefix;
      const std::vector<const F*> src = sources(lp.mlp_closed);
      A.y_in.resize(rows * d);
      read(src, mlp_w_[i], mlp_g_[i], rows, A.y_in.data());
      norm(A.y_in, ln2_[i], A.yn, A.rstd2);
      ffn_fwd(i, A.yn.data(), f.data());
      add_into(prefix.data(), f.data(), rows * d);
      if (out && opt.hidden) out->hidden[i] = prefix;
    }
    h_final_.resize(rows * d);
    read(sources(plan_.out_closed), out_w_, out_g_, rows, h_final_.data());
    residual_ = std::move(prefix);
  } else {
    Buf<F> h = std::move(emb);
    for (int64_t i = 0; i < L; ++i) {
      LayerActs& A = acts_[i];
      A.x_in = h;
      norm(A.x_in, ln1_[i], A.xn, A.rstd1);
      mixer_fwd(i, A.xn.data(), a.data());
      add_into(h.data(), a.data(), rows * d);
      A.y_in = h;
      norm(A.y_in, ln2_[i], A.yn, A.rstd2);
      ffn_fwd(i, A.yn.data(), f.data());
      add_into(h.data(), f.data(), rows * d);
      if (out && opt.hidden) out->hidden[i] = h;
    }
    h_final_ = std::move(h);
  }
  norm(h_final_, final_norm_, hn_, rstd_f_);
  if (out) {
    out->final_hidden = hn_;
    if (opt.logits) {
      Timer t(profile.fwd[Profile::LmHead]);
      out->logits.resize(rows * V);
      ops::lm_head_logits(hn_.data(), lm_head_->w(), rows, d, V, out->logits.data());
    }
  }
}

template <class F>
void Model<F>::backward_impl(const Buf<F>& d_hn, const Seqs& s) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  const F eps = static_cast<F>(cfg_.rms_norm_eps);
  auto norm_bwd = [&](const Buf<F>& x, Param<F>* w, const Buf<F>& rstd, const F* dy, F* dx) {
    Timer t(profile.bwd[Profile::Norm]);
    ops::rmsnorm_backward(x.data(), w->w(), rstd.data(), dy, dx, w->g(), rows, d, eps);
  };
  auto mixer_bwd = [&](int64_t i, const F* da, F* dxn) {
    if (auto* k = kda(i)) {
      Timer t(profile.bwd[Profile::Kda]);
      k->backward(da, dxn, s);
    } else {
      Timer t(profile.bwd[Profile::Mla]);
      mla(i)->backward(da, dxn, s);
    }
  };
  auto ffn_bwd = [&](int64_t i, const F* df, F* dyn) {
    if (moes_[i]) {
      Timer t(profile.bwd[Profile::Moe]);
      moes_[i]->backward(df, dyn, s);
    } else {
      Timer t(profile.bwd[Profile::DenseFfn]);
      denses_[i]->backward(df, dyn, s);
    }
  };
  auto final = [&](int64_t i) {
    if (on_grads_final) on_grads_final(i);
  };
  Buf<F> dh_final(rows * d), dnorm_out(rows * d), dx_in(rows * d);
  norm_bwd(h_final_, final_norm_, rstd_f_, d_hn.data(), dh_final.data());
  Buf<F> d_prefix(rows * d, F(0));
  if (plan_.attn_res) {
    std::vector<Buf<F>> d_blocks(blocks_.size(), Buf<F>(rows * d, F(0)));
    auto sources = [&](int64_t nb, const Buf<F>& partial, Buf<F>& d_partial, std::vector<const F*>& src,
                       std::vector<F*>& dsrc) {
      src.clear(), dsrc.clear();
      for (int64_t j = 0; j < nb; ++j) src.push_back(blocks_[j].data()), dsrc.push_back(d_blocks[j].data());
      src.push_back(partial.data()), dsrc.push_back(d_partial.data());
    };
    std::vector<const F*> src;
    std::vector<F*> dsrc;
    sources(plan_.out_closed, residual_, d_prefix, src, dsrc);
    read_backward(src, dsrc, out_w_, out_g_, rows, dh_final.data());
    final(L);
    for (int64_t i = L - 1; i >= 0; --i) {
      const LayerPlan& lp = plan_[i];
      LayerActs& A = acts_[i];
      const int64_t nb_mlp = lp.mlp_closed, nb_attn = lp.attn_closed;
      // prefix_out = prefix_mid + ffn(norm2(Read_mlp(blocks ++ [prefix_mid])))
      ffn_bwd(i, d_prefix.data(), dnorm_out.data());
      Buf<F> dy_in(rows * d);
      norm_bwd(A.y_in, ln2_[i], A.rstd2, dnorm_out.data(), dy_in.data());
      sources(nb_mlp, A.prefix_mid, d_prefix, src, dsrc);
      read_backward(src, dsrc, mlp_w_[i], mlp_g_[i], rows, dy_in.data());
      // prefix_mid = (opens_block ? 0 : prefix_in) + mixer(norm1(x_in))
      mixer_bwd(i, d_prefix.data(), dnorm_out.data());
      norm_bwd(A.x_in, ln1_[i], A.rstd1, dnorm_out.data(), dx_in.data());
      if (lp.opens_block) {  // the block pushed at this layer was prefix_in
        d_prefix = std::move(d_blocks[nb_attn]);
        d_blocks.pop_back();
      }
      if (nb_attn == 0) {
        add_into(d_prefix.data(), dx_in.data(), rows * d);
      } else {
        sources(nb_attn, A.prefix_in, d_prefix, src, dsrc);
        read_backward(src, dsrc, attn_w_[i], attn_g_[i], rows, dx_in.data());
      }
      final(i);
    }
  } else {
    d_prefix = dh_final;
    final(L);
    for (int64_t i = L - 1; i >= 0; --i) {
      LayerActs& A = acts_[i];
      ffn_bwd(i, d_prefix.data(), dnorm_out.data());
      norm_bwd(A.y_in, ln2_[i], A.rstd2, dnorm_out.data(), dx_in.data());
      add_into(d_prefix.data(), dx_in.data(), rows * d);
      mixer_bwd(i, d_prefix.data(), dnorm_out.data());
      norm_bwd(A.x_in, ln1_[i], A.rstd1, dnorm_out.data(), dx_in.data());
      add_into(d_prefix.data(), dx_in.data(), rows * d);
      final(i);
    }
  }
  splice_backward(d_prefix.data());
  if (embed_->g()) {
    Timer t(profile.bwd[Profile::Embedding]);
    ops::embedding_backward(ids_.data(), rows, d_prefix.data(), V, d, embed_->g());
  }
  final(-1);
}

template <class F>
void Model<F>::backward_from_hidden(const F* d_final_hidden, const Seqs& s) {
  Buf<F> d(d_final_hidden, d_final_hidden + s.rows() * cfg_.hidden_size);
  backward_impl(d, s);
}

template <class F>
typename Model<F>::LossStats Model<F>::forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                                        int64_t n_valid_total, const Media<F>* media) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(ps_.has_grads(), "forward_backward: gradients are not enabled on this model");
  targets = loss_targets(targets, rows);
  const int64_t n_here = ops::cross_entropy_count_valid(targets, rows, V);
  forward_impl(ids, s, ForwardOptions{}, nullptr, media);
  const int64_t n_norm = n_valid_total > 0 ? n_valid_total : n_here;
  Buf<F> d_hn(rows * d, F(0));
  ops::CeStats st;
  {
    Timer t(profile.bwd[Profile::LmHead]);
    st = ops::cross_entropy_forward_backward(hn_.data(), lm_head_->w(), targets, rows, d, V,
                                             n_norm > 0 ? F(1) / static_cast<F>(n_norm) : F(0), d_hn.data(),
                                             lm_head_->g());
  }
  backward_impl(d_hn, s);
  return LossStats{st.loss_sum, st.n_valid};
}

template <class F>
typename Model<F>::LossStats Model<F>::loss(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                            const Media<F>* media) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size;
  targets = loss_targets(targets, rows);
  forward_impl(ids, s, ForwardOptions{}, nullptr, media);
  Timer t(profile.fwd[Profile::LmHead]);
  const ops::CeStats st = ops::cross_entropy_forward(hn_.data(), lm_head_->w(), targets, rows, d, V,
                                                     static_cast<F*>(nullptr));
  return LossStats{st.loss_sum, st.n_valid};
}

template <class F>
std::vector<F> Model<F>::target_logprobs(const int32_t* ids, const int32_t* targets, const Seqs& s) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size;
  targets = loss_targets(targets, rows);
  forward_impl(ids, s, ForwardOptions{}, nullptr, nullptr);
  std::vector<F> logp(static_cast<size_t>(rows));
  Timer t(profile.fwd[Profile::LmHead]);
  ops::cross_entropy_forward(hn_.data(), lm_head_->w(), targets, rows, d, V, static_cast<F*>(nullptr), logp.data());
  for (auto& v : logp) v = -v;
  return logp;
}

template <class F>
std::vector<F> Model<F>::forward_backward_logp(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                               const LogpGrad& dloss) {
  const int64_t rows = s.rows(), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(ps_.has_grads(), "forward_backward_logp: gradients are not enabled on this model");
  targets = loss_targets(targets, rows);
  forward_impl(ids, s, ForwardOptions{}, nullptr, nullptr);
  std::vector<F> logp(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows));
  Buf<F> d_hn(rows * d, F(0));
  {
    Timer t(profile.bwd[Profile::LmHead]);
    ops::cross_entropy_forward(hn_.data(), lm_head_->w(), targets, rows, d, V, lse.data(), logp.data());
    for (auto& v : logp) v = -v;
    std::vector<F> scale = dloss(logp);
    LM_CHECK(static_cast<int64_t>(scale.size()) == rows, "forward_backward_logp: {} gradients for {} rows",
             scale.size(), rows);
    for (auto& v : scale) v = -v;
    ops::cross_entropy_backward(hn_.data(), lm_head_->w(), targets, lse.data(), rows, d, V, F(1), d_hn.data(),
                                lm_head_->g(), ops::CeOptions{}, scale.data());
  }
  backward_impl(d_hn, s);
  return logp;
}

template class Model<float>;
template class Model<double>;

}  // namespace lm::model

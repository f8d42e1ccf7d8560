#pragma once
// The decoder's sublayers (SPEC §2–§5), each with an explicit forward that keeps what its backward
// needs and a backward that consumes it. fp32 for training, double for the finite-difference tests.
//
// Legend: rows = tokens in the batch (B·T or packed), d hidden, H heads, K = V KDA head dim,
//         Hm MLA heads, Dn/Dr/Dv MLA nope/rope/value head dims, R kv_lora_rank, I FFN width,
//         E experts, k experts per token, l latent width (routed_expert_hidden_size).
// Conventions: forward(x, y) writes y [rows, d] from the normed input x [rows, d]; backward(dy, dx)
// writes dx [rows, d] and accumulates parameter gradients (when the store has them). The mixers also run
// inference over a per-sequence cache whose layout they describe (cache_spec, model/cache.hpp): prefill(n new
// tokens of one sequence) and decode(one new token for each of S sequences); both keep nothing for a backward.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/kda_cp.hpp"
#include "dist/mla_cp.hpp"
#include "dist/moe_ep.hpp"
#include "model/cache.hpp"
#include "model/config.hpp"
#include "model/params.hpp"
#include "model/seqs.hpp"
#include "ops/glu/glu.hpp"
#include "ops/kda/kda.hpp"
#include "ops/moe/router.hpp"

namespace lm::model {

template <class F>
using Buf = std::vector<F>;

// ---- KDA mixer (SPEC §2) -------------------------------------------------------------------------
// The input projections of the KDA mixer, shared by training, prefill and decode.
template <class F>
struct KdaProjections {
  Buf<F> qp, kp, vp;   // [rows, HK] before the short convs
  Buf<F> fa, f;        // [rows, K] low-rank forget-gate input, [rows, HK] raw gate input
  Buf<F> braw;         // [rows, H] β logits
  Buf<F> ga, gate_o;   // [rows, K] low-rank output-gate input (unless full rank), [rows, HK] output gate
};

template <class F>
class KdaMixer {
 public:
  KdaMixer(const ModelConfig& c, ParamStore<F>& ps, int layer);
  void forward(const F* x, F* y, const Seqs& s);
  void backward(const F* dy, F* dx, const Seqs& s);
  // Cache: "S" [H, K, V] state and "conv" [3, HK, W-1] short-conv inputs (model/cache.hpp); the static form
  // serves engines that hold no CPU layer (the GPU model).
  CacheSpec cache_spec() const { return cache_spec(c_); }
  static CacheSpec cache_spec(const ModelConfig& c);
  // n new tokens of one sequence after those its cache holds: chunked KDA from the cached state.
  void prefill(LayerCache<F>& cache, const F* x, int64_t n, F* y);
  // One new token for each of S = caches.size() sequences: the recurrent step.
  void decode(const std::vector<LayerCache<F>*>& caches, const F* x, F* y);

  const ModelConfig& config() const { return c_; }
  kda::GateParams gate() const { return gate_; }
  F scale() const { return static_cast<F>(1.0 / std::sqrt(static_cast<double>(K_))); }
  Param<F> *Wq, *Wk, *Wv, *Cq, *Ck, *Cv, *A_log, *dt_bias, *Wfa, *Wfb, *Wb, *Wg = nullptr, *Wga = nullptr,
      *Wgb = nullptr, *onorm, *Wo;
  // Context parallel (null: the whole sequence here): forward and backward see this rank's segment of every
  // sequence (Seqs::batch(B, T) of rank r = tokens [r·T, (r+1)·T)); the short convs take the previous rank's halo
  // (dist/conv_cp.hpp) and the core runs by the scan over segment states (dist/kda_cp.hpp). Every rank of `cp` runs
  // each forward and backward together.
  dist::Comm* cp = nullptr;

 private:
  void project(const F* x, int64_t rows, KdaProjections<F>& p) const;
  // y = W_o [RMSNorm_head(o) ⊙ σ(gate_o)]; on [rows, HK] and rstd [rows, H] are written.
  void output(const F* o, const F* gate_o, int64_t rows, F* on, F* rstd, F* y) const;

  const ModelConfig& c_;
  int64_t d_, H_, K_, HK_, W_;
  kda::GateParams gate_;
  // Saved by forward: x, projections, post-conv q/k/v, core output, norm rstd and output.
  Buf<F> x_, qc_, kc_, vc_, o_, rstd_, on_;
  KdaProjections<F> p_;
  Buf<F> states_;  // KDA chunk-start states from forward, reused by backward
  // Context parallel: the core's prepared inputs (unit q, k; log decay; β), the convs' halos, the scan's states.
  Buf<F> qn_, kn_, g_, beta_;
  Buf<F> halo_[3];
  dist::KdaCpSaved<F> cp_saved_;
};

// ---- gated NoPE MLA (SPEC §3) --------------------------------------------------------------------
template <class F>
class GatedMla {
 public:
  GatedMla(const ModelConfig& c, ParamStore<F>& ps, int layer);
  void forward(const F* x, F* y, const Seqs& s);
  void backward(const F* dy, F* dx, const Seqs& s);
  // Cache: one latent row [RMSNorm_kv(c) ; k_r] of R + Dr values per token, nothing per head.
  CacheSpec cache_spec() const { return cache_spec(c_); }
  static CacheSpec cache_spec(const ModelConfig& c);
  // Absorbed attention (q̃ = W_UKᵀ q_nope, o = W_UV ō) over the latent rows: n new tokens of one sequence
  // (causal over the cache and the chunk), or one new token for each of S = caches.size() sequences.
  void prefill(LayerCache<F>& cache, const F* x, int64_t n, F* y);
  void decode(const std::vector<LayerCache<F>*>& caches, const F* x, F* y);

  const ModelConfig& config() const { return c_; }
  F scale() const { return static_cast<F>(1.0 / std::sqrt(static_cast<double>(Dn_ + Dr_))); }
  Param<F> *Wqa = nullptr, *qa_norm = nullptr, *Wqb = nullptr, *Wq = nullptr, *Wkva, *kva_norm, *Wkvb, *Wo,
           *Wg = nullptr;
  // Context parallel (as KdaMixer::cp): the attention over every rank's latents up to this segment's end
  // (dist/mla_cp.hpp), one sequence at a time; the projections stay token-local.
  dist::Comm* cp = nullptr;

 private:
  // q [rows, Hm, Dq] (qa, qan, qa_rstd: the q-LoRA intermediates, kept by forward).
  void queries(const F* x, int64_t rows, Buf<F>& qa, Buf<F>& qan, Buf<F>& qa_rstd, F* q) const;
  // ckr = W_kva x [rows, RD] and cn = RMSNorm_kv(c) into rows of stride ldcn (c_rstd nullable).
  void latent(const F* x, int64_t rows, F* ckr, F* cn, int64_t ldcn, F* c_rstd) const;
  // y = W_o (o ⊙ σ(W_G x)) (graw, og: the gate's logits and output, resized; unused without a gate).
  void output(const F* x, const F* o, int64_t rows, Buf<F>& graw, Buf<F>& og, F* y) const;
  // Absorbed pieces: qabs [rows, Hm, RD] = per head [W_UK,hᵀ q_nope,h ; q_rope,h]; o [rows, Hm, Dv] = W_UV,h ō_h.
  void absorb_queries(const F* x, int64_t rows, F* qabs) const;
  void expand_values(const F* o_lat, int64_t rows, F* o) const;
  // The latent rows of `rows` new tokens [rows, RD].
  void latent_rows(const F* x, int64_t rows, F* dst) const;

  const ModelConfig& c_;
  int64_t d_, Hm_, Dn_, Dr_, Dv_, R_, Q_;  // Q_: q_lora_rank (0 without)
  Buf<F> x_, qa_, qa_rstd_, qan_, q_, ckr_, c_rstd_, cn_, kv_, k_, v_, o_, lse_, graw_, og_;
  Buf<F> lat_;                                // context parallel: the latent rows [rows, RD] = [cn | k_r]
  std::vector<dist::MlaCpSaved<F>> cp_saved_;  // per sequence
};

// ---- GLU FFN: dense layer, shared experts, and one routed expert (SPEC §4) ------------------------
// y (+)= W_down GLU(W_gate x, W_up x) over `rows` rows of width `din`.
template <class F>
struct GluFfnActs {
  Buf<F> ab, h;  // [rows, 2I] pre-activation, [rows, I]
};
template <class F>
void glu_ffn_forward(const F* x, int64_t rows, int64_t din, int64_t I, const F* Wg, const F* Wu, const F* Wd,
                     const ops::GluParams& p, F* y, bool accumulate, GluFfnActs<F>& a);
// dx (+)= ...; dWg, dWu, dWd accumulated (nullable).
template <class F>
void glu_ffn_backward(const F* x, int64_t rows, int64_t din, int64_t I, const F* Wg, const F* Wu, const F* Wd,
                      const ops::GluParams& p, const F* dy, F* dx, bool accumulate_dx, F* dWg, F* dWu, F* dWd,
                      GluFfnActs<F>& a);

ops::GluParams glu_params(const ModelConfig& c);

template <class F>
class DenseFfn {
 public:
  DenseFfn(const ModelConfig& c, ParamStore<F>& ps, const std::string& prefix, int64_t width);
  void forward(const F* x, F* y, const Seqs& s, bool accumulate = false);
  void backward(const F* dy, F* dx, const Seqs& s, bool accumulate_dx = false);
  Param<F> *Wg, *Wu, *Wd;

 private:
  int64_t d_, I_;
  ops::GluParams p_;
  Buf<F> x_;
  GluFfnActs<F> a_;
};

// ---- Stable LatentMoE (SPEC §5) ----------------------------------------------------------------------
template <class F>
class LatentMoe {
 public:
  LatentMoe(const ModelConfig& c, ParamStore<F>& ps, int layer);
  void forward(const F* x, F* y, const Seqs& s);
  void backward(const F* dy, F* dx, const Seqs& s);

  // Routing of the last forward, for Quantile Balancing and the golden checks.
  const Buf<int32_t>& topk_idx() const { return topk_idx_; }  // [rows, k], ascending per row
  const Buf<F>& scores() const { return scores_; }           // [rows, E] unbiased sigmoid scores
  const Buf<F>& logits() const { return logits_; }           // [rows, E]
  F* bias() { return bias_->w(); }                           // e_score_correction_bias [E]
  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return k_; }
  // Optional Switch-style auxiliary loss (baseline); 0 disables. The loss value is added by the trainer.
  double aux_coef = 0;
  double last_aux_loss = 0;
  // Expert parallel (dist/moe_ep.hpp; null: off): this rank runs only the experts its store holds (its ExpertShard,
  // which must be rank r's [r·E/R, (r+1)·E/R) of `ep`'s R ranks), over the rows every rank of `ep` routes to them,
  // through buffers of dist::expert_capacity(rows, k, E, capacity_factor) rows per expert and source rank. Every rank
  // of `ep` runs each forward and backward together, over the same number of rows. Without it the store must hold
  // every expert.
  void set_expert_parallel(dist::Comm* ep, double capacity_factor = 0);
  dist::Comm* expert_parallel() const { return ep_; }
  // This rank's assignments that the last forward dropped (beyond the capacity; 0 without expert parallel).
  int64_t last_dropped() const { return ep_ ? ex_.dropped : 0; }

  Param<F> *Wr, *bias_, *Wdown = nullptr, *lnorm = nullptr, *Wup = nullptr;
  std::vector<Param<F>*> W1, W3, W2;  // per expert held here (experts e0.. of the store's shard): gate [I, l],
                                      // up [I, l], down [l, I]

 private:
  const ModelConfig& c_;
  int64_t d_, E_, k_, I_, l_;
  bool latent_;
  ops::GluParams p_;
  ops::RouterConfig rc_;
  DenseFfn<F>* shared_ = nullptr;
  std::unique_ptr<DenseFfn<F>> shared_owned_;
  Buf<F> x_, logits_, scores_, topk_w_, z_, zs_, eo_, u_, u_rstd_, un_;
  Buf<int32_t> topk_idx_;
  std::vector<int64_t> offsets_, perm_rows_, perm_pos_;
  int64_t e0_ = 0, El_ = 0;  // the experts held here: [e0_, e0_ + El_)
  dist::Comm* ep_ = nullptr;
  double capacity_ = 0;
  dist::ExpertDispatch ex_;  // expert parallel: the last forward's plan, its grouped rows and their outputs
  Buf<F> gz_, geo_;
  // The experts held here over rows grouped by expert (local expert j: rows offs[j] .. offs[j + 1]), in parallel.
  void experts_forward(const F* xs, const int64_t* offs, F* eo);
  void experts_backward(const F* xs, const int64_t* offs, const F* d_eo, F* dxs);
  std::vector<GluFfnActs<F>> ea_;  // per expert held here
};

}  // namespace lm::model

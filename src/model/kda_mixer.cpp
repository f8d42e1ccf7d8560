// KDA mixer (SPEC §2): projections, short convs + SiLU, gate, β, the KDA operator, per-head gated
// RMSNorm, output projection.
//
// Legend: rows tokens, d hidden, H heads, K = V head dim, HK = H·K, W conv taps.
//   qp, kp, vp = x W_{q,k,v}ᵀ            [rows, HK]
//   qc, kc, vc = silu(conv4(qp|kp|vp))    [rows, HK]   (q, k are L2-normed inside the operator)
//   f  = (x W_faᵀ) W_fbᵀ                  [rows, HK]   raw gate input (dt_bias added in the gate)
//   braw = x W_bᵀ                         [rows, H]    β logits
//   gate_o = x W_gᵀ  or (x W_gaᵀ) W_gbᵀ    [rows, HK]
//   o = KDA(qc, kc, vc, f, braw)          [rows, H, V]
//   y = (RMSNorm_head(o) ⊙ σ(gate_o)) W_oᵀ
#include <algorithm>

#include "core/parallel.hpp"
#include "dist/conv_cp.hpp"
#include "model/layers.hpp"
#include "model/linear.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::model {

template <class F>
KdaMixer<F>::KdaMixer(const ModelConfig& c, ParamStore<F>& ps, int layer)
    : c_(c), d_(c.hidden_size), H_(c.kda_num_heads), K_(c.kda_head_dim), HK_(c.kda_key_dim()), W_(c.kda_conv_kernel) {
  const std::string A = "model.layers." + std::to_string(layer) + ".self_attn.";
  Wq = &ps.at(A + "q_proj.weight"), Wk = &ps.at(A + "k_proj.weight"), Wv = &ps.at(A + "v_proj.weight");
  Cq = &ps.at(A + "q_conv1d.weight"), Ck = &ps.at(A + "k_conv1d.weight"), Cv = &ps.at(A + "v_conv1d.weight");
  A_log = &ps.at(A + "A_log"), dt_bias = &ps.at(A + "dt_bias");
  Wfa = &ps.at(A + "f_a_proj.weight"), Wfb = &ps.at(A + "f_b_proj.weight"), Wb = &ps.at(A + "b_proj.weight");
  if (c.kda_full_rank_gate) {
    Wg = &ps.at(A + "g_proj.weight");
  } else {
    Wga = &ps.at(A + "g_a_proj.weight");
    Wgb = &ps.at(A + "g_b_proj.weight");
  }
  onorm = &ps.at(A + "o_norm.weight"), Wo = &ps.at(A + "o_proj.weight");
  if (c.kda_gate_lower_bound) gate_ = kda::GateParams{kda::GateForm::LowerBound, *c.kda_gate_lower_bound};
  else gate_ = kda::GateParams{kda::GateForm::Softplus, 0.0};
}

template <class F>
void KdaMixer<F>::project(const F* x, int64_t rows, KdaProjections<F>& p) const {
  const int64_t d = d_, HK = HK_, H = H_, K = K_;
  for (Buf<F>* b : {&p.qp, &p.kp, &p.vp, &p.f, &p.gate_o}) b->resize(rows * HK);
  p.fa.resize(rows * K);
  p.braw.resize(rows * H);
  linear_forward(x, Wq->w(), p.qp.data(), rows, d, HK);
  linear_forward(x, Wk->w(), p.kp.data(), rows, d, HK);
  linear_forward(x, Wv->w(), p.vp.data(), rows, d, HK);
  linear_forward(x, Wfa->w(), p.fa.data(), rows, d, K);
  linear_forward(p.fa.data(), Wfb->w(), p.f.data(), rows, K, HK);
  linear_forward(x, Wb->w(), p.braw.data(), rows, d, H);
  if (Wg) {
    linear_forward(x, Wg->w(), p.gate_o.data(), rows, d, HK);
  } else {
    p.ga.resize(rows * K);
    linear_forward(x, Wga->w(), p.ga.data(), rows, d, K);
    linear_forward(p.ga.data(), Wgb->w(), p.gate_o.data(), rows, K, HK);
  }
}

template <class F>
void KdaMixer<F>::output(const F* o, const F* gate_o, int64_t rows, F* on, F* rstd, F* y) const {
  ops::rmsnorm_gated_forward(o, gate_o, onorm->w(), on, rstd, rows * H_, K_, static_cast<F>(c_.rms_norm_eps));
  linear_forward(on, Wo->w(), y, rows, HK_, d_);
}

template <class F>
void KdaMixer<F>::forward(const F* x, F* y, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, HK = HK_, H = H_, K = K_;
  x_.assign(x, x + rows * d);
  for (Buf<F>* b : {&qc_, &kc_, &vc_, &o_, &on_}) b->resize(rows * HK);
  rstd_.resize(rows * H);
  project(x, rows, p_);
  const kda::ConvDims cd = s.conv_dims(HK, W_);
  if (cp) {  // this rank's segment: the convs' halo from the previous rank, the operator's prep, the scan
    LM_CHECK(s.cu.empty(), "context-parallel KDA: packed (varlen) batches are not supported; give B sequences");
    dist::conv_cp_forward<F>(*cp, p_.qp.data(), Cq->w(), nullptr, qc_.data(), cd, true, halo_[0]);
    dist::conv_cp_forward<F>(*cp, p_.kp.data(), Ck->w(), nullptr, kc_.data(), cd, true, halo_[1]);
    dist::conv_cp_forward<F>(*cp, p_.vp.data(), Cv->w(), nullptr, vc_.data(), cd, true, halo_[2]);
    // What fused_forward prepares inside, kept for the backward.
    for (Buf<F>* b : {&qn_, &kn_, &g_}) b->resize(rows * HK);
    beta_.resize(rows * H);
    kda::l2norm_forward<F>(qc_.data(), qn_.data(), rows * H, K);
    kda::l2norm_forward<F>(kc_.data(), kn_.data(), rows * H, K);
    kda::sigmoid_forward<F>(p_.braw.data(), beta_.data(), rows * H);
    kda::gate_forward<F>(p_.f.data(), A_log->w(), dt_bias->w(), g_.data(), rows, H, K, gate_);
    const kda::CoreInputs<F> ci{qn_.data(), kn_.data(), vc_.data(), g_.data(), beta_.data(), nullptr, scale()};
    dist::kda_cp_forward(*cp, ci, s.kda_dims(H, K, K), o_.data(), static_cast<F*>(nullptr), kda::DiagPath::Auto,
                         gate_, cp_saved_);
    output(o_.data(), p_.gate_o.data(), rows, on_.data(), rstd_.data(), y);
    return;
  }
  kda::short_conv_forward<F>(p_.qp.data(), Cq->w(), nullptr, qc_.data(), cd, true);
  kda::short_conv_forward<F>(p_.kp.data(), Ck->w(), nullptr, kc_.data(), cd, true);
  kda::short_conv_forward<F>(p_.vp.data(), Cv->w(), nullptr, vc_.data(), cd, true);
  kda::FusedInputs<F> in;
  in.q = qc_.data(), in.k = kc_.data(), in.v = vc_.data(), in.g_raw = p_.f.data(), in.beta_raw = p_.braw.data();
  in.A_log = A_log->w(), in.dt_bias = dt_bias->w(), in.h0 = nullptr, in.scale = scale(), in.gate = gate_;
  const kda::Dims kd = s.kda_dims(H, K, K);
  states_.resize(kda::chunk_state_count(kd) * K * K);
  kda::fused_forward(in, kd, o_.data(), static_cast<F*>(nullptr), kda::CorePath::Chunked, kda::DiagPath::Auto,
                     states_.data());
  output(o_.data(), p_.gate_o.data(), rows, on_.data(), rstd_.data(), y);
}

template <class F>
void KdaMixer<F>::backward(const F* dy, F* dx, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, HK = HK_, H = H_, K = K_;
  const F* x = x_.data();
  Buf<F> d_on(rows * HK), d_o(rows * HK), d_gate(rows * HK);
  linear_backward(on_.data(), Wo->w(), dy, d_on.data(), Wo->g(), rows, HK, d);
  ops::rmsnorm_gated_backward(o_.data(), p_.gate_o.data(), onorm->w(), rstd_.data(), d_on.data(), d_o.data(),
                              d_gate.data(), onorm->g(), rows * H, K, static_cast<F>(c_.rms_norm_eps));
  // Output gate.
  if (Wg) {
    linear_backward(x, Wg->w(), d_gate.data(), dx, Wg->g(), rows, d, HK, false);
  } else {
    Buf<F> d_ga(rows * K);
    linear_backward(p_.ga.data(), Wgb->w(), d_gate.data(), d_ga.data(), Wgb->g(), rows, K, HK);
    linear_backward(x, Wga->w(), d_ga.data(), dx, Wga->g(), rows, d, K, false);
  }
  // The KDA operator (L2 norms, gate, β sigmoid inside).
  Buf<F> dqc(rows * HK), dkc(rows * HK), dvc(rows * HK), df(rows * HK), dbraw(rows * H), dA(H), ddt(HK);
  if (cp) {  // the scan's backward, then fused_backward's chain through the prep
    Buf<F> dqn(rows * HK), dkn(rows * HK), dg(rows * HK), dbeta(rows * H);
    const kda::CoreInputs<F> ci{qn_.data(), kn_.data(), vc_.data(), g_.data(), beta_.data(), nullptr, scale()};
    const kda::CoreGrads<F> cg{dqn.data(), dkn.data(), dvc.data(), dg.data(), dbeta.data(), nullptr};
    dist::kda_cp_backward(*cp, ci, s.kda_dims(H, K, K), d_o.data(), static_cast<const F*>(nullptr), cg,
                          kda::DiagPath::Auto, gate_, cp_saved_);
    kda::l2norm_backward<F>(qc_.data(), dqn.data(), dqc.data(), rows * H, K);
    kda::l2norm_backward<F>(kc_.data(), dkn.data(), dkc.data(), rows * H, K);
    kda::sigmoid_backward<F>(p_.braw.data(), dbeta.data(), dbraw.data(), rows * H);
    std::fill(dA.begin(), dA.end(), F(0)), std::fill(ddt.begin(), ddt.end(), F(0));
    kda::gate_backward<F>(p_.f.data(), A_log->w(), dt_bias->w(), dg.data(), df.data(), dA.data(), ddt.data(), rows, H,
                          K, gate_);
  } else {
    kda::FusedInputs<F> in;
    in.q = qc_.data(), in.k = kc_.data(), in.v = vc_.data(), in.g_raw = p_.f.data(), in.beta_raw = p_.braw.data();
    in.A_log = A_log->w(), in.dt_bias = dt_bias->w(), in.h0 = nullptr, in.scale = scale(), in.gate = gate_;
    kda::FusedGrads<F> gr{dqc.data(), dkc.data(), dvc.data(), df.data(), dbraw.data(), dA.data(), ddt.data(), nullptr};
    kda::fused_backward(in, s.kda_dims(H, K, K), d_o.data(), static_cast<const F*>(nullptr), gr,
                        kda::CorePath::Chunked, kda::DiagPath::Auto, static_cast<const F*>(states_.data()));
  }
  if (A_log->g())
    for (int64_t h = 0; h < H; ++h) A_log->g()[h] += dA[h];
  if (dt_bias->g())
    for (int64_t i = 0; i < HK; ++i) dt_bias->g()[i] += ddt[i];
  // β and the low-rank forget-gate projection.
  linear_backward(x, Wb->w(), dbraw.data(), dx, Wb->g(), rows, d, H, true);
  Buf<F> d_fa(rows * K);
  linear_backward(p_.fa.data(), Wfb->w(), df.data(), d_fa.data(), Wfb->g(), rows, K, HK);
  linear_backward(x, Wfa->w(), d_fa.data(), dx, Wfa->g(), rows, d, K, true);
  // Short convolutions + SiLU, then the q/k/v projections.
  const kda::ConvDims cd = s.conv_dims(HK, W_);
  Buf<F> dp(rows * HK);
  struct Branch {
    Param<F>*W, *C;
    const Buf<F>& pre;
    const Buf<F>& dpost;
    const Buf<F>& halo;  // context parallel only
  };
  for (const Branch& b : {Branch{Wq, Cq, p_.qp, dqc, halo_[0]}, Branch{Wk, Ck, p_.kp, dkc, halo_[1]},
                         Branch{Wv, Cv, p_.vp, dvc, halo_[2]}}) {
    if (cp)
      dist::conv_cp_backward<F>(*cp, b.pre.data(), b.C->w(), b.halo, b.dpost.data(), dp.data(), b.C->g(), nullptr, cd,
                                true);
    else
      kda::short_conv_backward<F>(b.pre.data(), b.C->w(), nullptr, b.dpost.data(), dp.data(), b.C->g(), nullptr, cd,
                                  true);
    linear_backward(x, b.W->w(), dp.data(), dx, b.W->g(), rows, d, HK, true);
  }
}

// ---- inference over a per-sequence cache --------------------------------------------------------------

template <class F>
CacheSpec KdaMixer<F>::cache_spec(const ModelConfig& m) {
  const int64_t H = m.kda_num_heads, K = m.kda_head_dim;
  CacheSpec c;
  c.states = {{"S", {H, K, K}, DType::F32}, {"conv", {3, m.kda_key_dim(), m.kda_conv_kernel - 1}, DType::F32}};
  return c;
}

template <class F>
void KdaMixer<F>::prefill(LayerCache<F>& cache, const F* x, int64_t n, F* y) {
  const int64_t HK = HK_, H = H_, K = K_, W = W_;
  KdaProjections<F> p;
  project(x, n, p);
  // The short convs continue from the cached last W-1 inputs, which then move on to this chunk's last ones.
  Buf<F> qc(n * HK), kc(n * HK), vc(n * HK);
  const kda::ConvDims cd{1, n, HK, W};
  const Buf<F>* pre[3] = {&p.qp, &p.kp, &p.vp};
  Buf<F>* post[3] = {&qc, &kc, &vc};
  const Param<F>* cw[3] = {Cq, Ck, Cv};
  for (int j = 0; j < 3; ++j) {
    F* conv = cache.states[1].data() + j * HK * (W - 1);
    kda::short_conv_forward<F>(pre[j]->data(), cw[j]->w(), conv, post[j]->data(), cd, true);
    kda::short_conv_final_cache<F>(pre[j]->data(), conv, conv, cd);
  }
  kda::FusedInputs<F> in;
  in.q = qc.data(), in.k = kc.data(), in.v = vc.data(), in.g_raw = p.f.data(), in.beta_raw = p.braw.data();
  in.A_log = A_log->w(), in.dt_bias = dt_bias->w(), in.scale = scale(), in.gate = gate_;
  auto& state = cache.states[0];
  in.h0 = state.data();
  Buf<F> o(n * HK), ht(state.size()), on(n * HK), rstd(n * H);
  kda::fused_forward(in, kda::Dims{1, n, H, K, K}, o.data(), ht.data(), kda::CorePath::Chunked, kda::DiagPath::Auto);
  state.swap(ht);
  output(o.data(), p.gate_o.data(), n, on.data(), rstd.data(), y);
}

template <class F>
void KdaMixer<F>::decode(const std::vector<LayerCache<F>*>& caches, const F* x, F* y) {
  const int64_t HK = HK_, H = H_, K = K_, W = W_, S = static_cast<int64_t>(caches.size());
  KdaProjections<F> p;
  project(x, S, p);
  Buf<F> qc(S * HK), kc(S * HK), vc(S * HK);
  const Buf<F>* pre[3] = {&p.qp, &p.kp, &p.vp};
  Buf<F>* post[3] = {&qc, &kc, &vc};
  const Param<F>* cw[3] = {Cq, Ck, Cv};
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < 3; ++j)
      kda::short_conv_step<F>(pre[j]->data() + s * HK, cw[j]->w(), caches[s]->states[1].data() + j * HK * (W - 1),
                              post[j]->data() + s * HK, 1, HK, W, true);
  // The operator's own preprocessing (as fused_forward does), then one recurrent step per (sequence, head).
  Buf<F> qn(S * HK), kn(S * HK), g(S * HK), beta(S * H), o(S * HK), on(S * HK), rstd(S * H);
  kda::l2norm_forward<F>(qc.data(), qn.data(), S * H, K);
  kda::l2norm_forward<F>(kc.data(), kn.data(), S * H, K);
  kda::sigmoid_forward<F>(p.braw.data(), beta.data(), S * H);
  kda::gate_forward<F>(p.f.data(), A_log->w(), dt_bias->w(), g.data(), S, H, K, gate_);
  const F sc = scale();
  parallel_for(
      S * H,
      [&](int64_t sh) {
        const int64_t s = sh / H, h = sh % H, off = sh * K;
        kda::decode_step<F>(caches[s]->states[0].data() + h * K * K, qn.data() + off, kn.data() + off, vc.data() + off,
                            g.data() + off, beta.data() + sh, o.data() + off, 1, 1, K, K, sc);
      },
      std::max<int64_t>(1, (1 << 14) / (K * K)));
  output(o.data(), p.gate_o.data(), S, on.data(), rstd.data(), y);
}

template class KdaMixer<float>;
template class KdaMixer<double>;

}  // namespace lm::model

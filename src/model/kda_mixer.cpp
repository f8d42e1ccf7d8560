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
void KdaMixer<F>::forward(const F* x, F* y, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, HK = HK_, H = H_, K = K_;
  x_.assign(x, x + rows * d);
  for (Buf<F>* b : {&qp_, &kp_, &vp_, &qc_, &kc_, &vc_, &f_, &gate_o_, &o_, &on_}) b->resize(rows * HK);
  fa_.resize(rows * K);
  braw_.resize(rows * H);
  rstd_.resize(rows * H);
  linear_forward(x, Wq->w(), qp_.data(), rows, d, HK);
  linear_forward(x, Wk->w(), kp_.data(), rows, d, HK);
  linear_forward(x, Wv->w(), vp_.data(), rows, d, HK);
  const kda::ConvDims cd = s.conv_dims(HK, W_);
  kda::short_conv_forward<F>(qp_.data(), Cq->w(), nullptr, qc_.data(), cd, true);
  kda::short_conv_forward<F>(kp_.data(), Ck->w(), nullptr, kc_.data(), cd, true);
  kda::short_conv_forward<F>(vp_.data(), Cv->w(), nullptr, vc_.data(), cd, true);
  linear_forward(x, Wfa->w(), fa_.data(), rows, d, K);
  linear_forward(fa_.data(), Wfb->w(), f_.data(), rows, K, HK);
  linear_forward(x, Wb->w(), braw_.data(), rows, d, H);
  if (Wg) {
    linear_forward(x, Wg->w(), gate_o_.data(), rows, d, HK);
  } else {
    ga_.resize(rows * K);
    linear_forward(x, Wga->w(), ga_.data(), rows, d, K);
    linear_forward(ga_.data(), Wgb->w(), gate_o_.data(), rows, K, HK);
  }
  kda::FusedInputs<F> in;
  in.q = qc_.data(), in.k = kc_.data(), in.v = vc_.data(), in.g_raw = f_.data(), in.beta_raw = braw_.data();
  in.A_log = A_log->w(), in.dt_bias = dt_bias->w(), in.h0 = nullptr, in.scale = scale(), in.gate = gate_;
  const kda::Dims kd = s.kda_dims(H, K, K);
  states_.resize(kda::chunk_state_count(kd) * K * K);
  kda::fused_forward(in, kd, o_.data(), static_cast<F*>(nullptr), kda::CorePath::Chunked, kda::DiagPath::Auto,
                     states_.data());
  ops::rmsnorm_gated_forward(o_.data(), gate_o_.data(), onorm->w(), on_.data(), rstd_.data(), rows * H, K,
                             static_cast<F>(c_.rms_norm_eps));
  linear_forward(on_.data(), Wo->w(), y, rows, HK, d);
}

template <class F>
void KdaMixer<F>::backward(const F* dy, F* dx, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, HK = HK_, H = H_, K = K_;
  const F* x = x_.data();
  Buf<F> d_on(rows * HK), d_o(rows * HK), d_gate(rows * HK);
  linear_backward(on_.data(), Wo->w(), dy, d_on.data(), Wo->g(), rows, HK, d);
  ops::rmsnorm_gated_backward(o_.data(), gate_o_.data(), onorm->w(), rstd_.data(), d_on.data(), d_o.data(),
                              d_gate.data(), onorm->g(), rows * H, K, static_cast<F>(c_.rms_norm_eps));
  // Output gate.
  if (Wg) {
    linear_backward(x, Wg->w(), d_gate.data(), dx, Wg->g(), rows, d, HK, false);
  } else {
    Buf<F> d_ga(rows * K);
    linear_backward(ga_.data(), Wgb->w(), d_gate.data(), d_ga.data(), Wgb->g(), rows, K, HK);
    linear_backward(x, Wga->w(), d_ga.data(), dx, Wga->g(), rows, d, K, false);
  }
  // The KDA operator (L2 norms, gate, β sigmoid inside).
  Buf<F> dqc(rows * HK), dkc(rows * HK), dvc(rows * HK), df(rows * HK), dbraw(rows * H), dA(H), ddt(HK);
  kda::FusedInputs<F> in;
  in.q = qc_.data(), in.k = kc_.data(), in.v = vc_.data(), in.g_raw = f_.data(), in.beta_raw = braw_.data();
  in.A_log = A_log->w(), in.dt_bias = dt_bias->w(), in.h0 = nullptr, in.scale = scale(), in.gate = gate_;
  kda::FusedGrads<F> gr{dqc.data(), dkc.data(), dvc.data(), df.data(), dbraw.data(), dA.data(), ddt.data(), nullptr};
  kda::fused_backward(in, s.kda_dims(H, K, K), d_o.data(), static_cast<const F*>(nullptr), gr,
                      kda::CorePath::Chunked, kda::DiagPath::Auto, static_cast<const F*>(states_.data()));
  if (A_log->g())
    for (int64_t h = 0; h < H; ++h) A_log->g()[h] += dA[h];
  if (dt_bias->g())
    for (int64_t i = 0; i < HK; ++i) dt_bias->g()[i] += ddt[i];
  // β and the low-rank forget-gate projection.
  linear_backward(x, Wb->w(), dbraw.data(), dx, Wb->g(), rows, d, H, true);
  Buf<F> d_fa(rows * K);
  linear_backward(fa_.data(), Wfb->w(), df.data(), d_fa.data(), Wfb->g(), rows, K, HK);
  linear_backward(x, Wfa->w(), d_fa.data(), dx, Wfa->g(), rows, d, K, true);
  // Short convolutions + SiLU, then the q/k/v projections.
  const kda::ConvDims cd = s.conv_dims(HK, W_);
  Buf<F> dp(rows * HK);
  struct Branch {
    Param<F>*W, *C;
    const Buf<F>& pre;
    const Buf<F>& dpost;
  };
  for (const Branch& b : {Branch{Wq, Cq, qp_, dqc}, Branch{Wk, Ck, kp_, dkc}, Branch{Wv, Cv, vp_, dvc}}) {
    kda::short_conv_backward<F>(b.pre.data(), b.C->w(), nullptr, b.dpost.data(), dp.data(), b.C->g(), nullptr, cd,
                                true);
    linear_backward(x, b.W->w(), dp.data(), dx, b.W->g(), rows, d, HK, true);
  }
}

template class KdaMixer<float>;
template class KdaMixer<double>;

}  // namespace lm::model

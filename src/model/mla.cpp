// Gated NoPE MLA (SPEC §3): q (LoRA or plain), kv compression with its RMSNorm, per-head expansion,
// causal softmax attention (tiled, online softmax), optional sigmoid output gate, output projection.
//
// Legend: rows tokens, d hidden, Hm heads, Dn nope / Dr rope / Dv value head dims, Dq = Dn + Dr,
//         R kv_lora_rank, Q q_lora_rank.
//   q    = W_qb RMSNorm_q(W_qa x)  or  W_q x                    [rows, Hm, Dq]
//   ckr  = W_kva x = [c | k_r]                                   [rows, R + Dr]
//   cn   = RMSNorm_kv(c)  (eps 1e-6)                              [rows, R]
//   kv   = W_kvb cn = per head [k_nope | v]                       [rows, Hm, Dn + Dv]
//   k    = per head [k_nope | k_r]  (k_r shared by the heads)     [rows, Hm, Dq]
//   o    = softmax_causal(q kᵀ / sqrt(Dq)) v                     [rows, Hm, Dv]
//   y    = W_o (o ⊙ σ(W_G x))  (gate optional)
#include <algorithm>

#include "core/simd_math.hpp"
#include "model/layers.hpp"
#include "model/linear.hpp"
#include "ops/attention/attention.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::model {

namespace {
constexpr double kLoraEps = 1e-6;  // q_a_layernorm / kv_a_layernorm are built without an eps
template <class F>
F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}
}  // namespace

template <class F>
GatedMla<F>::GatedMla(const ModelConfig& c, ParamStore<F>& ps, int layer)
    : c_(c),
      d_(c.hidden_size),
      Hm_(c.num_attention_heads),
      Dn_(c.qk_nope_head_dim),
      Dr_(c.qk_rope_head_dim),
      Dv_(c.v_head_dim),
      R_(c.kv_lora_rank),
      Q_(c.q_lora_rank.value_or(0)) {
  const std::string A = "model.layers." + std::to_string(layer) + ".self_attn.";
  if (c.has_q_lora()) {
    Wqa = &ps.at(A + "q_a_proj.weight");
    qa_norm = &ps.at(A + "q_a_layernorm.weight");
    Wqb = &ps.at(A + "q_b_proj.weight");
  } else {
    Wq = &ps.at(A + "q_proj.weight");
  }
  Wkva = &ps.at(A + "kv_a_proj_with_mqa.weight");
  kva_norm = &ps.at(A + "kv_a_layernorm.weight");
  Wkvb = &ps.at(A + "kv_b_proj.weight");
  Wo = &ps.at(A + "o_proj.weight");
  if (c.mla_use_output_gate) Wg = &ps.at(A + "g_proj.weight");
}

template <class F>
void GatedMla<F>::forward(const F* x, F* y, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, H = Hm_, Dq = Dn_ + Dr_, Dkv = Dn_ + Dv_, RD = R_ + Dr_;
  x_.assign(x, x + rows * d);
  q_.resize(rows * H * Dq);
  if (Q_) {
    qa_.resize(rows * Q_), qan_.resize(rows * Q_), qa_rstd_.resize(rows);
    linear_forward(x, Wqa->w(), qa_.data(), rows, d, Q_);
    ops::rmsnorm_forward(qa_.data(), qa_norm->w(), qan_.data(), qa_rstd_.data(), rows, Q_, static_cast<F>(kLoraEps));
    linear_forward(qan_.data(), Wqb->w(), q_.data(), rows, Q_, H * Dq);
  } else {
    linear_forward(x, Wq->w(), q_.data(), rows, d, H * Dq);
  }
  ckr_.resize(rows * RD), cn_.resize(rows * R_), c_rstd_.resize(rows);
  linear_forward(x, Wkva->w(), ckr_.data(), rows, d, RD);
  ops::rmsnorm_forward(ckr_.data(), kva_norm->w(), cn_.data(), c_rstd_.data(), rows, R_, static_cast<F>(kLoraEps), RD,
                       R_);
  kv_.resize(rows * H * Dkv);
  linear_forward(cn_.data(), Wkvb->w(), kv_.data(), rows, R_, H * Dkv);
  k_.resize(rows * H * Dq), v_.resize(rows * H * Dv_);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const F* kvh = &kv_[(r * H + h) * Dkv];
      F* kh = &k_[(r * H + h) * Dq];
      std::copy_n(kvh, Dn_, kh);
      std::copy_n(&ckr_[r * RD + R_], Dr_, kh + Dn_);
      std::copy_n(kvh + Dn_, Dv_, &v_[(r * H + h) * Dv_]);
    }
  o_.resize(rows * H * Dv_), lse_.resize(rows * H);
  const ops::AttnDims ad = s.attn_dims(H, Dq, Dv_);
  ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), lse_.data(), ad, scale());
  const F* o_in = o_.data();
  if (Wg) {
    graw_.resize(rows * H * Dv_), og_.resize(rows * H * Dv_);
    linear_forward(x, Wg->w(), graw_.data(), rows, d, H * Dv_);
    for (int64_t i = 0; i < rows * H * Dv_; ++i) og_[i] = o_[i] * sigmoid(graw_[i]);
    o_in = og_.data();
  }
  linear_forward(o_in, Wo->w(), y, rows, H * Dv_, d);
}

template <class F>
void GatedMla<F>::backward(const F* dy, F* dx, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, H = Hm_, Dq = Dn_ + Dr_, Dkv = Dn_ + Dv_, RD = R_ + Dr_, HV = H * Dv_;
  const F* x = x_.data();
  Buf<F> d_og(rows * HV), d_o(rows * HV);
  linear_backward(Wg ? og_.data() : o_.data(), Wo->w(), dy, d_og.data(), Wo->g(), rows, HV, d);
  bool dx_written = false;
  if (Wg) {
    Buf<F> d_g(rows * HV);
    for (int64_t i = 0; i < rows * HV; ++i) {
      const F sg = sigmoid(graw_[i]);
      d_o[i] = d_og[i] * sg;
      d_g[i] = d_og[i] * o_[i] * sg * (F(1) - sg);
    }
    linear_backward(x, Wg->w(), d_g.data(), dx, Wg->g(), rows, d, HV, false);
    dx_written = true;
  } else {
    d_o = d_og;
  }
  Buf<F> dq(rows * H * Dq), dk(rows * H * Dq), dv(rows * HV);
  const ops::AttnDims ad = s.attn_dims(H, Dq, Dv_);
  ops::attention_backward(q_.data(), k_.data(), v_.data(), o_.data(), lse_.data(), d_o.data(), dq.data(), dk.data(),
                          dv.data(), ad, scale());
  // k = [k_nope | k_r]: k_nope and v go back through kv_b; k_r (shared) sums over heads into d ckr.
  Buf<F> dkv(rows * H * Dkv), dckr(rows * RD, F(0));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const F* dkh = &dk[(r * H + h) * Dq];
      F* dkvh = &dkv[(r * H + h) * Dkv];
      std::copy_n(dkh, Dn_, dkvh);
      std::copy_n(&dv[(r * H + h) * Dv_], Dv_, dkvh + Dn_);
      F* dkr = &dckr[r * RD + R_];
      for (int64_t j = 0; j < Dr_; ++j) dkr[j] += dkh[Dn_ + j];
    }
  Buf<F> dcn(rows * R_);
  linear_backward(cn_.data(), Wkvb->w(), dkv.data(), dcn.data(), Wkvb->g(), rows, R_, H * Dkv);
  ops::rmsnorm_backward(ckr_.data(), kva_norm->w(), c_rstd_.data(), dcn.data(), dckr.data(), kva_norm->g(), rows, R_,
                        static_cast<F>(kLoraEps), RD, R_);
  linear_backward(x, Wkva->w(), dckr.data(), dx, Wkva->g(), rows, d, RD, dx_written);
  if (Q_) {
    Buf<F> dqan(rows * Q_), dqa(rows * Q_);
    linear_backward(qan_.data(), Wqb->w(), dq.data(), dqan.data(), Wqb->g(), rows, Q_, H * Dq);
    ops::rmsnorm_backward(qa_.data(), qa_norm->w(), qa_rstd_.data(), dqan.data(), dqa.data(), qa_norm->g(), rows, Q_,
                          static_cast<F>(kLoraEps));
    linear_backward(x, Wqa->w(), dqa.data(), dx, Wqa->g(), rows, d, Q_, true);
  } else {
    linear_backward(x, Wq->w(), dq.data(), dx, Wq->g(), rows, d, H * Dq, true);
  }
}

template class GatedMla<float>;
template class GatedMla<double>;

}  // namespace lm::model

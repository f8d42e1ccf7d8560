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
void GatedMla<F>::queries(const F* x, int64_t rows, Buf<F>& qa, Buf<F>& qan, Buf<F>& qa_rstd, F* q) const {
  const int64_t d = d_, H = Hm_, Dq = Dn_ + Dr_;
  if (Q_) {
    qa.resize(rows * Q_), qan.resize(rows * Q_), qa_rstd.resize(rows);
    linear_forward(x, Wqa->w(), qa.data(), rows, d, Q_);
    ops::rmsnorm_forward(qa.data(), qa_norm->w(), qan.data(), qa_rstd.data(), rows, Q_, static_cast<F>(kLoraEps));
    linear_forward(qan.data(), Wqb->w(), q, rows, Q_, H * Dq);
  } else {
    linear_forward(x, Wq->w(), q, rows, d, H * Dq);
  }
}

template <class F>
void GatedMla<F>::latent(const F* x, int64_t rows, F* ckr, F* cn, int64_t ldcn, F* c_rstd) const {
  const int64_t RD = R_ + Dr_;
  linear_forward(x, Wkva->w(), ckr, rows, d_, RD);
  ops::rmsnorm_forward(ckr, kva_norm->w(), cn, c_rstd, rows, R_, static_cast<F>(kLoraEps), RD, ldcn);
}

template <class F>
void GatedMla<F>::output(const F* x, const F* o, int64_t rows, Buf<F>& graw, Buf<F>& og, F* y) const {
  const int64_t HV = Hm_ * Dv_;
  if (Wg) {
    graw.resize(rows * HV), og.resize(rows * HV);
    linear_forward(x, Wg->w(), graw.data(), rows, d_, HV);
    for (int64_t i = 0; i < rows * HV; ++i) og[i] = o[i] * sigmoid(graw[i]);
    o = og.data();
  }
  linear_forward(o, Wo->w(), y, rows, HV, d_);
}

template <class F>
void GatedMla<F>::forward(const F* x, F* y, const Seqs& s) {
  const int64_t rows = s.rows(), d = d_, H = Hm_, Dq = Dn_ + Dr_, Dkv = Dn_ + Dv_, RD = R_ + Dr_;
  x_.assign(x, x + rows * d);
  q_.resize(rows * H * Dq);
  queries(x, rows, qa_, qan_, qa_rstd_, q_.data());
  ckr_.resize(rows * RD), cn_.resize(rows * R_), c_rstd_.resize(rows);
  latent(x, rows, ckr_.data(), cn_.data(), R_, c_rstd_.data());
  o_.resize(rows * H * Dv_);
  if (cp) {  // this rank's queries over every rank's latent rows up to its segment's end, one sequence at a time
    LM_CHECK(s.cu.empty(), "context-parallel MLA: packed (varlen) batches are not supported; give B sequences");
    const int64_t T = s.T;
    lat_.resize(rows * RD);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(&cn_[r * R_], R_, &lat_[r * RD]);
      std::copy_n(&ckr_[r * RD + R_], Dr_, &lat_[r * RD + R_]);
    }
    cp_saved_.resize(static_cast<size_t>(s.B));
    const dist::MlaCpDims md{T, H, Dn_, Dr_, Dv_, R_};
    for (int64_t b = 0; b < s.B; ++b)
      dist::mla_cp_forward(*cp, lat_.data() + b * T * RD, q_.data() + b * T * H * Dq, Wkvb->w(),
                           o_.data() + b * T * H * Dv_, md, scale(), cp_saved_[static_cast<size_t>(b)]);
    output(x, o_.data(), rows, graw_, og_, y);
    return;
  }
  kv_.resize(rows * H * Dkv);
  linear_forward(cn_.data(), Wkvb->w(), kv_.data(), rows, R_, H * Dkv);
  k_.resize(rows * H * Dq), v_.resize(rows * H * Dv_);
  ops::mla_split_kv(kv_.data(), ckr_.data() + R_, RD, k_.data(), v_.data(), rows, H, Dn_, Dr_, Dv_);
  lse_.resize(rows * H);
  const ops::AttnDims ad = s.attn_dims(H, Dq, Dv_);
  ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), lse_.data(), ad, scale());
  output(x, o_.data(), rows, graw_, og_, y);
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
  Buf<F> dq(rows * H * Dq), dckr(rows * RD, F(0));
  if (cp) {
    // d latent [rows, RD] = [d cn | d k_r] (W_kvb's gradient inside), then the norm back in place: d ckr.
    const int64_t T = s.T;
    const dist::MlaCpDims md{T, H, Dn_, Dr_, Dv_, R_};
    for (int64_t b = 0; b < s.B; ++b)
      dist::mla_cp_backward(*cp, Wkvb->w(), d_o.data() + b * T * HV, dq.data() + b * T * H * Dq,
                            dckr.data() + b * T * RD, Wkvb->g(), md, scale(), cp_saved_[static_cast<size_t>(b)]);
    ops::rmsnorm_backward(ckr_.data(), kva_norm->w(), c_rstd_.data(), dckr.data(), dckr.data(), kva_norm->g(), rows,
                          R_, static_cast<F>(kLoraEps), RD, RD);
  } else {
    Buf<F> dk(rows * H * Dq), dv(rows * HV);
    const ops::AttnDims ad = s.attn_dims(H, Dq, Dv_);
    ops::attention_backward(q_.data(), k_.data(), v_.data(), o_.data(), lse_.data(), d_o.data(), dq.data(), dk.data(),
                            dv.data(), ad, scale());
    // k = [k_nope | k_r]: k_nope and v go back through kv_b; k_r (shared) sums over heads into d ckr.
    Buf<F> dkv(rows * H * Dkv);
    ops::mla_merge_dkv(dk.data(), dv.data(), dkv.data(), dckr.data() + R_, RD, rows, H, Dn_, Dr_, Dv_);
    Buf<F> dcn(rows * R_);
    linear_backward(cn_.data(), Wkvb->w(), dkv.data(), dcn.data(), Wkvb->g(), rows, R_, H * Dkv);
    ops::rmsnorm_backward(ckr_.data(), kva_norm->w(), c_rstd_.data(), dcn.data(), dckr.data(), kva_norm->g(), rows,
                          R_, static_cast<F>(kLoraEps), RD, R_);
  }
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

// ---- inference over the latent cache (absorbed form) --------------------------------------------------
// W_kvb [Hm·(Dn + Dv), R]: per head h, rows h·(Dn+Dv) .. +Dn are W_UK,h [Dn, R], the next Dv rows W_UV,h.

template <class F>
CacheSpec GatedMla<F>::cache_spec(const ModelConfig& m) {
  CacheSpec c;
  c.row_width = m.kv_lora_rank + m.qk_rope_head_dim;
  c.row_dtype = DType::BF16;
  return c;
}

template <class F>
void GatedMla<F>::latent_rows(const F* x, int64_t rows, F* dst) const {
  const int64_t RD = R_ + Dr_;
  Buf<F> ckr(rows * RD);
  latent(x, rows, ckr.data(), dst, RD, static_cast<F*>(nullptr));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(&ckr[r * RD + R_], Dr_, dst + r * RD + R_);
}

template <class F>
void GatedMla<F>::absorb_queries(const F* x, int64_t rows, F* qabs) const {
  const int64_t H = Hm_, Dq = Dn_ + Dr_, RD = R_ + Dr_;
  Buf<F> q(rows * H * Dq), qa, qan, qa_rstd;
  queries(x, rows, qa, qan, qa_rstd, q.data());
  // q̃_h = W_UK,hᵀ q_nope,h (Dn -> R); q_rope is used as is (NoPE: no rotation).
  const F* Wkvb_ = Wkvb->w();
  for (int64_t h = 0; h < H; ++h)
    ops::gemm(false, false, rows, R_, Dn_, F(1), q.data() + h * Dq, H * Dq, Wkvb_ + h * (Dn_ + Dv_) * R_, R_, F(0),
              qabs + h * RD, H * RD);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) std::copy_n(&q[(r * H + h) * Dq + Dn_], Dr_, qabs + (r * H + h) * RD + R_);
}

template <class F>
void GatedMla<F>::expand_values(const F* o_lat, int64_t rows, F* o) const {
  const int64_t H = Hm_, HV = H * Dv_;
  const F* Wkvb_ = Wkvb->w();
  for (int64_t h = 0; h < H; ++h)
    ops::gemm(false, true, rows, Dv_, R_, F(1), o_lat + h * R_, H * R_, Wkvb_ + (h * (Dn_ + Dv_) + Dn_) * R_, R_, F(0),
              o + h * Dv_, HV);
}

// Appends `add` rows of `width` values, growing the capacity by at least 1/16 (and 1024 rows) so a decode
// neither copies the cache per token nor doubles its footprint.
template <class F>
static void grow(std::vector<F>& v, int64_t add, int64_t width) {
  const size_t need = v.size() + static_cast<size_t>(add * width);
  if (need <= v.capacity()) return;
  const size_t step = std::max<size_t>(v.capacity() / 16, static_cast<size_t>(1024 * width));
  v.reserve(std::max(need, v.capacity() + step));
}

template <class F>
void GatedMla<F>::prefill(LayerCache<F>& cache, const F* x, int64_t n, F* y) {
  const int64_t H = Hm_, RD = R_ + Dr_;
  auto& rows = cache.rows;
  const int64_t p = cache.tokens();
  grow(rows, n, RD);
  rows.resize((p + n) * RD);
  latent_rows(x, n, rows.data() + p * RD);
  Buf<F> qabs(n * H * RD), o_lat(n * H * R_), o(n * H * Dv_), graw, og;
  absorb_queries(x, n, qabs.data());
  ops::mla_prefill_absorbed(qabs.data(), rows.data(), p, n, H, R_, Dr_, scale(), o_lat.data());
  expand_values(o_lat.data(), n, o.data());
  output(x, o.data(), n, graw, og, y);
}

template <class F>
void GatedMla<F>::decode(const std::vector<LayerCache<F>*>& caches, const F* x, F* y) {
  const int64_t H = Hm_, R = R_, Dr = Dr_, RD = R + Dr, S = static_cast<int64_t>(caches.size());
  Buf<F> lat(S * RD);
  latent_rows(x, S, lat.data());
  Buf<F> qabs(S * H * RD), o_lat(S * H * R), ql(H * R), qr(H * Dr), o(S * H * Dv_), graw, og;
  absorb_queries(x, S, qabs.data());
  for (int64_t s = 0; s < S; ++s) {
    auto& rows = caches[s]->rows;
    grow(rows, 1, RD);
    rows.insert(rows.end(), lat.begin() + s * RD, lat.begin() + (s + 1) * RD);
    for (int64_t h = 0; h < H; ++h) {
      const F* q = qabs.data() + (s * H + h) * RD;
      std::copy_n(q, R, ql.data() + h * R);
      std::copy_n(q + R, Dr, qr.data() + h * Dr);
    }
    ops::DecodeDims dd;
    dd.H = H, dd.Tc = caches[s]->tokens(), dd.R = R, dd.Dr = Dr, dd.ldc = RD, dd.ldkr = RD;
    ops::mla_decode_absorbed(ql.data(), Dr ? qr.data() : nullptr, rows.data(), Dr ? rows.data() + R : nullptr,
                             o_lat.data() + s * H * R, static_cast<F*>(nullptr), dd, scale());
  }
  expand_values(o_lat.data(), S, o.data());
  output(x, o.data(), S, graw, og, y);
}

template class GatedMla<float>;
template class GatedMla<double>;

}  // namespace lm::model

// Decoding engine (see session.hpp): the walk over the layers for new tokens only, with KDA / MLA
// mixers that read and extend each sequence's cache.
//
// Legend: rows new tokens in this walk (n of one sequence in prefill, S sequences in decode), d hidden,
//         H/K KDA heads and head dim, HK = H·K, W conv taps, Hm MLA heads, Dn/Dr/Dv MLA nope/rope/value
//         head dims, Dq = Dn + Dr, R kv_lora_rank, RD = R + Dr, bs attn_res_block_size, Q reads per block.
// W_kvb [Hm·(Dn + Dv), R]: per head h, rows h·(Dn+Dv) .. +Dn are W_UK,h [Dn, R], the next Dv rows W_UV,h.
#include "infer/session.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/simd_math.hpp"
#include "model/linear.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attnres/attnres.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "ops/embedding/embedding.hpp"
#include "ops/gemm/gemm.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::infer {

namespace {

using Buf = std::vector<float>;
using model::linear_forward;
constexpr float kLoraEps = 1e-6f;  // q_a_layernorm / kv_a_layernorm (module default eps)

struct Timer {
  double& acc;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Timer(double& a) : acc(a) {}
  ~Timer() { acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

void add_into(float* y, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Decode steps of a few rows are too small to pay for waking a thread team at every GEMM and expert loop:
// below kSerialRows rows the FFN / MoE and KDA work runs inside a one-thread region (where parallel_for and
// OpenBLAS stay on the calling thread). MLA over a long cache keeps all threads.
constexpr int64_t kSerialRows = 16;
template <class Fn>
void serial_if(bool serial, Fn&& f) {
  if (!serial || omp_in_parallel()) return f();
  std::exception_ptr err;
#pragma omp parallel num_threads(1)
  {
    try {
      f();
    } catch (...) {
      err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

// Appends `add` rows of `width` floats to a latent cache, growing the capacity by at least 1/16 (and
// 1024 rows) so a decode does not copy the cache per token nor double its footprint.
void grow(std::vector<float>& v, int64_t add_rows, int64_t width) {
  const size_t need = v.size() + static_cast<size_t>(add_rows * width);
  if (need <= v.capacity()) return;
  const size_t step = std::max<size_t>(v.capacity() / 16, static_cast<size_t>(1024 * width));
  v.reserve(std::max(need, v.capacity() + step));
}

}  // namespace

// ---- Sequence -----------------------------------------------------------------------------------------

int64_t Sequence::cache_bytes() const {
  int64_t n = 0;
  for (const auto& v : kda_state) n += static_cast<int64_t>(v.size());
  for (const auto& v : kda_conv) n += static_cast<int64_t>(v.size());
  for (const auto& v : mla) n += static_cast<int64_t>(v.size());
  return n * 4;
}

int64_t Sequence::cache_capacity_bytes() const {
  int64_t n = 0;
  for (const auto& v : kda_state) n += static_cast<int64_t>(v.capacity());
  for (const auto& v : kda_conv) n += static_cast<int64_t>(v.capacity());
  for (const auto& v : mla) n += static_cast<int64_t>(v.capacity());
  return n * 4 + static_cast<int64_t>(tokens.capacity() * sizeof(int32_t));
}

uint64_t hash_tokens(std::span<const int32_t> t) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t x : t) {
    h ^= static_cast<uint32_t>(x);
    h *= 1099511628211ull;
  }
  return h;
}

// ---- Session setup --------------------------------------------------------------------------------------

Session::Session(model::Model<float>& m, SessionOptions o) : m_(m), cfg_(m.config()), opt_(o) {
  LM_CHECK(opt_.prefill_chunk >= 1, "session: prefill chunk {} must be >= 1", opt_.prefill_chunk);
  LM_CHECK(opt_.prefix_cache_bytes >= 0, "session: prefix cache budget must not be negative");
  max_ctx_ = opt_.max_context > 0 ? opt_.max_context : cfg_.max_position_embeddings.value_or(131072);
  const int64_t L = cfg_.num_hidden_layers;
  auto& ps = m_.params();
  int64_t nk = 0, nm = 0;
  for (int64_t i = 0; i < L; ++i) {
    kda_slot_.push_back(cfg_.is_kda(i) ? nk++ : -1);
    mla_slot_.push_back(cfg_.is_kda(i) ? -1 : nm++);
    const std::string P = "model.layers." + std::to_string(i);
    ln1_.push_back(ps.w(P + ".input_layernorm.weight"));
    ln2_.push_back(ps.w(P + ".post_attention_layernorm.weight"));
    if (cfg_.has_attn_res()) {
      attn_w_.push_back(ps.w(P + ".self_attention_res_proj.weight"));
      attn_g_.push_back(ps.w(P + ".self_attention_res_norm.weight"));
      mlp_w_.push_back(ps.w(P + ".mlp_res_proj.weight"));
      mlp_g_.push_back(ps.w(P + ".mlp_res_norm.weight"));
    }
  }
  embed_ = ps.w("model.embed_tokens.weight");
  lm_head_ = ps.w("lm_head.weight");
  final_norm_ = ps.w("model.norm.weight");
  if (cfg_.has_attn_res()) {
    out_w_ = ps.w("model.output_attn_res_proj.weight");
    out_g_ = ps.w("model.output_attn_res_norm.weight");
    const int64_t bs = *cfg_.attn_res_block_size, d = cfg_.hidden_size;
    for (int64_t i0 = 0; i0 < L; i0 += bs) {
      const int64_t i1 = std::min(L, i0 + bs);
      BlockReads br;
      auto add = [&](const float* w, const float* g) {
        br.w.insert(br.w.end(), w, w + d);
        br.g.insert(br.g.end(), g, g + d);
        ++br.Q;
      };
      add(mlp_w_[i0], mlp_g_[i0]);
      for (int64_t i = i0 + 1; i < i1; ++i) add(attn_w_[i], attn_g_[i]), add(mlp_w_[i], mlp_g_[i]);
      if (i1 == L) add(out_w_, out_g_);
      blocks_.push_back(std::move(br));
    }
  }
}

Sequence Session::new_sequence() const {
  Sequence s;
  const int64_t HK = cfg_.kda_key_dim(), K = cfg_.kda_head_dim, W = cfg_.kda_conv_kernel;
  s.kda_state.assign(cfg_.num_kda_layers(), Buf(static_cast<size_t>(HK * K), 0.0f));
  s.kda_conv.assign(cfg_.num_kda_layers(), Buf(static_cast<size_t>(3 * HK * (W - 1)), 0.0f));
  s.mla.assign(cfg_.num_mla_layers(), Buf());
  return s;
}

void Session::check_ids(std::span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i)
    LM_CHECK(ids[i] >= 0 && ids[i] < cfg_.vocab_size, "token id {} at position {} is outside the vocabulary [0, {})",
             ids[i], i, cfg_.vocab_size);
}

// ---- the walk over the layers -----------------------------------------------------------------------------

void Session::walk(const std::vector<Sequence*>& seqs, const int32_t* ids, int64_t rows, bool decode, float* hn) {
  const int64_t d = cfg_.hidden_size, L = cfg_.num_hidden_layers, V = cfg_.vocab_size, nd = rows * d;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  Buf a(nd), f(nd), xn(nd), x(nd);
  Buf prefix(nd);
  {
    Timer t(profile.other);
    ops::embedding_forward(ids, rows, embed_, V, d, prefix.data());
  }
  const model::Seqs seqs_rows = model::Seqs::batch(1, rows);
  auto mixer = [&](int64_t i, const float* in, float* out) {
    if (kda_slot_[i] >= 0) {
      Timer t(profile.kda);
      if (decode) serial_if(rows <= kSerialRows, [&] { kda_decode(i, seqs, in, out); });
      else kda_prefill(i, *seqs[0], in, rows, out);
    } else {
      Timer t(profile.mla);
      if (decode) mla_decode(i, seqs, in, out);
      else mla_prefill(i, *seqs[0], in, rows, out);
    }
  };
  auto ffn = [&](int64_t i, const float* in, float* out) {
    Timer t(profile.ffn);
    auto run = [&] {
      if (auto* moe = m_.moe(i)) moe->forward(in, out, seqs_rows);
      else m_.dense(i)->forward(in, out, seqs_rows);
    };
    serial_if(decode && rows <= kSerialRows, run);
  };
  auto norm = [&](const float* in, const float* w, float* out) {
    Timer t(profile.other);
    ops::rmsnorm_forward(in, w, out, static_cast<float*>(nullptr), rows, d, eps);
  };
  if (!cfg_.has_attn_res()) {
    for (int64_t i = 0; i < L; ++i) {
      norm(prefix.data(), ln1_[i], xn.data());
      mixer(i, xn.data(), a.data());
      add_into(prefix.data(), a.data(), nd);
      norm(prefix.data(), ln2_[i], xn.data());
      ffn(i, xn.data(), f.data());
      add_into(prefix.data(), f.data(), nd);
    }
    norm(prefix.data(), final_norm_, hn);
    return;
  }
  // Block AttnRes: closed sources (embedding first), the partial sum `prefix`, and per block the phase-1
  // state (m, l, acc) of all reads that share the block's closed sources.
  const int64_t bs = *cfg_.attn_res_block_size;
  std::vector<Buf> closed;
  std::vector<const float*> src;
  Buf m1, l1, acc1;
  int64_t read = 0;  // next read of the current block
  const BlockReads* br = nullptr;
  auto phase2 = [&](const float* w, const float* g, float* out) {
    Timer t(profile.attnres);
    const float* v = prefix.data();
    ops::attnres_phase2(m1.data() + read * rows, l1.data() + read * rows, acc1.data() + read * nd, &v, 1, rows, d, w, g,
                        eps, out);
    ++read;
  };
  for (int64_t i = 0; i < L; ++i) {
    const bool first = i % bs == 0;
    const float* xin = x.data();
    if (first) {
      Timer t(profile.attnres);
      if (closed.empty()) {
        xin = prefix.data();
      } else {
        src.clear();
        for (const auto& b : closed) src.push_back(b.data());
        src.push_back(prefix.data());
        ops::attnres_forward(src.data(), static_cast<int64_t>(src.size()), rows, d, attn_w_[i], attn_g_[i], eps,
                             x.data());
      }
      norm(xin, ln1_[i], xn.data());  // before the push: xin may be `prefix`
      closed.push_back(prefix);
      br = &blocks_[static_cast<size_t>(i / bs)];
      src.clear();
      for (const auto& b : closed) src.push_back(b.data());
      m1.resize(br->Q * rows), l1.resize(br->Q * rows), acc1.resize(br->Q * nd);
      ops::attnres_phase1(src.data(), static_cast<int64_t>(src.size()), rows, d, br->w.data(), br->g.data(), br->Q,
                          eps, m1.data(), l1.data(), acc1.data());
      read = 0;
    } else {
      phase2(attn_w_[i], attn_g_[i], x.data());
      norm(x.data(), ln1_[i], xn.data());
    }
    mixer(i, xn.data(), a.data());
    if (first) std::copy(a.begin(), a.end(), prefix.begin());
    else add_into(prefix.data(), a.data(), nd);
    phase2(mlp_w_[i], mlp_g_[i], x.data());
    norm(x.data(), ln2_[i], xn.data());
    ffn(i, xn.data(), f.data());
    add_into(prefix.data(), f.data(), nd);
  }
  phase2(out_w_, out_g_, x.data());
  LM_CHECK(read == br->Q, "session: AttnRes read count {} != {} (internal)", read, br->Q);
  norm(x.data(), final_norm_, hn);
}

// ---- KDA (SPEC §2) ----------------------------------------------------------------------------------------

namespace {
// The projections shared by prefill and decode: q, k, v pre-conv, the forget-gate input f, β logits and
// the output gate.
struct KdaProj {
  Buf qp, kp, vp, f, braw, go;
};
void kda_project(model::KdaMixer<float>& k, const model::ModelConfig& c, const float* x, int64_t rows, KdaProj& p) {
  const int64_t d = c.hidden_size, HK = c.kda_key_dim(), H = c.kda_num_heads, K = c.kda_head_dim;
  for (Buf* b : {&p.qp, &p.kp, &p.vp, &p.f, &p.go}) b->resize(rows * HK);
  p.braw.resize(rows * H);
  Buf fa(rows * K);
  linear_forward(x, k.Wq->w(), p.qp.data(), rows, d, HK);
  linear_forward(x, k.Wk->w(), p.kp.data(), rows, d, HK);
  linear_forward(x, k.Wv->w(), p.vp.data(), rows, d, HK);
  linear_forward(x, k.Wfa->w(), fa.data(), rows, d, K);
  linear_forward(fa.data(), k.Wfb->w(), p.f.data(), rows, K, HK);
  linear_forward(x, k.Wb->w(), p.braw.data(), rows, d, H);
  if (k.Wg) {
    linear_forward(x, k.Wg->w(), p.go.data(), rows, d, HK);
  } else {
    Buf ga(rows * K);
    linear_forward(x, k.Wga->w(), ga.data(), rows, d, K);
    linear_forward(ga.data(), k.Wgb->w(), p.go.data(), rows, K, HK);
  }
}
// y = W_o [RMSNorm_head(o) ⊙ σ(gate)]
void kda_out(model::KdaMixer<float>& k, const model::ModelConfig& c, const float* o, const float* go, int64_t rows,
             float* y) {
  const int64_t d = c.hidden_size, HK = c.kda_key_dim(), H = c.kda_num_heads, K = c.kda_head_dim;
  Buf on(rows * HK), rstd(rows * H);
  ops::rmsnorm_gated_forward(o, go, k.onorm->w(), on.data(), rstd.data(), rows * H, K,
                             static_cast<float>(c.rms_norm_eps));
  linear_forward(on.data(), k.Wo->w(), y, rows, HK, d);
}
}  // namespace

void Session::kda_prefill(int64_t layer, Sequence& s, const float* x, int64_t n, float* y) {
  auto& k = *m_.kda(layer);
  const int64_t HK = cfg_.kda_key_dim(), H = cfg_.kda_num_heads, K = cfg_.kda_head_dim, W = cfg_.kda_conv_kernel;
  const int64_t slot = kda_slot_[layer];
  KdaProj p;
  kda_project(k, cfg_, x, n, p);
  // Short convs continue from the cached last W-1 inputs, which then move on to this chunk's last ones.
  Buf qc(n * HK), kc(n * HK), vc(n * HK);
  float* conv = s.kda_conv[slot].data();
  const kda::ConvDims cd{1, n, HK, W};
  const Buf* pre[3] = {&p.qp, &p.kp, &p.vp};
  Buf* post[3] = {&qc, &kc, &vc};
  const model::Param<float>* cw[3] = {k.Cq, k.Ck, k.Cv};
  for (int j = 0; j < 3; ++j) {
    float* cache = conv + j * HK * (W - 1);
    kda::short_conv_forward<float>(pre[j]->data(), cw[j]->w(), cache, post[j]->data(), cd, true);
    kda::short_conv_final_cache<float>(pre[j]->data(), cache, cache, cd);
  }
  kda::FusedInputs<float> in;
  in.q = qc.data(), in.k = kc.data(), in.v = vc.data(), in.g_raw = p.f.data(), in.beta_raw = p.braw.data();
  in.A_log = k.A_log->w(), in.dt_bias = k.dt_bias->w(), in.scale = k.scale(), in.gate = k.gate();
  Buf& state = s.kda_state[slot];
  in.h0 = state.data();
  Buf o(n * HK), ht(state.size());
  kda::fused_forward(in, kda::Dims{1, n, H, K, K}, o.data(), ht.data(), kda::CorePath::Chunked, kda::DiagPath::Auto);
  state.swap(ht);
  kda_out(k, cfg_, o.data(), p.go.data(), n, y);
}

void Session::kda_decode(int64_t layer, const std::vector<Sequence*>& seqs, const float* x, float* y) {
  auto& k = *m_.kda(layer);
  const int64_t HK = cfg_.kda_key_dim(), H = cfg_.kda_num_heads, K = cfg_.kda_head_dim, W = cfg_.kda_conv_kernel;
  const int64_t S = static_cast<int64_t>(seqs.size()), slot = kda_slot_[layer];
  KdaProj p;
  kda_project(k, cfg_, x, S, p);
  Buf qc(S * HK), kc(S * HK), vc(S * HK);
  const Buf* pre[3] = {&p.qp, &p.kp, &p.vp};
  Buf* post[3] = {&qc, &kc, &vc};
  const model::Param<float>* cw[3] = {k.Cq, k.Ck, k.Cv};
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < 3; ++j)
      kda::short_conv_step<float>(pre[j]->data() + s * HK, cw[j]->w(),
                                  seqs[s]->kda_conv[slot].data() + j * HK * (W - 1), post[j]->data() + s * HK, 1, HK,
                                  W, true);
  // The operator's own preprocessing (as fused_forward does), then one recurrent step per (sequence, head).
  Buf qn(S * HK), kn(S * HK), g(S * HK), beta(S * H), o(S * HK);
  kda::l2norm_forward<float>(qc.data(), qn.data(), S * H, K);
  kda::l2norm_forward<float>(kc.data(), kn.data(), S * H, K);
  kda::sigmoid_forward<float>(p.braw.data(), beta.data(), S * H);
  kda::gate_forward<float>(p.f.data(), k.A_log->w(), k.dt_bias->w(), g.data(), S, H, K, k.gate());
  const float scale = k.scale();
  parallel_for(
      S * H,
      [&](int64_t sh) {
        const int64_t s = sh / H, h = sh % H, off = sh * K;
        kda::decode_step<float>(seqs[s]->kda_state[slot].data() + h * K * K, qn.data() + off, kn.data() + off,
                                vc.data() + off, g.data() + off, beta.data() + sh, o.data() + off, 1, 1, K, K, scale);
      },
      std::max<int64_t>(1, (1 << 14) / (K * K)));
  kda_out(k, cfg_, o.data(), p.go.data(), S, y);
}

// ---- MLA (SPEC §3) ----------------------------------------------------------------------------------------

namespace {
// [RMSNorm_kv(c) ; k_r] of `rows` tokens into dst rows with stride RD.
void mla_latent(model::GatedMla<float>& m, const model::ModelConfig& c, const float* x, int64_t rows, float* dst) {
  const int64_t d = c.hidden_size, R = c.kv_lora_rank, RD = c.mla_cache_dim();
  Buf ckr(rows * RD);
  linear_forward(x, m.Wkva->w(), ckr.data(), rows, d, RD);
  ops::rmsnorm_forward(ckr.data(), m.kva_norm->w(), dst, static_cast<float*>(nullptr), rows, R, kLoraEps, RD, RD);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(&ckr[r * RD + R], RD - R, dst + r * RD + R);
}
}  // namespace

void Session::mla_queries(int64_t layer, const float* x, int64_t rows, float* qa) {
  auto& m = *m_.mla(layer);
  const int64_t d = cfg_.hidden_size, Hm = cfg_.num_attention_heads, Dn = cfg_.qk_nope_head_dim,
                Dr = cfg_.qk_rope_head_dim, Dv = cfg_.v_head_dim, Dq = Dn + Dr, R = cfg_.kv_lora_rank, RD = R + Dr;
  Buf q(rows * Hm * Dq);
  if (cfg_.has_q_lora()) {
    const int64_t Q = *cfg_.q_lora_rank;
    Buf qa_(rows * Q);
    linear_forward(x, m.Wqa->w(), qa_.data(), rows, d, Q);
    ops::rmsnorm_forward(qa_.data(), m.qa_norm->w(), qa_.data(), static_cast<float*>(nullptr), rows, Q, kLoraEps);
    linear_forward(qa_.data(), m.Wqb->w(), q.data(), rows, Q, Hm * Dq);
  } else {
    linear_forward(x, m.Wq->w(), q.data(), rows, d, Hm * Dq);
  }
  // q̃_h = W_UK,hᵀ q_nope,h (Dn -> R); q_rope is used as is (NoPE: no rotation).
  const float* Wkvb = m.Wkvb->w();
  for (int64_t h = 0; h < Hm; ++h)
    ops::gemm(false, false, rows, R, Dn, 1.0f, q.data() + h * Dq, Hm * Dq, Wkvb + h * (Dn + Dv) * R, R, 0.0f,
              qa + h * RD, Hm * RD);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < Hm; ++h) std::copy_n(&q[(r * Hm + h) * Dq + Dn], Dr, qa + (r * Hm + h) * RD + R);
}

void Session::mla_output(int64_t layer, const float* x, const float* o_lat, int64_t rows, float* y) {
  auto& m = *m_.mla(layer);
  const int64_t d = cfg_.hidden_size, Hm = cfg_.num_attention_heads, Dn = cfg_.qk_nope_head_dim, Dv = cfg_.v_head_dim,
                R = cfg_.kv_lora_rank, HV = Hm * Dv;
  // o_h = W_UV,h ō_h (R -> Dv), then the gate (between W_UV and W_o, so they cannot be merged) and W_o.
  Buf o(rows * HV);
  const float* Wkvb = m.Wkvb->w();
  for (int64_t h = 0; h < Hm; ++h)
    ops::gemm(false, true, rows, Dv, R, 1.0f, o_lat + h * R, Hm * R, Wkvb + (h * (Dn + Dv) + Dn) * R, R, 0.0f,
              o.data() + h * Dv, HV);
  if (m.Wg) {
    Buf graw(rows * HV);
    linear_forward(x, m.Wg->w(), graw.data(), rows, d, HV);
    for (int64_t i = 0; i < rows * HV; ++i) o[i] *= sigmoid(graw[i]);
  }
  linear_forward(o.data(), m.Wo->w(), y, rows, HV, d);
}

void Session::mla_prefill(int64_t layer, Sequence& s, const float* x, int64_t n, float* y) {
  auto& m = *m_.mla(layer);
  const int64_t Hm = cfg_.num_attention_heads, R = cfg_.kv_lora_rank, RD = cfg_.mla_cache_dim(), Dr = RD - R;
  Buf& cache = s.mla[mla_slot_[layer]];
  const int64_t p = static_cast<int64_t>(cache.size()) / RD;
  grow(cache, n, RD);
  cache.resize((p + n) * RD);
  mla_latent(m, cfg_, x, n, cache.data() + p * RD);
  Buf qa(n * Hm * RD), o_lat(n * Hm * R);
  mla_queries(layer, x, n, qa.data());
  mla_prefill_attention(qa.data(), cache.data(), p, n, Hm, R, Dr, m.scale(), o_lat.data());
  mla_output(layer, x, o_lat.data(), n, y);
}

void Session::mla_decode(int64_t layer, const std::vector<Sequence*>& seqs, const float* x, float* y) {
  auto& m = *m_.mla(layer);
  const int64_t Hm = cfg_.num_attention_heads, R = cfg_.kv_lora_rank, RD = cfg_.mla_cache_dim(), Dr = RD - R;
  const int64_t S = static_cast<int64_t>(seqs.size()), slot = mla_slot_[layer];
  Buf lat(S * RD);
  mla_latent(m, cfg_, x, S, lat.data());
  Buf qa(S * Hm * RD), o_lat(S * Hm * R), ql(Hm * R), qr(Hm * Dr);
  mla_queries(layer, x, S, qa.data());
  for (int64_t s = 0; s < S; ++s) {
    Buf& cache = seqs[s]->mla[slot];
    grow(cache, 1, RD);
    cache.insert(cache.end(), lat.begin() + s * RD, lat.begin() + (s + 1) * RD);
    for (int64_t h = 0; h < Hm; ++h) {
      const float* q = qa.data() + (s * Hm + h) * RD;
      std::copy_n(q, R, ql.data() + h * R);
      std::copy_n(q + R, Dr, qr.data() + h * Dr);
    }
    ops::DecodeDims dd;
    dd.H = Hm, dd.Tc = static_cast<int64_t>(cache.size()) / RD, dd.R = R, dd.Dr = Dr, dd.ldc = RD, dd.ldkr = RD;
    ops::mla_decode_absorbed(ql.data(), Dr ? qr.data() : nullptr, cache.data(), Dr ? cache.data() + R : nullptr,
                             o_lat.data() + s * Hm * R, static_cast<float*>(nullptr), dd, m.scale());
  }
  mla_output(layer, x, o_lat.data(), S, y);
}

void mla_prefill_attention(const float* qa, const float* cache, int64_t p, int64_t n, int64_t Hm, int64_t R,
                           int64_t Dr, float scale, float* o_lat) {
  const int64_t RD = R + Dr;
  const int64_t bt = std::max<int64_t>(1, 128 / Hm);  // tokens per query tile: about 128 (token, head) rows
  constexpr int64_t bk = 128;                          // keys per tile
  const int64_t ntiles = (n + bt - 1) / bt;
  parallel_for_dynamic(ntiles, [&](int64_t it) {
    const int64_t t0 = it * bt, nt = std::min(bt, n - t0), M = nt * Hm;
    thread_local Buf S, acc, mx, l;
    S.resize(M * bk), acc.assign(M * R, 0.0f), mx.assign(M, -std::numeric_limits<float>::infinity()),
        l.assign(M, 0.0f);
    const float* Q = qa + t0 * Hm * RD;  // rows (t, h): [M, RD]
    const int64_t kend = p + t0 + nt;    // keys visible to the tile's last token
    for (int64_t k0 = 0; k0 < kend; k0 += bk) {
      const int64_t nk = std::min(bk, kend - k0);
      ops::gemm(false, true, M, nk, RD, scale, Q, RD, cache + k0 * RD, RD, 0.0f, S.data(), nk);
      for (int64_t r = 0; r < M; ++r) {
        float* sr = S.data() + r * nk;
        const int64_t valid = std::clamp<int64_t>(p + t0 + r / Hm + 1 - k0, 0, nk);  // causal
        if (valid == 0) {
          std::fill(sr, sr + nk, 0.0f);
          continue;
        }
        float m_new = mx[r];
        for (int64_t c = 0; c < valid; ++c) m_new = std::max(m_new, sr[c]);
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < valid; ++c) {
          const float e = exp_approx(sr[c] - m_new);
          sr[c] = e;
          sum += e;
        }
        std::fill(sr + valid, sr + nk, 0.0f);
        const float alpha = exp_approx(mx[r] - m_new);  // 0 for the first tile (m = -inf)
        l[r] = l[r] * alpha + sum;
        mx[r] = m_new;
        if (alpha != 1.0f) {
          float* ar = acc.data() + r * R;
#pragma omp simd
          for (int64_t e = 0; e < R; ++e) ar[e] *= alpha;
        }
      }
      ops::gemm(false, false, M, R, nk, 1.0f, S.data(), nk, cache + k0 * RD, RD, 1.0f, acc.data(), R);
    }
    for (int64_t r = 0; r < M; ++r) {
      const float inv = 1.0f / l[r];
      float* out = o_lat + (t0 * Hm + r) * R;
      for (int64_t e = 0; e < R; ++e) out[e] = acc[r * R + e] * inv;
    }
  });
}

// ---- prefill / decode -------------------------------------------------------------------------------------

std::vector<float> Session::prefill(Sequence& seq, std::span<const int32_t> tokens, std::vector<float>* all_logits,
                                    bool store) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(n >= 1, "prefill: no tokens");
  check_ids(tokens);
  LM_CHECK(seq.pos() + n <= max_ctx_, "prompt of {} tokens (after {} cached) exceeds the context limit of {} tokens", n,
           seq.pos(), max_ctx_);
  LM_CHECK(static_cast<int64_t>(seq.kda_state.size()) == cfg_.num_kda_layers() &&
               static_cast<int64_t>(seq.mla.size()) == cfg_.num_mla_layers(),
           "prefill: sequence does not belong to this model");
  int64_t off = 0;
  if (seq.pos() == 0 && !all_logits && opt_.prefix_cache_bytes > 0) {
    if (Snapshot snap = lookup_prefix(tokens, n - 1)) {
      seq = resume(snap);
      off = snap->pos();
    }
  }
  if (all_logits) all_logits->resize(static_cast<size_t>(n * V));
  if (seq.pos() % opt_.prefill_chunk != 0) seq.on_grid = false;
  const int64_t RD = cfg_.mla_cache_dim(), end = seq.pos() + (n - off);
  for (auto& c : seq.mla) c.reserve(static_cast<size_t>(std::max<int64_t>(end * RD, c.capacity())));
  // The snapshot worth keeping is the last grid point of this prompt (a later prompt that extends it
  // resumes there); earlier grid points would cost O(T) each.
  const int64_t Cp = opt_.prefill_chunk, snap_at = end / Cp * Cp;
  std::vector<float> last(static_cast<size_t>(V));
  Buf hn;
  std::vector<Sequence*> one{&seq};
  while (off < n) {
    const int64_t p = seq.pos(), stop = std::min(end, (p / Cp + 1) * Cp), c = stop - p;
    hn.resize(static_cast<size_t>(c * d));
    walk(one, tokens.data() + off, c, false, hn.data());
    seq.tokens.insert(seq.tokens.end(), tokens.begin() + off, tokens.begin() + off + c);
    if (all_logits) {
      Timer t(profile.other);
      ops::lm_head_logits(hn.data(), lm_head_, c, d, V, all_logits->data() + off * V);
    }
    off += c;
    if (off == n) {
      Timer t(profile.other);
      ops::lm_head_logits(hn.data() + (c - 1) * d, lm_head_, 1, d, V, last.data());
    }
    if (store && seq.on_grid && opt_.prefix_cache_bytes > 0 && stop == snap_at && snap_at > 0) store_prefix(seq);
  }
  return last;
}

std::vector<float> Session::decode(const std::vector<Sequence*>& seqs, std::span<const int32_t> tokens) {
  const int64_t S = static_cast<int64_t>(seqs.size()), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(S >= 1 && static_cast<int64_t>(tokens.size()) == S, "decode: {} tokens for {} sequences", tokens.size(), S);
  check_ids(tokens);
  for (int64_t s = 0; s < S; ++s) {
    LM_CHECK(seqs[s] && seqs[s]->pos() + 1 <= max_ctx_, "decode: sequence {} is at the context limit of {} tokens", s,
             max_ctx_);
    LM_CHECK(static_cast<int64_t>(seqs[s]->mla.size()) == cfg_.num_mla_layers() &&
                 static_cast<int64_t>(seqs[s]->kda_state.size()) == cfg_.num_kda_layers(),
             "decode: sequence {} does not belong to this model", s);
    for (int64_t t = 0; t < s; ++t) LM_CHECK(seqs[t] != seqs[s], "decode: sequence {} appears twice", s);
  }
  Buf hn(static_cast<size_t>(S * d));
  walk(seqs, tokens.data(), S, true, hn.data());
  for (int64_t s = 0; s < S; ++s) seqs[s]->tokens.push_back(tokens[s]), seqs[s]->on_grid = false;
  std::vector<float> logits(static_cast<size_t>(S * V));
  Timer t(profile.other);
  ops::lm_head_logits(hn.data(), lm_head_, S, d, V, logits.data());
  return logits;
}

// ---- snapshots and the prefix cache -----------------------------------------------------------------------

Snapshot Session::snapshot(const Sequence& seq) {
  auto s = std::make_shared<Sequence>();
  s->tokens = seq.tokens;
  s->kda_state = seq.kda_state;
  s->kda_conv = seq.kda_conv;
  s->mla.reserve(seq.mla.size());
  for (const auto& c : seq.mla) s->mla.emplace_back(c.begin(), c.end());  // exact size, no spare capacity
  return s;
}

Sequence Session::resume(const Snapshot& s) {
  LM_CHECK(s != nullptr, "resume: null snapshot");
  return Sequence(*s);
}

void Session::store_prefix(const Sequence& s) {
  const uint64_t key = hash_tokens(s.tokens);
  if (auto it = index_.find(key); it != index_.end()) {
    if (it->second->second.snap->tokens == s.tokens) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return;
    }
    cache_bytes_ -= it->second->second.bytes;  // hash collision: the newer prefix replaces it
    lru_.erase(it->second);
    index_.erase(it);
  }
  Snapshot snap = snapshot(s);
  const int64_t bytes = snap->cache_bytes() + static_cast<int64_t>(snap->tokens.size() * sizeof(int32_t));
  if (bytes > opt_.prefix_cache_bytes) return;
  while (cache_bytes_ + bytes > opt_.prefix_cache_bytes && !lru_.empty()) {
    cache_bytes_ -= lru_.back().second.bytes;
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  lru_.emplace_front(key, Entry{std::move(snap), bytes});
  index_[key] = lru_.begin();
  cache_bytes_ += bytes;
}

Snapshot Session::lookup_prefix(std::span<const int32_t> tokens, int64_t max_len) {
  const int64_t Cp = opt_.prefill_chunk;
  max_len = std::min<int64_t>(max_len, static_cast<int64_t>(tokens.size()));
  if (lru_.empty() || max_len < Cp) {
    ++stats_.misses;
    return nullptr;
  }
  // Prefix hashes at every grid point, then the longest stored one that matches token for token.
  std::vector<uint64_t> h;
  uint64_t acc = 1469598103934665603ull;
  for (int64_t i = 0; i < max_len / Cp * Cp; ++i) {
    acc ^= static_cast<uint32_t>(tokens[static_cast<size_t>(i)]);
    acc *= 1099511628211ull;
    if ((i + 1) % Cp == 0) h.push_back(acc);
  }
  for (int64_t g = static_cast<int64_t>(h.size()); g >= 1; --g) {
    auto it = index_.find(h[static_cast<size_t>(g - 1)]);
    if (it == index_.end()) continue;
    const Snapshot& snap = it->second->second.snap;
    if (snap->pos() == g * Cp && std::equal(snap->tokens.begin(), snap->tokens.end(), tokens.begin())) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++stats_.hits;
      stats_.tokens_reused += snap->pos();
      return snap;
    }
  }
  ++stats_.misses;
  return nullptr;
}

Session::PrefixStats Session::prefix_stats() const {
  PrefixStats s = stats_;
  s.entries = static_cast<int64_t>(lru_.size());
  s.bytes = cache_bytes_;
  return s;
}

void Session::clear_prefix_cache() {
  lru_.clear();
  index_.clear();
  cache_bytes_ = 0;
}

}  // namespace lm::infer

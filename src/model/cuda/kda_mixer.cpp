// The KDA mixer on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU layer is model/kda_mixer.cpp): the fused
// input projection, short convs + SiLU, the gate's low-rank product, the KDA operator on the `core` stream beside
// the output gate's projections, the per-head gated RMSNorm and the output projection; and their backward.
//
// Legend: n = rows tokens, d hidden, H heads, K = V head dim (Kd), HK = H·K, LF = kda_in_ld() >= 3·HK + K + H.
//   qkvp = xn [W_q; W_k; W_v; W_fa; W_b; 0]ᵀ   [n, LF]  (columns: qp, kp, vp [HK] each, f_a [K], braw [H], zeros)
//   qc, kc, vc = silu(conv(qp | kp | vp))        [n, HK]
//   f = f_a W_fbᵀ                                [n, HK]  raw gate input
//   gate_o = xn W_gᵀ  or  (xn W_gaᵀ = ga) W_gbᵀ  [n, HK]
//   o = KDA(qc, kc, vc, f, braw)                 [n, H, K]   (saved: the operator's kept tensors, training)
//   on = RMSNorm_head(o) ⊙ σ(gate_o) (orstd [n, H]);  y = base + on W_oᵀ  fp32 [n, d]
// Inference (InferState): prefill (one fresh sequence, n tokens) runs the same forward and leaves the last W-1 conv
// inputs and the final state in the slot's cache; decode (n = S slots, one token each) takes the conv step and the
// recurrent KDA step over the caches instead of the chunked operator.
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <cstdlib>
#include <optional>
#include <utility>

#include "core/env.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::model::cuda {

// The operator's problem for this batch (β_raw and its gradient strided inside the fused projection's rows).
kc::Problem GpuModel::Impl::kda_problem() const {
  kc::Problem p;
  p.B = seqs.B, p.T = seqs.T, p.H = c.kda_num_heads, p.K = c.kda_head_dim, p.V = c.kda_head_dim;
  if (!seqs.cu.empty()) p.cu_seqlens = seqs.cu.data(), p.N = seqs.num_seqs();
  if (c.kda_gate_lower_bound) p.gate = kda::GateParams{kda::GateForm::LowerBound, *c.kda_gate_lower_bound};
  else p.gate = kda::GateParams{kda::GateForm::Softplus, 0.0};
  p.gate_dtype = kc::GateDType::BF16;
  p.beta_ld = kda_in_ld();  // beta_raw and its gradient live in the fused input projection's rows
  return p;
}
kc::ConvShape GpuModel::Impl::conv_shape(int64_t C, int64_t ldx) const {
  kc::ConvShape s;
  s.B = seqs.B, s.T = seqs.T, s.C = C, s.W = c.kda_conv_kernel, s.ldx = ldx;
  if (!seqs.cu.empty()) s.cu_seqlens = seqs.cu.data(), s.N = seqs.num_seqs();
  return s;
}

// y [rows, d] fp32 = base + mixer(xn) (base null: y = mixer(xn); base == y: in place).
void GpuModel::Impl::kda_forward(int64_t i, const void* xn, float* y, const float* base) {
  const int64_t H = c.kda_num_heads, Kd = c.kda_head_dim, HK = H * Kd, n = rows;
  const std::string A = P_(i) + ".self_attn.";
  KdaActs& a = layer_acts(i).kda;
  auto bf = [&](DBuf& b, int64_t w) { return grow(b, size_t(n) * w * 2); };
  // qkvp [n, LF]: the q, k, v (before their convolutions), f_a and β_raw projections side by side (their
  // weights are one matrix, see layout())
  const int64_t LF = kda_in_ld();
  void *qkvp = bf(a.qkvp, LF), *qc = bf(a.qc, HK), *kc_ = bf(a.kc, HK), *vc = bf(a.vc, HK), *f = bf(a.f, HK),
       *go = bf(a.gate_o, HK), *o = bf(a.o, HK), *on = bf(a.on, HK);
  float* orstd = grow<float>(a.orstd, size_t(n) * H * 4);
  std::optional<Timed> sec(std::in_place, section("kda.proj.fwd"));
  oc::linear_fwd(xn, kda_in_weight(i), qkvp, DType::BF16, n, d, LF, false, nullptr, 0, LF);
  sec.emplace(section("kda.conv.fwd"));
  const kc::ConvShape cs = conv_shape(HK, LF);
  auto* pre = static_cast<const uint16_t*>(qkvp);
  const uint16_t *fa = pre + 3 * HK, *braw = fa + Kd;
  // Inference: the slot caches of model::KdaMixer::cache_spec, conv [3, HK, W-1] and S [H, K, K] per slot.
  using Mode = InferState::Mode;
  const int64_t taps = c.kda_conv_kernel, conv_ld = 3 * HK * (taps - 1);
  float* conv = inf.mode == Mode::Off ? nullptr : as<float>(inf.conv[i].p) + inf.first * conv_ld;
  float* state = inf.mode == Mode::Off ? nullptr : as<float>(inf.state[i].p) + inf.first * H * Kd * Kd;
  void* post[3] = {qc, kc_, vc};
  const char* conv_w[3] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
  const bool cont = inf.mode == Mode::Prefill && inf.start > 0;  // a chunk continuing a cached sequence
  if (inf.mode == Mode::Decode) {  // (q, k, v in one launch)
    const float* w3[3] = {M(A + conv_w[0]), M(A + conv_w[1]), M(A + conv_w[2])};
    kc::short_conv_step3(pre, LF, w3, conv, conv_ld, post, n, HK, taps);
  } else {
    for (int j = 0; j < 3; ++j) {
      if (cont) {  // from the cached inputs, which then move on by the chunk
        kc::short_conv_forward_cached(pre + j * HK, LF, M(A + conv_w[j]), conv + j * HK * (taps - 1), post[j], n,
                                      HK, taps);
        kc::short_conv_cache_append(pre + j * HK, LF, n, conv + j * HK * (taps - 1), HK, taps);
      } else {
        kc::short_conv_forward(pre + j * HK, M(A + conv_w[j]), post[j], cs);  // (a prefill starts from zeros)
        if (conv) kc::short_conv_cache(pre + j * HK, LF, n, conv + j * HK * (taps - 1), HK, taps);
      }
    }
  }
  sec.emplace(section("kda.proj.fwd"));
  oc::linear_fwd(fa, W(A + "f_b_proj.weight"), f, DType::BF16, n, Kd, HK, false, nullptr, LF);
  kc::Inputs in;
  in.q = qc, in.k = kc_, in.v = vc, in.g_raw = f, in.beta_raw = braw;
  in.A_log = M(A + "A_log"), in.dt_bias = M(A + "dt_bias");
  sec.emplace(section("kda.core.fwd"));
  static const bool save_on = env::kda_save();
  if (kda_saved.size() != size_t(L)) kda_saved.assign(size_t(L), nullptr);
  const kc::Problem kp = kda_problem();
  // Every training forward keeps them (a recomputed layer's into the shared set): its output is then the one the
  // recompute will give, since the saving forward computes o with the backward's products.
  const size_t kb = training && save_on ? kc::saved_bytes(kp) : 0;
  kda_saved[i] = kb ? grow(a.saved, kb) : nullptr;
  fork();  // the core on its stream; the output gate's projections beside it
  if (inf.mode == Mode::Decode) {  // (β_raw read in place, inside the fused projection's rows)
    if (core) ck(cudaEventRecord(started, core), "cudaEventRecord");  // the output gate's projections run beside it
    kc::decode_step(state, in, o, n, H, Kd, Kd, kp.gate, 0.f, kc::GateDType::BF16, core, LF);
  } else {
    if (cont) {  // the state continues from the cache (copied: the operator writes its final state there)
      float* h0 = grow<float>(inf.pre.h0, size_t(H) * Kd * Kd * 4);
      ck(cudaMemcpyAsync(h0, state, size_t(H) * Kd * Kd * 4, cudaMemcpyDeviceToDevice, core ? core : walk()), "h0");
      in.h0 = h0;
    }
    kc::forward(kp, in, o, state, core, kda_saved[i], started);
  }
  sec.emplace(section("kda.proj.fwd"));
  after_start();
  if (c.kda_full_rank_gate) {
    oc::linear_fwd(xn, W(A + "g_proj.weight"), go, DType::BF16, n, d, HK);
  } else {
    void* ga = bf(a.ga, Kd);
    oc::linear_fwd(xn, W(A + "g_a_proj.weight"), ga, DType::BF16, n, d, Kd);
    oc::linear_fwd(ga, W(A + "g_b_proj.weight"), go, DType::BF16, n, Kd, HK);
  }
  join();
  sec.emplace(section("kda.onorm.fwd"));
  oc::rmsnorm_gated_forward(o, go, M(A + "o_norm.weight"), on, orstd, n * H, Kd, eps());
  sec.emplace(section("kda.proj.fwd"));
  oc::linear_fwd(on, W(A + "o_proj.weight"), y, DType::F32, n, HK, d, false, nullptr, 0, 0, base);
}

// dxn [rows, d] fp32 written from dy bf16 [rows, d].
void GpuModel::Impl::kda_backward(int64_t i, const void* dy, float* dxn) {
  const int64_t H = c.kda_num_heads, Kd = c.kda_head_dim, HK = H * Kd, n = rows;
  const std::string A = P_(i) + ".self_attn.";
  const KdaActs& a = layer_acts(i).kda;
  const void* xn = got(layer_acts(i).xn, i, "xn");
  const int64_t LF = kda_in_ld();
  void *qkvp = got(a.qkvp, i, "qkvp"), *qc = got(a.qc, i, "qc"), *kc_ = got(a.kc, i, "kc"), *vc = got(a.vc, i, "vc"),
       *f = got(a.f, i, "f"), *go = got(a.gate_o, i, "gate_o"), *o = got(a.o, i, "o"), *on = got(a.on, i, "on");
  auto* pre = static_cast<const uint16_t*>(qkvp);
  const uint16_t *fa = pre + 3 * HK, *braw = fa + Kd;
  // The input gradients of the fused projection side by side [n, LF], then one GEMM each way.
  auto* dp = static_cast<uint16_t*>(grow(scratch.dp, size_t(n) * LF * 2));
  const int64_t NF = kda_in_cols();
  if (LF > NF)
    ck(cudaMemset2DAsync(dp + NF, size_t(LF) * 2, 0, size_t(LF - NF) * 2, size_t(n), walk()), "memset");
  float* orstd = got<float>(a.orstd, i, "orstd");
  float* d_on = grow<float>(scratch.d_on, size_t(n) * HK * 4);
  std::optional<Timed> sec(std::in_place, section("kda.proj.bwd"));
  // o_proj's input gradient, the gated norm's backward, then the KDA core's backward on its stream, with
  // o_proj's weight gradient and the output gate's backward beside it on this one.
  oc::linear_bwd(on, W(A + "o_proj.weight"), dy, d_on, DType::F32, nullptr, n, HK, d);
  void *d_o = grow(scratch.d_o, size_t(n) * HK * 2), *d_gate = grow(scratch.d_gate, size_t(n) * HK * 2);
  sec.emplace(section("kda.onorm.bwd"));
  oc::rmsnorm_gated_backward(o, go, M(A + "o_norm.weight"), orstd, d_on, d_o, d_gate, G(A + "o_norm.weight"), n * H,
                             Kd, eps());
  void *dq = grow(scratch.dq, size_t(n) * HK * 2), *dk = grow(scratch.dk, size_t(n) * HK * 2),
       *dv = grow(scratch.dv, size_t(n) * HK * 2), *df = grow(scratch.df, size_t(n) * HK * 2);
  uint16_t* dbraw = dp + 3 * HK + Kd;
  float *dA = grow<float>(scratch.dA, size_t(H) * 4), *ddt = grow<float>(scratch.ddt, size_t(HK) * 4);
  kc::Inputs in;
  in.q = qc, in.k = kc_, in.v = vc, in.g_raw = f, in.beta_raw = braw;
  in.A_log = M(A + "A_log"), in.dt_bias = M(A + "dt_bias");
  kc::Grads gr;
  gr.dq = dq, gr.dk = dk, gr.dv = dv, gr.dg_raw = df, gr.dbeta_raw = dbraw, gr.dA_log = dA, gr.ddt_bias = ddt;
  sec.emplace(section("kda.core.bwd"));
  fork();
  kc::backward(kda_problem(), in, d_o, nullptr, gr, core, kda_saved.empty() ? nullptr : kda_saved[i], started);
  sec.emplace(section("kda.proj.bwd"));
  after_start();
  oc::linear_bwd(on, nullptr, dy, nullptr, DType::F32, G(A + "o_proj.weight"), n, HK, d);
  if (c.kda_full_rank_gate) {
    oc::linear_bwd(xn, W(A + "g_proj.weight"), d_gate, dxn, DType::F32, G(A + "g_proj.weight"), n, d, HK, false);
  } else {
    void* d_ga = grow(scratch.d_ga, size_t(n) * Kd * 2);
    oc::linear_bwd(got(a.ga, i, "ga"), W(A + "g_b_proj.weight"), d_gate, d_ga, DType::BF16, G(A + "g_b_proj.weight"), n,
                   Kd, HK);
    oc::linear_bwd(xn, W(A + "g_a_proj.weight"), d_ga, dxn, DType::F32, G(A + "g_a_proj.weight"), n, d, Kd, false);
  }
  join();
  add_f32(G(A + "A_log"), dA, H), add_f32(G(A + "dt_bias"), ddt, HK);
  sec.emplace(section("kda.proj.bwd"));
  oc::linear_bwd(fa, W(A + "f_b_proj.weight"), df, dp + 3 * HK, DType::BF16, G(A + "f_b_proj.weight"), n, Kd, HK,
                 false, nullptr, LF, 0, LF);
  const kc::ConvShape cs = conv_shape(HK, LF);
  sec.emplace(section("kda.conv.bwd"));
  int64_t j = 0;
  for (const auto& [conv, dpost] :
       {std::pair{"q_conv1d", dq}, std::pair{"k_conv1d", dk}, std::pair{"v_conv1d", dv}}) {
    const std::string cw = A + conv + ".weight";
    kc::short_conv_backward(pre + j * HK, M(cw), dpost, dp + j * HK, G(cw), cs);
    ++j;
  }
  sec.emplace(section("kda.proj.bwd"));
  oc::linear_bwd(xn, kda_in_weight(i), dp, dxn, DType::F32, G(A + "q_proj.weight"), n, d, LF, true, nullptr, 0,
                 LF);
}

}  // namespace lm::model::cuda

#endif

// Gated NoPE MLA on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU layer is model/mla.cpp): q (LoRA or
// plain), the kv compression with its RMSNorm, the per-head k/v assembly, causal attention (ops/attention/cuda),
// the optional sigmoid output gate and the output projection; and their backward.
//
// Legend: n = rows tokens, d hidden, Hm heads (H), Dn nope / Dr rope / Dv value head dims, Dq = Dn + Dr,
//         Dkv = Dn + Dv, R kv_lora_rank, Q q_lora_rank (0: plain q), RD = R + Dr, HV = Hm·Dv.
//   q   = RMSNorm_q(qa = xn W_qaᵀ) W_qbᵀ  or  xn W_qᵀ     [n, Hm, Dq]   (qan, qa_rstd: the norm's output, rstd)
//   ckr = xn W_kvaᵀ = [c | k_r]  fp32                      [n, RD]
//   cn  = RMSNorm_kv(c) (c_rstd; eps 1e-6)                 [n, R]
//   kv  = cn W_kvbᵀ = per head [k_nope | v]                 [n, Hm, Dkv]
//   k   = per head [k_nope | k_r], v                        [n, Hm, Dq], [n, Hm, Dv]
//   o   = attention(q, k, v) (lse [n, Hm]);  og = o ⊙ σ(graw = xn W_gᵀ)   [n, Hm, Dv]
//   y   = base + (og or o) W_oᵀ  fp32 [n, d]
// Inference (InferState): prefill (one fresh sequence) runs the same forward and writes the latent rows
// [cn | k_r] bf16 [n, RD] to the slot's cache; decode attends in the absorbed form (mla_decode_step).
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <cmath>

#include "model/cuda/glue_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::model::cuda {

oc::AttnShape GpuModel::Impl::attn_shape() const {
  oc::AttnShape a;
  a.B = seqs.B, a.T = seqs.T, a.H = c.num_attention_heads, a.Hkv = a.H;
  a.Dk = c.qk_nope_head_dim + c.qk_rope_head_dim, a.Dv = c.v_head_dim;
  if (!seqs.cu.empty()) a.cu_seqlens = seqs.cu.data(), a.N = seqs.num_seqs();
  return a;
}

void GpuModel::Impl::mla_forward(int64_t i, const void* xn, float* y, const float* base) {
  const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                R = c.kv_lora_rank, Q = c.q_lora_rank.value_or(0), Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr,
                n = rows;
  const std::string A = P_(i) + ".self_attn.";
  MlaActs& a = layer_acts(i).mla;
  void* q = grow(a.q, size_t(n) * H * Dq * 2);
  if (Q) {
    float* qa = grow<float>(a.qa, size_t(n) * Q * 4);
    void* qan = grow(a.qan, size_t(n) * Q * 2);
    float* qrs = grow<float>(a.qa_rstd, size_t(n) * 4);
    oc::linear_fwd(xn, W(A + "q_a_proj.weight"), qa, DType::F32, n, d, Q);
    oc::rmsnorm_forward(qa, DType::F32, M(A + "q_a_layernorm.weight"), qan, qrs, n, Q, float(kLoraEps));
    oc::linear_fwd(qan, W(A + "q_b_proj.weight"), q, DType::BF16, n, Q, H * Dq);
  } else {
    oc::linear_fwd(xn, W(A + "q_proj.weight"), q, DType::BF16, n, d, H * Dq);
  }
  float* ckr = grow<float>(a.ckr, size_t(n) * RD * 4);
  void* cn = grow(a.cn, size_t(n) * R * 2);
  float* crs = grow<float>(a.c_rstd, size_t(n) * 4);
  oc::linear_fwd(xn, W(A + "kv_a_proj_with_mqa.weight"), ckr, DType::F32, n, d, RD);
  oc::rmsnorm_forward(ckr, DType::F32, M(A + "kv_a_layernorm.weight"), cn, crs, n, R, float(kLoraEps), RD, R);
  void* o = grow(a.o, size_t(n) * H * Dv * 2);
  if (inf.mode == InferState::Mode::Decode) {
    mla_decode_step(i, q, cn, ckr, o);
  } else {
    if (inf.mode == InferState::Mode::Prefill)  // the prompt's latent rows, from position inf.start
      mla_latent_rows(cn, ckr, inf.latent[i].p, as<int32_t>(inf.table.p) + inf.first * inf.table_ld, inf.table_ld,
                      nullptr, inf.start, n, R, Dr);
    void* kv = grow(a.kv, size_t(n) * H * Dkv * 2);
    oc::linear_fwd(cn, W(A + "kv_b_proj.weight"), kv, DType::BF16, n, R, H * Dkv);
    void *k = grow(a.k, size_t(n) * H * Dq * 2), *v = grow(a.v, size_t(n) * H * Dv * 2);
    mla_split_kv(kv, ckr, k, v, n, H, Dn, Dr, Dv, R);
    float* lse = grow<float>(a.lse, size_t(n) * H * 4);
    if (inf.mode == InferState::Mode::Prefill && inf.start > 0) mla_prefill_attend(i, q, k, v, o);
    else oc::attention_forward(attn_shape(), q, k, v, o, lse);
  }
  const void* o_in = o;
  if (c.mla_use_output_gate) {
    void *graw = grow(a.graw, size_t(n) * H * Dv * 2), *og = grow(a.og, size_t(n) * H * Dv * 2);
    oc::linear_fwd(xn, W(A + "g_proj.weight"), graw, DType::BF16, n, d, H * Dv);
    sigmoid_gate_forward(o, graw, og, n * H * Dv);
    o_in = og;
  }
  oc::linear_fwd(o_in, W(A + "o_proj.weight"), y, DType::F32, n, H * Dv, d, false, nullptr, 0, 0, base);
}

// One token for each of the S decode slots: its latent row [cn | k_r] appended to the slot's cache, then absorbed
// attention over the cache (as model::GatedMla::decode): q̃_h = q_nope,h W_UK,h (W_kvb's first Dn rows of head h,
// one strided-batch GEMM over the heads), ō = mla_decode_paged(q̃, q_rope, the slots' blocks), o_h = ō_h W_UV,hᵀ
// (its next Dv rows). The slots' lengths and block tables are read on the device (inf.lens, inf.table), so the
// step has one launch sequence whatever the lengths (a CUDA graph).
void GpuModel::Impl::mla_decode_step(int64_t i, const void* q, const void* cn, const float* ckr, void* o) {
  const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                R = c.kv_lora_rank, Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr, S = inf.S;
  const int32_t* table = as<int32_t>(inf.table.p) + inf.first * inf.table_ld;
  const int32_t* lens = as<int32_t>(inf.lens.p) + inf.first;
  mla_latent_rows(cn, ckr, inf.latent[i].p, table, inf.table_ld, lens, 0, S, R, Dr);
  auto* Wkvb = static_cast<const uint16_t*>(W(P_(i) + ".self_attn.kv_b_proj.weight"));
  auto* q_lat = grow<uint16_t>(inf.q_lat, size_t(S) * H * R * 2);
  auto* o_lat = grow<uint16_t>(inf.o_lat, size_t(S) * H * R * 2);
  auto* qb = static_cast<const uint16_t*>(q);
  // q̃_h [S, R] = q_nope,h [S, Dn] · (W_kvb rows h·Dkv ..+Dn) [Dn, R], all heads in one launch
  oc::gemm_bf16_strided_batched(false, false, S, R, Dn, 1.f, qb, H * Dq, Dq, Wkvb, R, Dkv * R, 0.f, q_lat, H * R, R,
                                H, DType::BF16);
  oc::PagedDecodeShape ps;
  ps.S = S, ps.H = H, ps.R = R, ps.Dr = Dr, ps.ldc = RD, ps.max_tokens = inf.max_tokens, ps.table_ld = inf.table_ld;
  ps.ldqr = Dq;    // (q_rope read in place, after each head's q_nope)
  ps.len_add = 1;  // (lens: the positions before this token, whose row was just written)
  ps.scale = float(1.0 / std::sqrt(double(Dq)));
  void* ws = grow(inf.dec_ws, oc::mla_decode_paged_workspace(ps));
  oc::mla_decode_paged(ps, q_lat, qb + Dn, inf.latent[i].p, table, lens, o_lat, ws);
  // o_h [S, Dv] = ō_h [S, R] · (W_kvb rows h·Dkv + Dn ..+Dv)ᵀ
  oc::gemm_bf16_strided_batched(false, true, S, Dv, R, 1.f, o_lat, H * R, R, Wkvb + Dn * R, R, Dkv * R, 0.f, o,
                                H * Dv, Dv, H, DType::BF16);
}

// A prefill chunk of n tokens at positions [start, start + n) of a cached sequence: attention to its own keys (k, v
// [n, H, Dq | Dv], causal) and to the cached positions [0, start), whose keys and values are decompressed from the
// latent pool block by block (kPrefillKeys rows at a time: K/V never exist for the whole context), each block's
// partial output merged by log-sum-exp. The decompression is the training forward's (cn W_kvbᵀ, then the split with
// k_r), on the same bf16 rows.
void GpuModel::Impl::mla_prefill_attend(int64_t i, const void* q, const void* k, const void* v, void* o) {
  const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                R = c.kv_lora_rank, Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr, n = rows, start = inf.start;
  constexpr int64_t kPrefillKeys = 16384;
  const std::string A = P_(i) + ".self_attn.";
  InferState::Prefill& w = inf.pre;
  void* o_part = grow(w.o_part, size_t(n) * H * Dv * 2);
  float* lse_part = grow<float>(w.lse_part, size_t(n) * H * 4);
  float* o_acc = grow<float>(w.o_acc, size_t(n) * H * Dv * 4);
  float* lse_acc = grow<float>(w.lse_acc, size_t(n) * H * 4);
  oc::BlockShape bs;
  bs.H = H, bs.Dk = Dq, bs.Dv = Dv, bs.Tq = n, bs.q_pos0 = start;
  bs.Tk = n, bs.k_pos0 = start;
  oc::attention_forward_block(bs, q, k, v, o_part, lse_part);
  oc::attention_merge(n, H, Dv, o_part, lse_part, o_acc, lse_acc, true);
  // (sized for the longest block at once: buffers that grew with the context would invalidate the decode graphs)
  const int64_t kb_max = start > 0 ? std::min(kPrefillKeys, inf.max_tokens) : 0;
  auto* cn = grow<uint16_t>(w.cn, size_t(kb_max) * R * 2);
  float* ckr = grow<float>(w.ckr, size_t(kb_max) * RD * 4);
  void* kv = grow(w.kv, size_t(kb_max) * H * Dkv * 2);
  void *kb_k = grow(w.k, size_t(kb_max) * H * Dq * 2), *kb_v = grow(w.v, size_t(kb_max) * H * Dv * 2);
  const int32_t* table = as<int32_t>(inf.table.p) + inf.first * inf.table_ld;
  for (int64_t p0 = 0; p0 < start; p0 += kPrefillKeys) {
    const int64_t nk = std::min(kPrefillKeys, start - p0);
    mla_latent_gather(inf.latent[i].p, table, p0, nk, R, Dr, cn, ckr);
    oc::linear_fwd(cn, W(A + "kv_b_proj.weight"), kv, DType::BF16, nk, R, H * Dkv);
    mla_split_kv(kv, ckr, kb_k, kb_v, nk, H, Dn, Dr, Dv, R);
    bs.Tk = nk, bs.k_pos0 = p0;
    oc::attention_forward_block(bs, q, kb_k, kb_v, o_part, lse_part);
    oc::attention_merge(n, H, Dv, o_part, lse_part, o_acc, lse_acc, false);
  }
  oc::attention_merge_finish(n, H, Dv, o_acc, o);
}

void GpuModel::Impl::mla_backward(int64_t i, const void* dy, float* dxn) {
  const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                R = c.kv_lora_rank, Q = c.q_lora_rank.value_or(0), Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr,
                HV = H * Dv, n = rows;
  const std::string A = P_(i) + ".self_attn.";
  const MlaActs& a = layer_acts(i).mla;
  const void* xn = got(layer_acts(i).xn, i, "xn");
  void *o = got(a.o, i, "o"), *q = got(a.q, i, "q"), *k = got(a.k, i, "k"), *v = got(a.v, i, "v");
  float* d_og = grow<float>(scratch.d_og, size_t(n) * HV * 4);
  const bool gated = c.mla_use_output_gate;
  oc::linear_bwd(gated ? got(a.og, i, "og") : o, W(A + "o_proj.weight"), dy, d_og, DType::F32, G(A + "o_proj.weight"),
                 n, HV, d);
  void* d_o = grow(scratch.d_o, size_t(n) * HV * 2);
  bool dx_written = false;
  if (gated) {
    void* d_g = grow(scratch.d_g, size_t(n) * HV * 2);
    sigmoid_gate_backward(o, got(a.graw, i, "graw"), d_og, d_o, d_g, n * HV);
    oc::linear_bwd(xn, W(A + "g_proj.weight"), d_g, dxn, DType::F32, G(A + "g_proj.weight"), n, d, HV, false);
    dx_written = true;
  } else {
    cast_f32_bf16(d_og, d_o, n * HV);
  }
  void *dq = grow(scratch.dq, size_t(n) * H * Dq * 2), *dk = grow(scratch.dk, size_t(n) * H * Dq * 2),
       *dv = grow(scratch.dv, size_t(n) * HV * 2);
  oc::attention_backward(attn_shape(), q, k, v, o, got<float>(a.lse, i, "lse"), d_o, dq, dk, dv);
  void *dkv = grow(scratch.dkv, size_t(n) * H * Dkv * 2), *dckr = grow(scratch.dckr, size_t(n) * RD * 2);
  mla_merge_dkv(dk, dv, dkv, dckr, n, H, Dn, Dr, Dv, R);
  float* dcn = grow<float>(scratch.dcn, size_t(n) * R * 4);
  oc::linear_bwd(got(a.cn, i, "cn"), W(A + "kv_b_proj.weight"), dkv, dcn, DType::F32, G(A + "kv_b_proj.weight"), n, R,
                 H * Dkv);
  oc::rmsnorm_backward(got(a.ckr, i, "ckr"), DType::F32, M(A + "kv_a_layernorm.weight"),
                       got<float>(a.c_rstd, i, "c_rstd"), dcn, DType::F32, dckr, DType::BF16,
                       G(A + "kv_a_layernorm.weight"), n, R, float(kLoraEps), RD, R, false, RD);
  oc::linear_bwd(xn, W(A + "kv_a_proj_with_mqa.weight"), dckr, dxn, DType::F32, G(A + "kv_a_proj_with_mqa.weight"), n,
                 d, RD, dx_written);
  if (Q) {
    float* dqan = grow<float>(scratch.dqan, size_t(n) * Q * 4);
    void* dqa = grow(scratch.dqa, size_t(n) * Q * 2);
    oc::linear_bwd(got(a.qan, i, "qan"), W(A + "q_b_proj.weight"), dq, dqan, DType::F32, G(A + "q_b_proj.weight"), n, Q,
                   H * Dq);
    oc::rmsnorm_backward(got(a.qa, i, "qa"), DType::F32, M(A + "q_a_layernorm.weight"),
                         got<float>(a.qa_rstd, i, "qa_rstd"), dqan, DType::F32, dqa, DType::BF16,
                         G(A + "q_a_layernorm.weight"), n, Q, float(kLoraEps));
    oc::linear_bwd(xn, W(A + "q_a_proj.weight"), dqa, dxn, DType::F32, G(A + "q_a_proj.weight"), n, d, Q, true);
  } else {
    oc::linear_bwd(xn, W(A + "q_proj.weight"), dq, dxn, DType::F32, G(A + "q_proj.weight"), n, d, H * Dq, true);
  }
}

}  // namespace lm::model::cuda

#endif

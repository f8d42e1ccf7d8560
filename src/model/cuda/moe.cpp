// Stable LatentMoE on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU layer is model/moe.cpp): the fp32
// router with the QB-biased top-k, the latent down-projection (fused with the router's and the shared expert's
// input GEMM when moe_in_fused()), the permutation, the grouped expert GEMMs with the GLU in the first one's
// epilogue, the combine, the latent RMSNorm and up-projection, the shared expert (ffn.cpp); and their backward.
//
// Legend: n = rows tokens, d hidden, E experts, k per token, I expert width, l latent width, Is shared width,
//         Mr = n·k permuted rows, LZ = moe_in_bf16() = l + 2·Is, LB = moe_in_ld() (fused), EP = moe_in_epad().
//   logits = yn W_rᵀ fp32 [n, E]; scores = σ(logits); topk_idx, topk_w [n, k]; alpha [n] (QB's cutoff)
//   zs = yn [W_down; W_shared_gate; W_shared_up]ᵀ [n, LZ] (fused; else z = yn W_downᵀ [n, l])
//   offsets [E + 1], prow, ppos [Mr]; xs = gather(z) [Mr, l]; eab = xs W13_eᵀ [Mr, 2I], eh = GLU(eab) [Mr, I]
//   eo = eh W2_eᵀ [Mr, l]; u = Σ_sel topk_w · eo [n, l]; un = RMSNorm_l(u) (u_rstd)
//   y = base + un W_upᵀ + Shared(yn)  fp32 [n, d]
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <cstdlib>
#include <optional>
#include <utility>

#include "core/env.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::model::cuda {

// y [rows, d] fp32 = base + moe(yn) (base == y: in place).
void GpuModel::Impl::moe_forward(int64_t i, const void* yn, float* y, const float* base) {
  const int64_t E = c.num_experts, k = c.num_experts_per_token, I = c.moe_intermediate_size, l = c.expert_width(),
                n = rows, Mr = n * k;
  const bool latent = c.has_latent_moe();
  const std::string B = P_(i) + ".block_sparse_moe.";
  MoeActs& a = layer_acts(i).moe;
  float* logits = grow<float>(a.logits, size_t(n) * E * 4);
  std::optional<Timed> sec(std::in_place, section("moe.route.fwd"));
  oc::linear_fwd(yn, W(B + "gate.weight"), logits, DType::F32, n, d, E);
  int32_t* topk_idx = grow<int32_t>(a.topk_idx, size_t(Mr) * 4);
  float* topk_w = grow<float>(a.topk_w, size_t(Mr) * 4);
  oc::RouterOut ro;
  ro.topk_idx = topk_idx, ro.topk_w = topk_w;
  MoeActs& qb = training ? acts[size_t(i)].moe : a;  // balance() reads them after the step, whatever the plan
  ro.scores = grow<float>(qb.scores, size_t(n) * E * 4);
  ro.alpha = grow<float>(qb.alpha, size_t(n) * 4);
  oc::router_forward(logits, M(B + "gate.e_score_correction_bias"), n, E, k, c.moe_renormalize,
                     static_cast<float>(c.routed_scaling_factor), ro);
  const void* z = yn;
  int64_t ldz = 0;
  const bool fused = moe_in_fused();
  sec.emplace(section("moe.latent.fwd"));
  if (fused) {  // z and the shared expert's ab side by side [n, l + 2·Is]
    const int64_t LZ = moe_in_bf16();
    void* zs = grow(a.zs, size_t(n) * LZ * 2);
    oc::linear_fwd(yn, W(B + "routed_expert_down_proj.weight"), zs, DType::BF16, n, d, LZ, false, nullptr, 0, LZ);
    z = zs, ldz = LZ;
  } else if (latent) {
    void* zb = grow(a.z, size_t(n) * l * 2);
    oc::linear_fwd(yn, W(B + "routed_expert_down_proj.weight"), zb, DType::BF16, n, d, l);
    z = zb;
  }
  int32_t *off = grow<int32_t>(a.offsets, size_t(E + 1) * 4), *prow = grow<int32_t>(a.prow, size_t(Mr) * 4),
          *ppos = grow<int32_t>(a.ppos, size_t(Mr) * 4);
  sec.emplace(section("moe.route.fwd"));
  if (inf.mode == InferState::Mode::Off) {  // (inference needs no loads on the host: expert_loads, the wgrad fallback)
    ck(cudaStreamWaitEvent(walk(), offsets_h[i].done, 0), "wait");  // the last copy of `off` has left
    oc::moe_permute(topk_idx, n, k, E, off, prow, ppos);
    ck(cudaEventRecord(permuted, walk()), "cudaEventRecord");
    ck(cudaStreamWaitEvent(side, permuted, 0), "wait");
    ck(cudaMemcpyAsync(offsets_h[i].p, off, size_t(E + 1) * 4, cudaMemcpyDeviceToHost, side), "offsets to host");
    ck(cudaEventRecord(offsets_h[i].done, side), "cudaEventRecord");
  } else {
    oc::moe_permute(topk_idx, n, k, E, off, prow, ppos);
  }
  void *h = grow(a.eh, size_t(Mr) * I * 2), *eo = grow(a.eo, size_t(Mr) * l * 2);
  const std::string X = B + "experts.0.";
  const ops::GluParams gp = glu();
  oc::GluArgs ga;
  ga.swiglu = gp.kind == ops::GluKind::SwiGLU;
  ga.beta1 = static_cast<float>(gp.beta1), ga.beta2 = static_cast<float>(gp.beta2);
  // Decode steps of up to kFewRowsDecode rows take the few-row kernels (Kimi-Linear-48B experts, bench moe: 1.35x
  // the wgmma ones at 8 rows, even at 64, 0.97x at 512; the wgmma ones are batch-invariant too, so a token's bits
  // change only where a batch crosses 64 rows). They read z's rows through the permutation (no xs).
  constexpr int64_t kFewRowsDecode = 64;
  static const bool few_rows = env::moe_few_rows();
  if (inf.mode == InferState::Mode::Decode && few_rows && Mr <= kFewRowsDecode) {
    sec.emplace(section("moe.experts.fwd"));
    oc::grouped_gemm_glu_few_rows(z, W(X + "w1.weight"), h, nullptr, off, Mr, I, l, E, ga, nullptr, prow, k, ldz);
    oc::grouped_gemm_few_rows(h, W(X + "w2.weight"), eo, off, Mr, l, I, E, nullptr, true);
  } else {
    void *xs = grow(a.xs, size_t(Mr) * l * 2), *ab = grow(a.eab, size_t(Mr) * 2 * I * 2);
    oc::moe_gather(z, prow, xs, n, k, l, nullptr, ldz);
    sec.emplace(section("moe.experts.fwd"));
    oc::grouped_gemm_glu(xs, W(X + "w1.weight"), h, ab, off, Mr, I, l, E, ga);
    oc::grouped_gemm(h, W(X + "w2.weight"), eo, off, Mr, l, I, E);
  }
  sec.emplace(section("moe.combine.fwd"));
  void* u = grow(a.u, size_t(n) * l * 2);
  oc::moe_combine(eo, topk_w, ppos, u, n, k, l);
  sec.emplace(section("moe.latent.fwd"));
  if (latent) {
    const void* un = u;
    if (c.latent_moe_use_norm) {
      void* unb = grow(a.un, size_t(n) * l * 2);
      float* urs = grow<float>(a.u_rstd, size_t(n) * 4);
      oc::rmsnorm_forward(u, DType::BF16, M(B + "routed_expert_norm.weight"), unb, urs, n, l, eps());
      un = unb;
    }
    oc::linear_fwd(un, W(B + "routed_expert_up_proj.weight"), y, DType::F32, n, l, d, false, nullptr, 0, 0, base);
  } else {  // Kimi Linear: the experts work in d itself
    add_bf16(y, base, u, n * d);
  }
  sec.emplace(section("moe.shared.fwd"));
  if (fused) {  // the shared expert from its ab columns of zs
    ffn_down_forward(a.shared, B + "shared_experts", static_cast<const uint16_t*>(z) + l, ldz, n, d,
                     c.shared_intermediate_size(), y, y);
  } else if (c.num_shared_experts > 0) {
    ffn_forward(a.shared, B + "shared_experts", yn, n, d, c.shared_intermediate_size(), y, y);
  }
}

void GpuModel::Impl::moe_backward(int64_t i, const void* dy, float* dyn) {
  LM_CHECK(c.has_latent_moe(), "gpu model: training an MoE without a latent projection (Kimi Linear) is not supported "
           "on the GPU yet (inference is)");
  const int64_t E = c.num_experts, k = c.num_experts_per_token, I = c.moe_intermediate_size, l = c.expert_width(),
                n = rows, Mr = n * k;
  const std::string B = P_(i) + ".block_sparse_moe.";
  const MoeActs& a = layer_acts(i).moe;
  const void* yn = got(layer_acts(i).yn, i, "yn");
  // u -> latent norm -> up projection.
  float* dun = grow<float>(scratch.dun, size_t(n) * l * 4);
  float* du = grow<float>(scratch.du, size_t(n) * l * 4);
  const std::string up = B + "routed_expert_up_proj.weight";
  std::optional<Timed> sec(std::in_place, section("moe.latent.bwd"));
  if (c.latent_moe_use_norm) {
    oc::linear_bwd(got(a.un, i, "un"), W(up), dy, dun, DType::F32, G(up), n, l, d);
    oc::rmsnorm_backward(got(a.u, i, "u"), DType::BF16, M(B + "routed_expert_norm.weight"),
                         got<float>(a.u_rstd, i, "u_rstd"), dun, DType::F32, du, DType::F32,
                         G(B + "routed_expert_norm.weight"), n, l, eps());
  } else {
    oc::linear_bwd(got(a.u, i, "u"), W(up), dy, du, DType::F32, G(up), n, l, d);
  }
  void* d_eo = grow(scratch.d_eo, size_t(Mr) * l * 2);
  float* d_topk_w = grow<float>(scratch.d_topk_w, size_t(Mr) * 4);
  const int32_t* ppos = got<int32_t>(a.ppos, i, "ppos");
  sec.emplace(section("moe.combine.bwd"));
  oc::moe_combine_backward(got(a.eo, i, "eo"), got<float>(a.topk_w, i, "topk_w"), ppos, du, false, d_eo, d_topk_w, n,
                           k, l);
  // Routed experts.
  const std::string X = B + "experts.0.";
  float *g13 = G(X + "w1.weight"), *g2 = G(X + "w2.weight");
  const auto* xs = static_cast<const uint16_t*>(got(a.xs, i, "xs"));
  const auto* h = static_cast<const uint16_t*>(got(a.eh, i, "eh"));
  const int32_t* off_d = got<int32_t>(a.offsets, i, "offsets");
  const uint16_t* t13 = as<uint16_t>(wT.p) + wT_off[i];
  const uint16_t* t2 = t13 + E * l * 2 * I;
  void* dh = grow(scratch.e_dh, size_t(Mr) * I * 2);
  void* dab = grow(scratch.e_dab, size_t(Mr) * 2 * I * 2);
  void* dxs = grow(scratch.dxs, size_t(Mr) * l * 2);
  const auto* deo = static_cast<const uint16_t*>(d_eo);
  const auto* dabp = static_cast<const uint16_t*>(dab);
  // Weight gradients (reductions over each expert's rows) by the grouped wgrad kernel; with
  // LONGMOE_MOE_WGRAD_CUBLAS=1 as per-expert cuBLAS products on side streams (the host waits for the offsets).
  static const bool cublas_wgrad = env::moe_wgrad_cublas();
  auto wgrad = [&](const uint16_t* gy, const uint16_t* x, float* dw, int64_t N, int64_t Kd) {
    if (!cublas_wgrad) return oc::grouped_gemm_wgrad(gy, x, dw, off_d, Mr, N, Kd, E, true);
    ck(cudaEventSynchronize(offsets_h[i].done), "offsets to host");
    const int32_t* off = offsets_h[i].p;
    std::vector<oc::GemmGroup> groups;
    for (int64_t e = 0; e < E; ++e) {  // dW_e += gy_eᵀ · x_e
      const int64_t r0 = off[e], me = off[e + 1] - r0;
      groups.push_back({N, Kd, me, gy + r0 * N, N, x + r0 * Kd, Kd, dw + e * N * Kd, Kd});
    }
    oc::gemm_bf16_grouped(true, false, groups, 1.f, 1.f, DType::F32);
  };
  sec.emplace(section("moe.experts.bwd"));
  oc::grouped_gemm(d_eo, t2, dh, off_d, Mr, I, l, E);  // dh_e = d_eo_e · W2_e
  wgrad(deo, h, g2, l, I);                             // dW2_e += d_eo_eᵀ · h_e
  sec.emplace(section("moe.glu.bwd"));
  oc::glu_backward(got(a.eab, i, "eab"), dh, DType::BF16, dab, Mr, I, glu());
  sec.emplace(section("moe.experts.bwd"));
  oc::grouped_gemm(dab, t13, dxs, off_d, Mr, l, 2 * I, E);  // dxs_e = dab_e · W13_e
  wgrad(dabp, xs, g13, 2 * I, l);                           // dW13_e += dab_eᵀ · xs_e
  const bool fused = moe_in_fused();
  // fused: the input gradients of the one [E + l + 2·Is, d] matrix side by side, then one GEMM each way
  const int64_t LB = fused ? moe_in_ld() : 0;
  auto* dcat = fused ? static_cast<uint16_t*>(grow(scratch.moe_dcat, size_t(n) * LB * 2)) : nullptr;
  const int64_t EP = fused ? moe_in_epad() : E;
  if (fused && EP > E)
    ck(cudaMemset2DAsync(dcat + E, size_t(LB) * 2, 0, size_t(EP - E) * 2, size_t(n), walk()), "memset");
  sec.emplace(section("moe.route.bwd"));
  void* d_logits = fused ? static_cast<void*>(dcat) : grow(scratch.d_logits, size_t(n) * E * 2);
  oc::router_backward(got<float>(a.logits, i, "logits"), got<int32_t>(a.topk_idx, i, "topk_idx"), d_topk_w, d_logits,
                      true, n, E, k, c.moe_renormalize, static_cast<float>(c.routed_scaling_factor), nullptr, LB);
  if (!fused)
    oc::linear_bwd(yn, W(B + "gate.weight"), d_logits, dyn, DType::F32, G(B + "gate.weight"), n, d, E, false);
  sec.emplace(section("moe.gather.bwd"));
  void* dz = fused ? static_cast<void*>(dcat + EP) : grow(scratch.dz, size_t(n) * l * 2);
  oc::moe_gather_backward(dxs, ppos, dz, true, n, k, l, false, nullptr, LB);
  sec.emplace(section("moe.shared.bwd"));
  if (fused) {
    ffn_down_backward(a.shared, i, "shared", B + "shared_experts",
                      static_cast<const uint16_t*>(got(a.zs, i, "zs")) + l, moe_in_bf16(), n, d,
                      c.shared_intermediate_size(), dy, dcat + EP + l, LB);
  } else if (c.num_shared_experts > 0) {
    ffn_backward(a.shared, i, "shared", B + "shared_experts", yn, n, d, c.shared_intermediate_size(), dy, dyn, true);
  }
  sec.emplace(section("moe.latent.bwd"));
  if (fused)  // dyn's only write: router, latent and shared input gradients in one product
    oc::linear_bwd(yn, W(B + "gate.weight"), dcat, dyn, DType::F32, G(B + "gate.weight"), n, d, LB, false, nullptr,
                   0, LB);
  else
    oc::linear_bwd(yn, W(B + "routed_expert_down_proj.weight"), dz, dyn, DType::F32,
                   G(B + "routed_expert_down_proj.weight"), n, d, l, true);
}

}  // namespace lm::model::cuda

#endif

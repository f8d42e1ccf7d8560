#pragma once
// Mixture-of-experts on NVIDIA Hopper (SPEC §5): host API of the CUDA kernels. Plain C++ (no CUDA types), so
// CPU code and tests include it without the CUDA headers. Tensor pointers are device pointers.
//
// Legend: m tokens, n (= E) experts, k experts per token, M = m·k permuted rows, d width of the expert input
//         (the latent ℓ with routed_expert_hidden_size), I moe_intermediate_size, K reduction dim, N output dim.
// Expert order as lm::ops::moe_build_permutation: a stable sort of the assignments a = i·k + t by expert, so
// expert e owns rows offsets[e] .. offsets[e+1]−1; rows[r] = assignment at row r, pos[a] = its row.
// Index arrays on the device are int32 (offsets [E + 1] with offsets[0] = 0, offsets[E] = M).
#include <cstddef>
#include <cstdint>

namespace lm::ops::cuda {

// ---- grouped expert GEMMs (wgmma, one persistent launch over (expert, m tile, n tile)) --------------
// y [M, N] bf16: row r of expert e is x[r] · W_eᵀ, with x [M, K] bf16 and W [E, N, K] bf16 (nn.Linear
// layout: output features by input features). K and N multiples of 8.
void grouped_gemm(const void* x, const void* w, void* y, const int32_t* offsets, int64_t M, int64_t N, int64_t K,
                  int64_t E, void* stream = nullptr);

// SiTU-GLU (SPEC §4, ops/glu/glu.hpp) fused into the epilogue of the first expert GEMM:
//   ab = x · W13_eᵀ with W13 [E, 2I, K] = [W_gate (w1) ; W_up (w3)] per expert, h [M, I] = GLU(a, b) in bf16.
// ab [M, 2I] bf16 (nullable) keeps the pre-activations for the backward. I a multiple of 8.
struct GluArgs {
  bool swiglu = false;
  float beta1 = 4.f, beta2 = 25.f;  // SiTU caps; beta2 <= 0 or inf: no cap on b
};
void grouped_gemm_glu(const void* x, const void* w13, void* h, void* ab, const int32_t* offsets, int64_t M, int64_t I,
                      int64_t K, int64_t E, const GluArgs& g = {}, void* stream = nullptr);

// Decode steps (a few rows per expert): the same two products by the few-row kernel (few_rows.cu), which streams
// each selected expert's weight rows once over all SMs instead of 128-row tensor-core tiles. As with the above, a
// row's bits do not depend on the other rows, but they are not grouped_gemm's bits: a caller takes one or the
// other for a kind of step (GpuModel: decode steps), never both for the same rows. The GLU variant can read its
// rows through the permutation (the gather fused): with `rows`, row r is x[rows[r] / k] of x [m, ldx] (ldx: 0 = K;
// a multiple of 8). offsets_ready: the offsets were complete when the kernel before this one on the stream started
// (a decode step: the GLU product runs in between); the plain product then starts while that kernel still runs
// (programmatic dependent launch, core/cuda/pdl.cuh), reads the offsets and asks L2 for its weight rows, and waits
// only for x.
void grouped_gemm_few_rows(const void* x, const void* w, void* y, const int32_t* offsets, int64_t M, int64_t N,
                           int64_t K, int64_t E, void* stream = nullptr, bool offsets_ready = false);
void grouped_gemm_glu_few_rows(const void* x, const void* w13, void* h, void* ab, const int32_t* offsets, int64_t M,
                               int64_t I, int64_t K, int64_t E, const GluArgs& g = {}, void* stream = nullptr,
                               const int32_t* rows = nullptr, int64_t k = 1, int64_t ldx = 0);

// Expert weight gradients, the backward of grouped_gemm (wgrad.cu): dw[e] [N, K] fp32 row-major (+)= dy_eᵀ · x_e,
// a reduction over expert e's rows of dy [M, N] and x [M, K] (bf16, the same offsets). accumulate: += (else =,
// and an expert without rows gets zeros). N and K multiples of 8. One persistent launch over (expert, N tile,
// K tile), each tile reducing its expert's rows in 64-row steps.
void grouped_gemm_wgrad(const void* dy, const void* x, float* dw, const int32_t* offsets, int64_t M, int64_t N,
                        int64_t K, int64_t E, bool accumulate, void* stream = nullptr);

// Expert FFNs of the permuted rows: eo [M, d] = GLU(xs · W13ᵀ) · W2ᵀ with W2 [E, d, I] (w2). The hidden h
// [M, I] lives in stream-ordered scratch unless `h` is given (then it is kept).
void moe_expert_ffn(const void* xs, const void* w13, const void* w2, void* eo, const int32_t* offsets, int64_t M,
                    int64_t d, int64_t I, int64_t E, const GluArgs& g = {}, void* h = nullptr, void* stream = nullptr);

// ---- router (fp32), as lm::ops::router_forward: s = sigmoid(logits), top-k of v = s + bias (ties to the
// lower expert), p = s / (Σ_sel s + 1e-20) · scaling (renormalize) or s · scaling. logits [m, n], bias [n]
// (nullable); topk_idx [m, k] int32 sorted by expert, topk_w [m, k] aligned. Optional (nullable): scores
// [m, n]; QB statistics margin [m] = v_(k) − v_(k+1) and alpha [m] = v_(k+1) (the admission cutoff).
// n <= 1024, k < 32.
struct RouterOut {
  int32_t* topk_idx = nullptr;
  float* topk_w = nullptr;
  float *scores = nullptr, *margin = nullptr, *alpha = nullptr;
};
void router_forward(const float* logits, const float* bias, int64_t m, int64_t n, int64_t k, bool renormalize,
                    float scaling, const RouterOut& out, void* stream = nullptr);

// ---- permutation, gather, combine -----------------------------------------------------------------
// offsets [n + 1], rows [m·k], pos [m·k] (deterministic: a stable sort by expert; up to 1,024 assignments and
// 8,192 experts the same order from one block, without the sort's launches and scratch: a decode step's few rows).
void moe_permute(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int32_t* offsets, int32_t* rows,
                 int32_t* pos, void* stream = nullptr);
// xs [m·k, d] bf16: xs[r] = x[rows[r] / k].
// (ldx: x's row stride, 0: d.)
void moe_gather(const void* x, const int32_t* rows, void* xs, int64_t m, int64_t k, int64_t d, void* stream = nullptr,
                int64_t ldx = 0);
// y [m, d] bf16: y[i] = Σ_t topk_w[i, t] · eo[pos[i·k + t]], summed in fp32 in slot order.
void moe_combine(const void* eo, const float* topk_w, const int32_t* pos, void* y, int64_t m, int64_t k, int64_t d,
                 void* stream = nullptr);

// ---- backward pieces (route_bwd.cu), as the CPU ops in ops/moe/router.hpp and permute.hpp --------------
// d_eo [M, d] bf16: d_eo[pos[i·k + t]] = topk_w[i, t] · dy[i];  d_topk_w [m, k] fp32 = <eo[pos[i·k+t]], dy[i]>
// (fp32 dot). eo bf16 [M, d]; dy F32 or BF16 [m, d] (dy_bf16 tells).
void moe_combine_backward(const void* eo, const float* topk_w, const int32_t* pos, const void* dy, bool dy_bf16,
                          void* d_eo, float* d_topk_w, int64_t m, int64_t k, int64_t d, void* stream = nullptr);
// dx [m, d] (=|+=) Σ_t dxs[pos[i·k + t]] in slot order, fp32 sums; dxs bf16 [M, d]; dx F32 or BF16 (dx_bf16);
// accumulate only for F32. lddx: dx's row stride (0: d).
void moe_gather_backward(const void* dxs, const int32_t* pos, void* dx, bool dx_bf16, int64_t m, int64_t k,
                         int64_t d, bool accumulate = false, void* stream = nullptr, int64_t lddx = 0);
// d_logits [m, n] from d_topk_w [m, k] with the selection fixed (ops::router_backward): only the selected
// experts' unbiased scores carry gradient. logits fp32 [m, n]; d_logits F32 or BF16 (out_bf16), written
// (zeros for the non-selected experts); ld: d_logits' row stride (0: n).
void router_backward(const float* logits, const int32_t* topk_idx, const float* d_topk_w, void* d_logits,
                     bool out_bf16, int64_t m, int64_t n, int64_t k, bool renormalize, float scaling,
                     void* stream = nullptr, int64_t ld = 0);

// ---- Quantile Balancing (balance.cu), the exact estimator of ops/moe/balance.hpp ---------------------------
// From the step's unbiased scores s [m, n] fp32 and the cutoff alpha [m] (router_forward's, from the bias the step
// routed with), writes b_new [n] = −β + mean(β) with β_j the (q+1)-th largest of s_ij − α_i (q = m·k/n,
// interpolated). Needs m > 0, 0 < k < n and m·n <= 2^31 (lm::Error otherwise).
void qb_update(const float* s, const float* alpha, float* b_new, int64_t m, int64_t n, int64_t k,
               void* stream = nullptr);

}  // namespace lm::ops::cuda

#pragma once
// Causal flash attention and the absorbed MLA decode (SPEC §3) on NVIDIA Hopper: host API. Plain C++ (no
// CUDA types), so CPU code and tests include it without the CUDA headers. Tensor pointers are device
// pointers; shapes and cu_seqlens are host values.
//
// Legend: B batch, T tokens, H query heads, Hkv kv heads (H % Hkv == 0; MLA: Hkv == H), Dk q/k head dim,
//         Dv v head dim, N sequences (varlen), Tc cached positions, R kv_lora_rank, Dr rope dim.
// Layouts as lm::ops::attention_forward (ops/attention/attention.hpp), in bf16:
//   q [rows, H, Dk]; k [rows, Hkv, Dk]; v [rows, Hkv, Dv]; o, do [rows, H, Dv]; dq, dk, dv like q, k, v;
//   lse [rows, H] fp32, natural log of the softmax denominator of the scaled scores.
// Supported head dims: (Dk, Dv) = (192, 128) (MLA) and (128, 128). Softmax statistics in fp32.
// Varlen: B == 1 and a HOST array cu_seqlens of N + 1 row offsets; attention never crosses a boundary.
#include <cstddef>
#include <cstdint>

namespace lm::ops::cuda {

// Kernels: Auto = Wgmma, the Hopper warpgroup-MMA kernels (fwd_wgmma.cu; bwd_wgmma.cu: 128-key blocks, two
// compute warpgroups); Mma = the mma.sync FlashAttention-2 kernels (fwd.cu, bwd.cu), kept for comparison and
// tests. (A 64-key wgmma backward with a separate dQ warpgroup measured 0.6-0.9x the 128-key one and was removed.)
enum class FwdKernel { Auto, Mma, Wgmma };
enum class BwdKernel { Auto, Mma, Wgmma };

struct AttnShape {
  int64_t B = 1, T = 0, H = 1, Hkv = 0, Dk = 192, Dv = 128;  // Hkv == 0 means Hkv = H
  const int64_t* cu_seqlens = nullptr;                        // host, N + 1 entries, or null
  int64_t N = 0;
  float scale = 0.f;  // 0 means Dk^-1/2
  FwdKernel fwd_kernel = FwdKernel::Auto;
  BwdKernel bwd_kernel = BwdKernel::Auto;
};

// o and lse written (lse may be null when no backward follows).
void attention_forward(const AttnShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                       void* stream = nullptr);
// Gradients of L = Σ o ⊙ do from the forward's o and lse; dq, dk, dv written (not accumulated). Scratch (fp32
// dq accumulator, row statistics) comes from the stream-ordered allocator.
void attention_backward(const AttnShape& s, const void* q, const void* k, const void* v, const void* o,
                        const float* lse, const void* do_, void* dq, void* dk, void* dv, void* stream = nullptr);

// Absorbed MLA decode, one query per head against Tc cached positions (all visible), as
// lm::ops::mla_decode_absorbed: s_h[t] = scale·(q_lat[h]·c[t] + q_rope[h]·k_r[t]), o_lat[h] = Σ_t p_h[t] c[t].
// q_lat [H, R] bf16, q_rope [H, Dr] bf16, cache [Tc, ldc] bf16 with c = columns [0, R) and k_r = columns
// [R, R + Dr) (the 576-wide latent cache: R = 512, Dr = 64, ldc = 576); o_lat [H, R] bf16; lse [H] fp32
// (nullable). R == 512 and Dr == 64 only. Split-K over Tc (split 0 = auto) with a log-sum-exp combine.
struct DecodeShape {
  int64_t H = 1, Tc = 0, R = 512, Dr = 64, ldc = 0;  // ldc 0 means R + Dr
  float scale = 0.f;                                 // 0 means 192^-1/2 (the MLA head dim)
  int splits = 0;
};
void mla_decode(const DecodeShape& s, const void* q_lat, const void* q_rope, const void* cache, void* o_lat,
                float* lse, void* stream = nullptr);

}  // namespace lm::ops::cuda

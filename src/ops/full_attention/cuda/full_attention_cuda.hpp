#pragma once
// Full (non-causal) varlen softmax attention on the GPU, inside each image or clip (the CPU definition, math and
// layouts in ops/full_attention/full_attention.hpp). Plain C++ (no CUDA types); device pointers (cu_seqlens
// excepted: host); stream is a cudaStream_t (null: default stream).
//
// Legend: rows packed tokens, N media with row offsets cu_seqlens = {0, T_0, T_0+T_1, ..., rows} (HOST), H heads,
//         Dh head dim (a multiple of 8, <= 128), Q = H·Dh.
// dtypes: q, k, v, dq, dk, dv bf16 [rows, ld_qkv] (head h at columns h·Dh .. h·Dh + Dh; typically q, k, v are
//         column slices at 0, Q, 2Q of one [rows, 3Q] buffer, and dq, dk, dv of its gradient); o, do bf16
//         [rows, ld_o]; lse fp32 [rows, H]. Math and accumulation fp32.
//   S_ts = scale · q_t·k_s,  P = softmax_s(S),  o_t = Σ_s P_ts v_s,  lse_t = log Σ_s exp(S_ts)  (t, s in one media)
//   backward, Δ_t = do_t·o_t:  dS = P ⊙ (do vᵀ − Δ),  dq = scale · dS k,  dk = scale · dSᵀ q,  dv = Pᵀ do.
// Flash style (64-row tiles, online softmax; never T×T); deterministic (fixed orders, no atomics). One launch per
// kernel covers all media (the media table travels as a kernel argument). dq, dk, dv written (their H·Dh columns;
// other columns untouched), not accumulated; rows of media of length 0 are not touched.
#include <cstdint>

namespace lm::ops::cuda {

struct FullAttnShape {
  int64_t H = 1, Dh = 64;
  const int64_t* cu_seqlens = nullptr;  // HOST, N + 1 row offsets
  int64_t N = 0;
  int64_t ld_qkv = 0;  // row stride of q, k, v (and dq, dk, dv) in elements (0: H·Dh)
  int64_t ld_o = 0;    // row stride of o, do (0: H·Dh)
  float scale = 0.f;   // 0: Dh^-1/2
  // false: the mma.sync tensor-core kernels (P and dS enter their products as bf16) whenever ld_qkv and ld_o are
  // multiples of 8 and every pointer is 16-byte aligned, else the fp32 CUDA-core kernels; true: always the latter
  // (tests, a second opinion).
  bool cuda_cores = false;
};

// o [rows, ld_o] bf16 and lse [rows, H] fp32 written.
void full_attention_forward(const FullAttnShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                            void* stream = nullptr);

// From the forward's o and lse; dq, dk, dv written. Scratch: rows·H fp32 (Δ), stream-ordered (cudaMallocAsync).
void full_attention_backward(const FullAttnShape& s, const void* q, const void* k, const void* v, const void* o,
                             const float* lse, const void* do_, void* dq, void* dk, void* dv, void* stream = nullptr);

}  // namespace lm::ops::cuda

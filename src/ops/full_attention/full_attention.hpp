#pragma once
// Full (non-causal) softmax attention over packed sequences: the vision tower's attention inside each image or
// clip (SPEC §9). The text model's causal attention is ops/attention.
//
// Legend: rows packed tokens, N sequences (images / clips) with boundaries cu_seqlens = {0, T_0, T_0+T_1, ...,
//         rows}, T_n the length of sequence n, H heads, D head dim, Bq query rows per tile.
// Layouts (row-major, head h at columns h·D .. h·D + D): q, k, v, dq, dk, dv [rows, ld_qkv] (so the three can be
//         column slices of one fused [rows, 3·H·D] projection); o, do [rows, ld_o]; lse [rows, H].
// Math, per sequence n and head h, for t, s in sequence n:
//   S_ts = scale · q_t·k_s,  P = softmax_s(S),  o_t = Σ_s P_ts v_s,  lse_t = log Σ_s exp(S_ts).
// Backward of L = Σ o ⊙ do, with Δ_t = do_t·o_t:
//   dP = do vᵀ,  dS = P ⊙ (dP − Δ),  dq = scale · dS k,  dk = scale · dSᵀ q,  dv = Pᵀ do.
// The fast path computes a Bq×T_n score tile per (sequence, head, query tile) with GEMMs, never T_n×T_n; the
// backward recomputes P from lse and owns one (sequence, head) per work item, so dK and dV need no locks.
#include <cstdint>

namespace lm::ops {

struct FullAttnDims {
  int64_t H = 1, D = 0;
  const int64_t* cu_seqlens = nullptr;  // N + 1 entries, required
  int64_t N = 0;
  int64_t ld_qkv = 0, ld_o = 0;  // 0 means H·D
  int64_t rows() const { return cu_seqlens ? cu_seqlens[N] : 0; }
  int64_t ldqkv() const { return ld_qkv ? ld_qkv : H * D; }
  int64_t ldo() const { return ld_o ? ld_o : H * D; }
};
void check_full_attn_dims(const FullAttnDims& d);  // lm::Error on bad dims, strides or boundaries

// The definition (double internally; T_n×T_n scores; tests only). o written; lse nullable.
template <class F>
void full_attention_reference(const F* q, const F* k, const F* v, F* o, F* lse, const FullAttnDims& d, F scale);

// o [rows, ld_o] and lse [rows, H] written (lse is needed by the backward).
template <class F>
void full_attention_forward(const F* q, const F* k, const F* v, F* o, F* lse, const FullAttnDims& d, F scale);

// dq, dk, dv [rows, ld_qkv] written (their H·D columns; other columns untouched), from the forward's o and lse.
template <class F>
void full_attention_backward(const F* q, const F* k, const F* v, const F* o, const F* lse, const F* do_, F* dq, F* dk,
                             F* dv, const FullAttnDims& d, F scale);

}  // namespace lm::ops

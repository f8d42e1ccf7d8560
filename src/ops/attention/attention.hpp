#pragma once
// Causal softmax attention on the CPU, shaped for MLA (SPEC §3): public API.
//
// Legend: T tokens (B·T rows, or the packed total with cu_seqlens), H query heads, Hkv key/value heads
//         (H % Hkv == 0; MLA expands the latent per head, so Hkv == H there), Dk q/k head dim, Dv v head dim,
//         Bq/Bk query/key tile sizes, N sequences when packed; decode: Tc cached positions, R kv_lora_rank,
//         Dr rope (shared key) dim.
// Layouts (row-major): q [rows, H, Dk]; k [rows, Hkv, Dk]; v [rows, Hkv, Dv]; o, do [rows, H, Dv];
//                      lse [rows, H] (natural log of the softmax denominator of the scaled scores).
// Varlen: B == 1 and cu_seqlens = {0, T_0, T_0 + T_1, ..., T_total} (N + 1 entries); attention never
//         crosses a sequence boundary.
// Math: o_t = Σ_{s ≤ t} softmax_s(scale · q_t·k_s) v_s, accumulated in F (fp32 for float, f64 for double).
//
// Paths: `attention_reference*` build the T×T scores (tests only); `attention_forward/backward` go tile by
// tile with an online softmax (FlashAttention-2), never holding more than a Bq×Bk score tile per thread.
#include <cstdint>

namespace lm::ops {

struct AttnDims {
  int64_t B = 1, T = 0, H = 1, Hkv = 0, Dk = 0, Dv = 0;  // Hkv == 0 means Hkv = H
  const int64_t* cu_seqlens = nullptr;                    // optional (varlen, B == 1)
  int64_t N = 0;                                          // number of sequences when cu_seqlens is set
  int64_t kv_heads() const { return Hkv > 0 ? Hkv : H; }
  int64_t rows() const { return B * T; }
  int64_t num_seqs() const { return cu_seqlens ? N : B; }
  int64_t seq_begin(int64_t n) const { return cu_seqlens ? cu_seqlens[n] : n * T; }
  int64_t seq_len(int64_t n) const { return cu_seqlens ? cu_seqlens[n + 1] - cu_seqlens[n] : T; }
};
void check_attn_dims(const AttnDims& d);  // throws lm::Error on inconsistent dims / cu_seqlens

// How the backward avoids write races between threads.
enum class AttnBwdSplit {
  Auto,     // PerHead when the (sequence, kv head) items balance over the threads, else TwoPass
  PerHead,  // one item per (sequence, kv head): one pass, dQ, dK, dV all owned by the item
  TwoPass,  // items per key tile (dK, dV), then per query tile (dQ; recomputes P and dP)
};

struct AttnConfig {
  int64_t bq = 0, bk = 0;  // tile sizes, 0 = tuned default (64, 64); bk must be a multiple of 16
  AttnBwdSplit split = AttnBwdSplit::Auto;
  int64_t group = 0;  // query (forward, dQ) or key (dK, dV) tiles per work item, 0 = default (4)
};

// ---- naive definitions (T×T scores; tests only) -------------------------------------------------
// lse may be null. Computed in double internally whatever F is.
template <class F>
void attention_reference(const F* q, const F* k, const F* v, F* o, F* lse, const AttnDims& d, F scale);
// Gradients of L = Σ o ⊙ do; dq, dk, dv written (not accumulated).
template <class F>
void attention_reference_backward(const F* q, const F* k, const F* v, const F* do_, F* dq, F* dk, F* dv,
                                  const AttnDims& d, F scale);

// ---- tiled (FlashAttention-2 style) ---------------------------------------------------------------
// o written; lse [rows, H] written when non-null (the backward needs it).
template <class F>
void attention_forward(const F* q, const F* k, const F* v, F* o, F* lse, const AttnDims& d, F scale,
                       const AttnConfig& cfg = {});
// From the forward's o and lse: dq, dk, dv written (not accumulated). No T×T buffer.
template <class F>
void attention_backward(const F* q, const F* k, const F* v, const F* o, const F* lse, const F* do_, F* dq, F* dk,
                        F* dv, const AttnDims& d, F scale, const AttnConfig& cfg = {});

// ---- MLA keys and values from the decompressed latent (SPEC §3) -------------------------------------------
// kv [rows, H, Dn + Dv] = cn W_kvbᵀ (per head k_nope then v); k_r rows [rows] with stride ld_kr (shared by the heads):
//   k [rows, H, Dn + Dr] = per head [k_nope | k_r],  v [rows, H, Dv].
template <class F>
void mla_split_kv(const F* kv, const F* k_r, int64_t ld_kr, F* k, F* v, int64_t rows, int64_t H, int64_t Dn,
                  int64_t Dr, int64_t Dv);
// Its transpose: dkv [rows, H, Dn + Dv] written from dk, dv; dk_r (stride ld_dkr) += Σ_h dk's rope part.
template <class F>
void mla_merge_dkv(const F* dk, const F* dv, F* dkv, F* dk_r, int64_t ld_dkr, int64_t rows, int64_t H, int64_t Dn,
                   int64_t Dr, int64_t Dv);

// ---- MLA absorbed decode over the latent cache (SPEC §3) ------------------------------------------
// One query per head against Tc cached positions (all visible):
//   s_h[t] = scale · (q_lat[h]·c[t] + q_rope[h]·k_r[t]),  p_h = softmax_t(s_h),  o_lat[h] = Σ_t p_h[t] c[t].
// q_lat [H, R] (W_UKᵀ q_nope, absorbed by the caller); q_rope [H, Dr]; c [Tc, R] with row stride ldc;
// k_r [Tc, Dr] with row stride ldkr (so one interleaved [Tc, R + Dr] cache serves both); o_lat [H, R];
// lse [H] (nullable). The cache streams in chunks of `chunk` positions with an online softmax; chunks are
// split over threads and merged by log-sum-exp. q_rope/k_r may be null when Dr == 0.
struct DecodeDims {
  int64_t H = 1, Tc = 0, R = 0, Dr = 0;
  int64_t ldc = 0, ldkr = 0;  // 0 means dense (R, Dr)
  int64_t chunk = 256;
};
template <class F>
void mla_decode_absorbed(const F* q_lat, const F* q_rope, const F* c, const F* k_r, F* o_lat, F* lse,
                         const DecodeDims& d, F scale);

// ---- MLA absorbed prefill (absorbed.cpp) ---------------------------------------------------------------
// Causal attention of n queries at positions p .. p+n-1 over latent rows [0, p+n) (the chunk's own rows
// already appended): qa [n, Hm, RD] = per head [q̃ ; q_rope]; cache [p+n, RD] = [c ; k_r]; o_lat [n, Hm, R]
// = Σ_t p_t c_t. Query tiles run in parallel with an online softmax over key tiles; no [n, T] buffer.
template <class F>
void mla_prefill_absorbed(const F* qa, const F* cache, int64_t p, int64_t n, int64_t Hm, int64_t R, int64_t Dr,
                          F scale, F* o_lat);

}  // namespace lm::ops

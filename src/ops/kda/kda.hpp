#pragma once
// Kimi Delta Attention (SPEC §2, §2.1, §2.2): public API of the operator on the CPU.
//
// Legend: B batch, T tokens per sequence, H heads, K key/query head dim, V value head dim,
//         C = 64 chunk length, 16-token sub-tiles, N sequences when packed (varlen, B == 1).
// Layouts (row-major): q, k, g [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H];
//                      states h0, ht, dht, dh0 [B or N, H, K, V] (K-first, as the golden op files).
// Varlen: B == 1 and cu_seqlens = {0, T_0, T_0 + T_1, ..., T_total} (N + 1 entries); the recurrent
// state restarts from h0[n] at each boundary and never crosses it.
//
// Pieces (each with forward and backward, templated on the float type F = float | double):
//   gate       g = -exp(A_log[h]) * softplus(x + dt_bias)            (softplus form, Kimi Linear)
//              g = lower_bound * sigmoid(exp(A_log[h]) * (x + dt_bias)) (bounded form, K3)
//   l2norm     y = x / sqrt(sum(x^2) + 1e-6) over each head's K channels
//   beta       b = sigmoid(x)
//   short conv y[t, c] = sum_w W[c, w] x[t - (W-1) + w, c], optional SiLU, zero history or a cache
//   core       the delta-rule recurrence on already-processed q, k (unit norm), v, g (log decay), beta.
// Core paths: `reference_*` token by token (the definition), `chunk_*` the chunked algorithm.
#include <cstdint>

namespace lm::kda {

enum class GateForm { Softplus, LowerBound };

struct GateParams {
  GateForm form = GateForm::LowerBound;
  double lower_bound = -5.0;  // used by the LowerBound form only; must be < 0
};

// Intra-chunk diagonal 16x16 sub-tile strategy (SPEC §2.1).
enum class DiagPath {
  Auto,     // Bounded when the gate is lower-bounded (and the bound keeps factors in range), else Exact
  Bounded,  // every tile a dense GEMM through the causal anchor G_first + 7.5 * lower_bound
  Exact,    // diagonal tiles pair by pair: exp(G_r - G_i) per pair and channel
};
const char* diag_path_name(DiagPath p);

// Shape of one call. For varlen, B == 1, T is the packed total and cu_seqlens has N + 1 entries.
struct Dims {
  int64_t B = 1, T = 0, H = 1, K = 0, V = 0;
  const int64_t* cu_seqlens = nullptr;  // optional
  int64_t N = 0;                        // number of sequences when cu_seqlens is set
  int64_t num_seqs() const { return cu_seqlens ? N : B; }
  int64_t seq_begin(int64_t n) const { return cu_seqlens ? cu_seqlens[n] : n * T; }  // in packed rows of [B*T]
  int64_t seq_len(int64_t n) const { return cu_seqlens ? cu_seqlens[n + 1] - cu_seqlens[n] : T; }
};
void check_dims(const Dims& d);  // throws lm::Error on inconsistent dims / cu_seqlens

// ---- pieces ----------------------------------------------------------------------------------
// rows = B*T tokens; x, g [rows, H, K]; A_log [H]; dt_bias [H*K].
template <class F>
void gate_forward(const F* x, const F* A_log, const F* dt_bias, F* g, int64_t rows, int64_t H, int64_t K,
                  GateParams p);
// dx [rows, H, K] is written; dA_log [H] and ddt_bias [H*K] are accumulated (+=).
template <class F>
void gate_backward(const F* x, const F* A_log, const F* dt_bias, const F* dg, F* dx, F* dA_log, F* ddt_bias,
                   int64_t rows, int64_t H, int64_t K, GateParams p);

// x, y [rows, D] with the norm over D (one head's channels): y = x / sqrt(sum x^2 + eps).
template <class F>
void l2norm_forward(const F* x, F* y, int64_t rows, int64_t D, F eps = F(1e-6));
template <class F>
void l2norm_backward(const F* x, const F* dy, F* dx, int64_t rows, int64_t D, F eps = F(1e-6));

template <class F>
void sigmoid_forward(const F* x, F* y, int64_t n);
template <class F>
void sigmoid_backward(const F* x, const F* dy, F* dx, int64_t n);  // dx = dy * s(1-s)

// Causal depthwise conv over packed rows. x, y [rows, Cch]; w [Cch, W]. Sequences as in Dims
// (use a Dims with H = 1, K = V = Cch, or cu_seqlens). `cache` [num_seqs, Cch, W-1] (nullable): the
// W-1 inputs preceding each sequence (oldest first); `silu` applies y = silu(conv(x)).
struct ConvDims {
  int64_t B = 1, T = 0, C = 0, W = 4;
  const int64_t* cu_seqlens = nullptr;
  int64_t N = 0;
};
template <class F>
void short_conv_forward(const F* x, const F* w, const F* cache, F* y, const ConvDims& d, bool silu);
// dx written; dw [Cch, W] accumulated (nullable); dcache [num_seqs, Cch, W-1] written if non-null.
template <class F>
void short_conv_backward(const F* x, const F* w, const F* cache, const F* dy, F* dx, F* dw, F* dcache,
                         const ConvDims& d, bool silu);
// Streaming: one new token per sequence. x, y [S, Cch]; cache [S, Cch, W-1] updated in place.
template <class F>
void short_conv_step(const F* x, const F* w, F* cache, F* y, int64_t S, int64_t Cch, int64_t W, bool silu);
// Copies the last W-1 inputs of each sequence (zero-padded on the left for short ones, after the
// given starting cache) into cache_out [num_seqs, Cch, W-1]: the state a decode step continues from.
template <class F>
void short_conv_final_cache(const F* x, const F* cache_in, F* cache_out, const ConvDims& d);

// ---- core ------------------------------------------------------------------------------------
// Forward inputs of the core recurrence (processed values). h0 may be null (zero state).
template <class F>
struct CoreInputs {
  const F* q = nullptr;     // [B, T, H, K], unit-norm rows
  const F* k = nullptr;     // [B, T, H, K], unit-norm rows
  const F* v = nullptr;     // [B, T, H, V]
  const F* g = nullptr;     // [B, T, H, K], log decay per channel (<= 0)
  const F* beta = nullptr;  // [B, T, H], in (0, 1)
  const F* h0 = nullptr;    // [B|N, H, K, V] or null
  F scale = F(0);           // K^-1/2 by convention
};
template <class F>
struct CoreGrads {
  F* dq = nullptr;     // [B, T, H, K]
  F* dk = nullptr;     // [B, T, H, K]
  F* dv = nullptr;     // [B, T, H, V]
  F* dg = nullptr;     // [B, T, H, K]
  F* dbeta = nullptr;  // [B, T, H]
  F* dh0 = nullptr;    // [B|N, H, K, V] (may be null)
};

// o [B,T,H,V]; ht [B|N,H,K,V] (nullable).
template <class F>
void reference_forward(const CoreInputs<F>& in, const Dims& d, F* o, F* ht);
// Gradients of L = sum(o * do) + sum(ht * dht); dht may be null (zero). All grads are written.
template <class F>
void reference_backward(const CoreInputs<F>& in, const Dims& d, const F* do_, const F* dht, const CoreGrads<F>& gr);

// Chunked algorithm (C = 64, 16-token sub-tiles). `gate` tells which diagonal paths are safe.
// chunk_states (optional) [chunk_state_count(d), K, V]: the state at the start of every chunk, which
// forward can save and backward then reuses instead of recomputing (training keeps it per layer).
int64_t chunk_state_count(const Dims& d);  // H · Σ_n ceil(len_n / 64)
template <class F>
void chunk_forward(const CoreInputs<F>& in, const Dims& d, F* o, F* ht, DiagPath path, GateParams gate,
                   F* chunk_states = nullptr);
template <class F>
void chunk_backward(const CoreInputs<F>& in, const Dims& d, const F* do_, const F* dht, const CoreGrads<F>& gr,
                    DiagPath path, GateParams gate, const F* chunk_states = nullptr);

// Resolves Auto and rejects Bounded where the bound does not keep the anchored factors finite.
DiagPath resolve_diag_path(DiagPath requested, GateParams gate);

// Single-token decode for S sequences: state [S, H, K, V] updated in place; q, k, g [S, H, K];
// v, o [S, H, V]; beta [S, H]. Same arithmetic as one step of reference_forward.
template <class F>
void decode_step(F* state, const F* q, const F* k, const F* v, const F* g, const F* beta, F* o, int64_t S,
                 int64_t H, int64_t K, int64_t V, F scale);

// ---- fused operator (what fla's chunk_kda computes with every in-kernel option on) ----------
// Raw inputs: q, k [B,T,H,K] before the L2 norm; g_raw [B,T,H,K] the gate input; beta_raw [B,T,H]
// logits; A_log [H]; dt_bias [H*K]. Used by `longmoe verify` on the golden op files.
template <class F>
struct FusedInputs {
  const F *q = nullptr, *k = nullptr, *v = nullptr, *g_raw = nullptr, *beta_raw = nullptr;
  const F *A_log = nullptr, *dt_bias = nullptr, *h0 = nullptr;
  F scale = F(0);
  GateParams gate;
};
template <class F>
struct FusedGrads {
  F *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg_raw = nullptr, *dbeta_raw = nullptr;
  F *dA_log = nullptr, *ddt_bias = nullptr, *dh0 = nullptr;
};
enum class CorePath { Reference, Chunked };
// chunk_states as for chunk_forward/chunk_backward (Chunked core only; ignored by the reference).
template <class F>
void fused_forward(const FusedInputs<F>& in, const Dims& d, F* o, F* ht, CorePath core, DiagPath diag,
                   F* chunk_states = nullptr);
template <class F>
void fused_backward(const FusedInputs<F>& in, const Dims& d, const F* do_, const F* dht, const FusedGrads<F>& gr,
                    CorePath core, DiagPath diag, const F* chunk_states = nullptr);

}  // namespace lm::kda

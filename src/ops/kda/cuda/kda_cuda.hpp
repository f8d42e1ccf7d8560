#pragma once
// KDA on NVIDIA Hopper (SPEC §2-§2.2): host API of the CUDA kernels. Plain C++ (no CUDA types), so CPU
// code and tests include it without the CUDA headers. Every tensor pointer is a device pointer.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C = 64 chunk, N sequences (varlen).
// The fused operator, as lm::kda::fused_forward / fused_backward on the CPU:
//   raw q, k [B,T,H,K] bf16 (L2-normalised in kernel, eps 1e-6 inside the sqrt), v [B,T,H,V] bf16,
//   g_raw [B,T,H,K] and beta_raw [B,T,H] (bf16 or f32, see GateDType) with A_log [H], dt_bias [H*K] f32;
//   o [B,T,H,V] bf16; states h0, ht, dht, dh0 [B|N,H,K,V] f32 (K-first).
// Gradients: dq, dk, dv bf16; dg_raw, dbeta_raw in the gate dtype; dA_log [H], ddt_bias [H*K], dh0 f32.
// Limits: K, V multiples of 8, at most 128 each. Internally K and V are padded to 64 or 128.
// Varlen: B == 1 and a HOST array cu_seqlens of N + 1 offsets; states restart at each boundary.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/kda/kda.hpp"

namespace lm::kda::cuda {

enum class GateDType { BF16, F32 };  // dtype of g_raw, beta_raw and of their gradients

struct Problem {
  int64_t B = 1, T = 0, H = 1, K = 0, V = 0;
  const int64_t* cu_seqlens = nullptr;  // host pointer, N + 1 entries, or null
  int64_t N = 0;
  GateParams gate;
  DiagPath diag = DiagPath::Auto;  // resolved like the CPU path (Bounded needs -10 <= lower_bound < 0)
  float scale = 0.f;               // 0 means K^-1/2
  GateDType gate_dtype = GateDType::BF16;
  int64_t beta_ld = 0;  // row stride per token of beta_raw and dbeta_raw in elements (0: H, dense)
};

struct Inputs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g_raw = nullptr, *beta_raw = nullptr;
  const float *A_log = nullptr, *dt_bias = nullptr;
  const float* h0 = nullptr;  // nullable (zero state)
};

struct Grads {
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg_raw = nullptr, *dbeta_raw = nullptr;
  float *dA_log = nullptr, *ddt_bias = nullptr;
  float* dh0 = nullptr;  // nullable
};

// `stream` is a cudaStream_t (null: the default stream). Scratch memory comes from the stream-ordered
// allocator. ht may be null.
// `saved` (training): device memory of saved_bytes(p) bytes, owned by the caller, where the forward leaves what
// backward() would otherwise recompute (the intra-chunk tensors and the state at every chunk start). It then
// computes o as the backward's recomputation does (bf16 products; without `saved`, o's products with E run in
// fp16, a little closer to fp32).
// `started` (nullable, a cudaEvent_t created with timing disabled): recorded by the launch of the recurrence as a
// programmatic event that fires once all its blocks have begun, so another stream can wait for it and fill the SMs
// the recurrence leaves idle without delaying it (as the GPU model does).
size_t saved_bytes(const Problem& p);
void forward(const Problem& p, const Inputs& in, void* o, float* ht, void* stream = nullptr, void* saved = nullptr,
             void* started = nullptr);
// Gradients of L = sum(o * do) + sum(ht * dht); dht may be null (zero). Recomputes the forward, or, given the
// `saved` of a forward with the same problem and inputs, starts from it (the same gradients bit for bit).
void backward(const Problem& p, const Inputs& in, const void* do_, const float* dht, const Grads& gr,
              void* stream = nullptr, const void* saved = nullptr, void* started = nullptr);

// One token for each of S sequences (the recurrence of SPEC §2 in fp32): state [S,H,K,V] f32 updated in
// place; q, k, g_raw [S,H,K]; v, o [S,H,V]; beta_raw [S,H] (row stride beta_ld, 0: H). The same fused inputs as
// forward().
void decode_step(float* state, const Inputs& in, void* o, int64_t S, int64_t H, int64_t K, int64_t V,
                 GateParams gate, float scale = 0.f, GateDType gate_dtype = GateDType::BF16, void* stream = nullptr,
                 int64_t beta_ld = 0);

// ---- small runtime helpers (so that plain C++ callers need no CUDA headers) ----
int device_count();  // 0 when there is no usable device or driver (never throws)
void* device_alloc(size_t bytes);
void device_free(void* p);
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void device_fill(void* p, int byte, size_t bytes);
void synchronize();
void* stream_create();  // a non-blocking cudaStream_t
void stream_destroy(void* s);
void* event_create();  // a cudaEvent_t with timing disabled (as `started` needs)
void event_destroy(void* e);

// ---- stages, for benchmarks: forward() is prep (intra-chunk: gate, cumsum, norms, A_qk, A_kk, its
// inverse, W, U) followed by the sequential state pass with the output. run_forward_stage runs one of
// them over a scratch workspace it keeps between calls (release with release_bench_workspace).
// PrepBeforeTiles / PrepThroughTiles run prep up to the intra-chunk A tiles (gate, cumsum, norms) and through
// them: the difference of their times is the tile stage, where the bounded and exact diagonal paths differ.
// PrepThroughDiagonalTiles computes only the diagonal tiles there (bounded: MMAs, exact: pairwise).
enum class Stage { Prep, Recurrence, PrepBeforeTiles, PrepThroughTiles, PrepThroughDiagonalTiles };
void run_forward_stage(const Problem& p, const Inputs& in, void* o, Stage s, void* stream = nullptr);
void release_bench_workspace();

// Testing aid: runs the prep stage alone and returns its workspace tensors as float, chunk-padded
// (chunks of all sequences in order, padded rows and columns zero): W, U, Qg, Kd [NC,H,64,KP],
// A_qk [NC,H,64,64], Γ_last [NC,H,KP].
struct PrepDebug {
  int KP = 0, NC = 0;
  std::vector<float> W, U, Qg, Kd, Aqk, Gl;
};
PrepDebug debug_prep(const Problem& p, const Inputs& in);

}  // namespace lm::kda::cuda

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

// The same for S sequences at once over a paged latent cache (a batched decode step): q_lat [S, H, R],
// q_rope [S, H, Dr], o_lat [S, H, R] bf16. Sequence s's positions [64j, 64j + 64) lie in block table[s·table_ld + j]
// of `pool` [blocks, 64, ldc] bf16, and it attends to its first lens[s] + len_add positions. table and lens are
// DEVICE int32 arrays read when the kernel runs, so one launch (or one CUDA graph) serves caches that grow; the
// launch shape depends only on the PagedDecodeShape (splits position ranges per sequence, chosen from S, H and
// max_tokens when 0). workspace: mla_decode_paged_workspace() bytes of device memory.
struct PagedDecodeShape {
  int64_t S = 1, H = 1, R = 512, Dr = 64, ldc = 0;  // ldc 0 means R + Dr
  int64_t ldqr = 0;  // elements between q_rope's (sequence, head) rows, a multiple of 8 (0: Dr, dense)
  int64_t max_tokens = 0;  // the longest a sequence may be (table_ld >= ceil(max_tokens / 64))
  int64_t table_ld = 0;
  int len_add = 0;
  float scale = 0.f;  // 0 means 192^-1/2
  int splits = 0;
};
int mla_decode_paged_splits(const PagedDecodeShape& s);
size_t mla_decode_paged_workspace(const PagedDecodeShape& s);
void mla_decode_paged(const PagedDecodeShape& s, const void* q_lat, const void* q_rope, const void* pool,
                      const int32_t* table, const int32_t* lens, void* o_lat, void* workspace, void* stream = nullptr);

// ---- chunked prefill: a query chunk against one key block, and the log-sum-exp merge of the partials ----
// Legend: Tq queries of a chunk at absolute positions [q_pos0, q_pos0 + Tq), Tk keys of a block of the same
//         sequence at [k_pos0, k_pos0 + Tk), rows = Tq (the rows of a merge).
// Key j is visible to query i iff k_pos0 + j <= q_pos0 + i: a block wholly before the queries is fully visible
// (its tiles skip the mask), the chunk's own block (k_pos0 == q_pos0, Tk == Tq) is the causal case, a block at
// or after some query rows hides itself from them; key tiles that no row of a query tile sees are skipped.
// q [Tq, H, Dk], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv] bf16 dense, 16-byte aligned; o [Tq, H, Dv] bf16 and lse [Tq, H]
// fp32 (required; natural log of the softmax denominator of the scaled scores, as attention_forward). A row that
// sees no key gets o = 0, lse = −inf. (Dk, Dv) = (192, 128) or (128, 128); Hopper wgmma kernel only. Positions
// and counts < 2^30. One call may cover many blocks: [0, q_pos0 + Tq) at k_pos0 = 0 is a whole chunk's causal
// attention in one launch (no merge); split the keys only where they live in separate buffers.
struct BlockShape {
  int64_t Tq = 0, Tk = 0, q_pos0 = 0, k_pos0 = 0, H = 1, Dk = 192, Dv = 128;
  float scale = 0.f;  // 0 means Dk^-1/2
  int64_t Hkv = 0;    // 0 means H (MLA)
};
void attention_forward_block(const BlockShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                             void* stream = nullptr);
// Merges one block's partial into fp32 accumulators: o_part [rows, H, Dv] bf16, lse_part [rows, H] fp32 (as
// written by attention_forward_block), o_acc [rows, H, Dv] fp32 (16-byte aligned), lse_acc [rows, H] fp32.
// first: o_acc = o_part, lse_acc = lse_part; else both become the log-sum-exp merge of (o_acc, lse_acc) and
// (o_part, lse_part) (a side with lse = −inf weighs 0; both: lse −inf, o_acc unchanged). Dv % 4 == 0.
void attention_merge(int64_t rows, int64_t H, int64_t Dv, const void* o_part, const float* lse_part, float* o_acc,
                     float* lse_acc, bool first, void* stream = nullptr);
// o [rows, H, Dv] bf16 = o_acc fp32 (the merged lse is lse_acc itself).
void attention_merge_finish(int64_t rows, int64_t H, int64_t Dv, const float* o_acc, void* o, void* stream = nullptr);

}  // namespace lm::ops::cuda

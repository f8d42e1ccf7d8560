#pragma once
// Elementwise glue of the GPU model (model/cuda/*.cpp): casts, residual adds, the MLA k/v assembly, the sigmoid
// output gate, the expert weights' transpose and the gradient norm's sum of squares. Plain C++ (no CUDA types);
// device pointers; stream is a cudaStream_t as void*. (The fused AdamW update: train/cuda/adamw.hpp; Quantile
// Balancing: ops/moe/cuda/moe_cuda.hpp.)
//
// Legend: n elements, rows tokens, H MLA heads, Dn/Dr/Dv nope/rope/value head dims, R kv_lora_rank,
//         Dq = Dn + Dr, Dkv = Dn + Dv.
#include <cstdint>

namespace lm::model::cuda {

// y bf16 [n] = x fp32 [n]
void cast_f32_bf16(const float* x, void* y, int64_t n, void* stream = nullptr);
// y fp32 [n] += x fp32 [n]
void add_f32(float* y, const float* x, int64_t n, void* stream = nullptr);
// y fp32 [n] = base fp32 [n] + x bf16 [n] (base may be y)
void add_bf16(float* y, const float* base, const void* x, int64_t n, void* stream = nullptr);
// w bf16 [n] = N(0, sd) draws, a counter-based hash of (seed, i): random weights made on the device.
void fill_normal_bf16(void* w, int64_t n, float sd, uint64_t seed, void* stream = nullptr);

// k [rows, H, Dq] = per head [kv_nope | k_r], v [rows, H, Dv] = per head kv_value; kv bf16 [rows, H, Dkv];
// ckr fp32 [rows, R + Dr] (k_r = its columns R..R+Dr, shared by the heads). k, v bf16.
void mla_split_kv(const void* kv, const float* ckr, void* k, void* v, int64_t rows, int64_t H, int64_t Dn,
                  int64_t Dr, int64_t Dv, int64_t R, void* stream = nullptr);
// The adjoint: dkv [rows, H, Dkv] = per head [dk_nope | dv]; dckr bf16 [rows, R + Dr] columns R.. = Σ_h dk_rope
// (fp32 sum); columns < R untouched.
void mla_merge_dkv(const void* dk, const void* dv, void* dkv, void* dckr, int64_t rows, int64_t H, int64_t Dn,
                   int64_t Dr, int64_t Dv, int64_t R, void* stream = nullptr);

// The latent cache rows of MLA inference (model::GatedMla::cache_spec), [cn | bf16(k_r)] with cn bf16 [rows, R]
// (RMSNorm_kv(c)) and k_r = columns R.. of ckr fp32 [rows, R + Dr], written into a paged cache: pool bf16
// [blocks, 64, R + Dr], position p of sequence s in block table[s·table_ld + p / 64], row p % 64. Row r is
// sequence 0's position pos0 + r (a prefill: table is the sequence's row), or, with lens (device int32 [rows]),
// sequence r's position lens[r] (a decode step: one row per sequence).
void mla_latent_rows(const void* cn, const float* ckr, void* pool, const int32_t* table, int64_t table_ld,
                     const int32_t* lens, int64_t pos0, int64_t rows, int64_t R, int64_t Dr, void* stream = nullptr);
// The other way: positions [pos0, pos0 + rows) of one sequence (table: its row of block ids) read back from the pool
// as cn bf16 [rows, R] and ckr fp32 [rows, R + Dr] (columns R.. hold k_r; columns < R are not written).
void mla_latent_gather(const void* pool, const int32_t* table, int64_t pos0, int64_t rows, int64_t R, int64_t Dr,
                       void* cn, float* ckr, void* stream = nullptr);

// og = o ⊙ σ(g) (all bf16 [n]); backward from d_og fp32: d_o = d_og σ(g), d_g = d_og o σ(g)(1 − σ(g)) (bf16).
void sigmoid_gate_forward(const void* o, const void* g, void* og, int64_t n, void* stream = nullptr);
void sigmoid_gate_backward(const void* o, const void* g, const float* d_og, void* d_o, void* d_g, int64_t n,
                           void* stream = nullptr);

// dst [batch, cols, rows] = per batch the transpose of src [batch, rows, cols] (bf16): the expert weights in the
// layout of the backward's grouped products.
void transpose_bf16(const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols, void* stream = nullptr);

// Σ x² over n fp32 values, in double, deterministic (fixed blocks, fixed-order final sum). Synchronises.
double sum_squares(const float* x, int64_t n, void* stream = nullptr);

}  // namespace lm::model::cuda

#pragma once
// The KDA mixer's depthwise causal short convolution + SiLU on the GPU (kda::short_conv_forward/backward on
// the CPU, SPEC §2). Plain C++ (no CUDA types).
//
// Legend: B batch, T tokens, C channels (= H·K), W taps (<= 8), N sequences (varlen: B == 1 and a HOST
//         cu_seqlens of N + 1 entries). x, y, dy, dx bf16 [rows, C] (rows = B·T; x and dx with row stride ldx,
//         so they can be a column block of a wider matrix); w fp32 [C, W]; dw fp32
//         [C, W] accumulated (deterministic). No cache: every sequence starts from zeros.
//   y[t, c] = silu(Σ_{i<W} w[c, i] · x[t − (W−1) + i, c])   (positions before the sequence start are 0)
#include <cstdint>

namespace lm::kda::cuda {

struct ConvShape {
  int64_t B = 1, T = 0, C = 0, W = 4;
  int64_t ldx = 0;  // row stride of x and dx in elements (0: C)
  const int64_t* cu_seqlens = nullptr;  // host, N + 1 entries, or null
  int64_t N = 0;
};

void short_conv_forward(const void* x, const float* w, void* y, const ConvShape& s, bool silu = true,
                        void* stream = nullptr);
// dx written; dw accumulated (nullable).
void short_conv_backward(const void* x, const float* w, const void* dy, void* dx, float* dw, const ConvShape& s,
                         bool silu = true, void* stream = nullptr);

// Inference over the cache of model::KdaMixer::cache_spec: per sequence its last W−1 inputs, fp32 [C, W−1]
// (channel-major, oldest first), sequence s's at cache + s·cache_ld.
// One token for each of S sequences: y [S, C] bf16 from x [S, C] (row stride ldx) and the cached inputs, which
// then move on by one (x becomes the newest).
void short_conv_step(const void* x, int64_t ldx, const float* w, float* cache, int64_t cache_ld, void* y, int64_t S,
                     int64_t C, int64_t W, bool silu = true, void* stream = nullptr);
// The q, k and v convolutions of a KDA decode step in one launch: segment j = 0, 1, 2 is short_conv_step of the
// channels x + j·C (the three side by side in x's rows), weights w[j], output y[j] [S, C], and the caches of
// the three back to back ([3, C, W−1] per sequence). Bit for bit the three separate steps.
void short_conv_step3(const void* x, int64_t ldx, const float* const w[3], float* cache, int64_t cache_ld,
                      void* const y[3], int64_t S, int64_t C, int64_t W, bool silu = true, void* stream = nullptr);
// After a prefill of n tokens of one sequence from an empty cache (x [n, C], row stride ldx): cache = its last
// W−1 inputs (zeros before the sequence start; whatever the cache held is ignored, see short_conv_cache_append).
void short_conv_cache(const void* x, int64_t ldx, int64_t n, float* cache, int64_t C, int64_t W,
                      void* stream = nullptr);

// Chunked prefill: n more tokens of ONE sequence whose cache [C, W−1] holds its previous W−1 inputs (zeros for a
// fresh sequence). x [n, C] bf16 (row stride ldx >= C), y [n, C] bf16 dense, w fp32 [C, W].
//   y[t, c] = silu(Σ_{i<W} w[c, i] · x̃[t − (W−1) + i, c]),  x̃[τ] = x[τ] for τ >= 0, cache[c, W−1+τ] for τ < 0
// The outputs of short_conv_forward over the whole sequence at these positions, bit for bit (same kernel and
// order of the taps; the cache holds the bf16 inputs exactly). cache is only read (null or W == 1: zeros).
// ORDER: this reads the OLD cache, so run it before short_conv_cache_append of the same chunk (one stream).
void short_conv_forward_cached(const void* x, int64_t ldx, const float* w, const float* cache, void* y, int64_t n,
                               int64_t C, int64_t W, bool silu = true, void* stream = nullptr);
// Then the cache moves on by the chunk (x [n, C], row stride ldx): cache = the last W−1 inputs of the sequence so
// far. For n < W−1 the older cached inputs shift towards slot 0 and the last W−1−n of them stay; n == 0 or W == 1:
// nothing. From an all-zero cache the result equals short_conv_cache's.
void short_conv_cache_append(const void* x, int64_t ldx, int64_t n, float* cache, int64_t C, int64_t W,
                             void* stream = nullptr);

}  // namespace lm::kda::cuda

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
// After a prefill of n tokens of one sequence from an empty cache (x [n, C], row stride ldx): cache = its last
// W−1 inputs (zeros before the sequence start).
void short_conv_cache(const void* x, int64_t ldx, int64_t n, float* cache, int64_t C, int64_t W,
                      void* stream = nullptr);

}  // namespace lm::kda::cuda

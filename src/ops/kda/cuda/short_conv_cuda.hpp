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

}  // namespace lm::kda::cuda

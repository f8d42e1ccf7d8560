#pragma once
// LM head + cross-entropy on the GPU, chunked over token blocks so the [T, V] logits are never whole
// (ops/cross_entropy/cross_entropy.hpp). Plain C++ (no CUDA types).
//
// Legend: T tokens, d hidden, V vocabulary, Bt token block. h bf16 [T, d]; W bf16 [V, d]; targets int32
//         [T] on the DEVICE (< 0: ignored; every target < V, checked by the caller); dh fp32 [T, d];
//         dW fp32 [V, d]; logits block fp32 [Bt, V] (scratch from the stream-ordered allocator).
// Per token block: logits = h_b Wᵀ (cuBLAS, fp32 out); per row lse, loss = lse − logit[target];
//   G = grad_scale · (softmax − onehot(target)) (bf16, 0 rows for ignored tokens);
//   dh_b = G W;  dW += Gᵀ h_b.   FLOPs 6 T V d.
#include <cstdint>

namespace lm::ops::cuda {

struct CeResult {
  double loss_sum = 0;  // Σ loss_t over non-ignored tokens
  int64_t n_valid = 0;
};

// Training: loss and gradients. dh written; dW accumulated (nullable). token_block 0: auto (keeps the fp32
// logits block near 256 MiB). Synchronises the stream once at the end (to return the loss).
CeResult cross_entropy_forward_backward(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d,
                                        int64_t V, float grad_scale, float* dh, float* dW, int64_t token_block = 0,
                                        void* stream = nullptr);

// Evaluation: loss only.
CeResult cross_entropy_forward(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                               int64_t token_block = 0, void* stream = nullptr);

// Per-row forms (RL, rl/grpo.hpp: log p_t = −loss_t and a gradient weighted per token).
// row_loss: HOST fp32 [T] receives each row's loss (0 for ignored rows).
CeResult cross_entropy_rows(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                            float* row_loss, int64_t token_block = 0, void* stream = nullptr);
// G row t = row_scale[t] · (softmax − onehot) (row_scale DEVICE fp32 [T]); dh written, dW accumulated (nullable).
CeResult cross_entropy_backward_rows(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d,
                                     int64_t V, const float* row_scale, float* dh, float* dW, int64_t token_block = 0,
                                     void* stream = nullptr);

}  // namespace lm::ops::cuda

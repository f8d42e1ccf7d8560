#pragma once
// Token embedding on the GPU (ops/embedding/embedding.hpp). Plain C++ (no CUDA types).
//
// Legend: T tokens, vocab table rows, d hidden. ids [T] int32 on the DEVICE; table bf16 [vocab, d];
//         out fp32 [T, d] (the residual stream); dout fp32 [T, d]; dtable fp32 [vocab, d].
#include <cstdint>

namespace lm::ops::cuda {

// Ids must already be checked (< vocab) by the caller on the host.
void embedding_forward(const int32_t* ids, int64_t T, const void* table, int64_t d, float* out, void* stream = nullptr);

// dtable[ids[t]] += dout[t], deterministic: tokens grouped by id (a stable sort on the host of `host_ids`,
// uploaded), each table row summed over its tokens in token order, then added once. host_ids [T] are the
// same ids as a host array.
void embedding_backward(const int32_t* host_ids, int64_t T, const float* dout, int64_t vocab, int64_t d,
                        float* dtable, void* stream = nullptr);

}  // namespace lm::ops::cuda

#pragma once
// Row-major GEMM on the CPU through OpenBLAS, for float and double:
//   C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C
// op(X) = X or Xᵀ; lda/ldb/ldc are row strides of the matrices as stored.
// Called from inside OpenMP loops it runs single-threaded (OpenBLAS OpenMP flavour). float A Bᵀ with at most 8 rows
// (decode steps, short prefill pieces) runs a kernel of its own that does not repack B per call; each row's result
// is then the same whatever the row count or the thread count.
#include <cstdint>

namespace lm::ops {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc);

// Convenience for contiguous row-major operands: C = alpha * op(A) op(B) + beta * C.
template <class F>
inline void matmul(const F* A, bool trans_a, const F* B, bool trans_b, F* C, int64_t M, int64_t N, int64_t K,
                   F alpha = F(1), F beta = F(0)) {
  gemm(trans_a, trans_b, M, N, K, alpha, A, trans_a ? M : K, B, trans_b ? K : N, beta, C, N);
}

}  // namespace lm::ops

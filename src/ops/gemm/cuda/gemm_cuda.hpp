#pragma once
// Dense GEMMs on the GPU through cuBLAS (bf16 inputs, fp32 accumulation), row-major, for the model's linear
// layers and the chunked cross-entropy. Plain C++ (no CUDA types): device pointers and a cudaStream_t as void*.
//
// Legend: M, N, K the product dims; row-major A [M, K] (or [K, M] when ta), B [K, N] (or [N, K] when tb),
//         C [M, N]; lda, ldb, ldc row strides in elements (0: the dense stride).
//   C = alpha · op(A) · op(B) + beta · C,   op(X) = Xᵀ when its flag is set.
// A and B are bf16; C is bf16 or fp32 (c_type). Accumulation is fp32 either way.
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"

namespace lm::ops::cuda {

// c_src (nullable): the beta term reads c_src instead of C (same type and stride; C is then only written).
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
               const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType c_type, void* stream = nullptr,
               const void* c_src = nullptr);

// The few-row product (few_rows.cu) that gemm_bf16 takes for x · Wᵀ of one row (a batch-1 decode step; up to
// kFewRowsMax rows with LONGMOE_GEMM_FEW_ROWS, core/env.hpp):
//   y [M, N] = alpha · x [M, K] · W [N, K]ᵀ + beta · base   (base: nullable, then y itself; unread at beta 0)
// Launched for programmatic dependent launch (core/cuda/pdl.cuh). Returns false, doing nothing, where it does not
// apply (M outside 1..kFewRowsMax, K or a row stride not a multiple of 8, x or W not 16-byte aligned).
constexpr int64_t kFewRowsMax = 8;
bool gemm_bf16_few_rows(int64_t M, int64_t N, int64_t K, float alpha, const void* x, int64_t ldx, const void* W,
                        int64_t ldw, float beta, void* y, int64_t ldy, DType y_type, void* stream = nullptr,
                        const void* base = nullptr);

// Grouped: C_g = alpha · op(A_g) · op(B_g) + beta · C_g for every group g, each with its own sizes and pointers
// (row-major, strides as above; same transposes, alpha, beta and C dtype for all). One product per group, spread
// over a few side streams that the caller's stream then waits for; groups with M, N or K of 0 are skipped.
struct GemmGroup {
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* C = nullptr;
  int64_t ldc = 0;
};
void gemm_bf16_grouped(bool ta, bool tb, const std::vector<GemmGroup>& groups, float alpha, float beta, DType c_type,
                       void* stream = nullptr);

// Strided batch: C_b = alpha · op(A_b) · op(B_b) + beta · C_b for b < batch, one launch, where operand X_b starts
// sX elements after X_{b-1} (row-major, the same sizes and strides for all; e.g. per-head products whose heads lie
// side by side in rows, or per-head slices of one weight).
void gemm_bf16_strided_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                               int64_t lda, int64_t sA, const void* B, int64_t ldb, int64_t sB, float beta, void* C,
                               int64_t ldc, int64_t sC, int64_t batch, DType c_type, void* stream = nullptr);

// nn.Linear convention, W [out, in] bf16:
//   y [rows, out] (=|+=) x [rows, in] · Wᵀ;  with base (same type and stride as y): y = base + x · Wᵀ
void linear_fwd(const void* x, const void* W, void* y, DType y_type, int64_t rows, int64_t in, int64_t out,
                bool accumulate = false, void* stream = nullptr, int64_t ldx = 0, int64_t ldy = 0,
                const void* base = nullptr);
//   dx [rows, in] (=|+=) dy [rows, out] · W      (dx nullable)
//   dW [out, in] fp32 += dyᵀ · x                  (dW nullable)
void linear_bwd(const void* x, const void* W, const void* dy, void* dx, DType dx_type, float* dW, int64_t rows,
                int64_t in, int64_t out, bool accumulate_dx = false, void* stream = nullptr, int64_t ldx = 0,
                int64_t lddy = 0, int64_t lddx = 0);

// The cuBLAS handle of the calling thread, bound to `stream` (a cublasHandle_t as void*).
void* blas_handle(void* stream = nullptr);

}  // namespace lm::ops::cuda

#include "ops/gemm/gemm.hpp"

#include <cblas.h>

#include "core/parallel.hpp"

namespace lm::ops {

namespace {

// Lets core's parallel loops pin OpenBLAS to one thread (see core/parallel.hpp).
[[maybe_unused]] const bool g_blas_hook_installed = [] {
  blas_threads_hook() = [](int n) { openblas_set_num_threads(n); };
  return true;
}();

// K == 0: OpenBLAS rejects the zero leading dimensions that come with it; C = beta * C by hand.
template <class F>
bool empty_product(int64_t M, int64_t N, int64_t K, F beta, F* C, int64_t ldc) {
  if (K > 0) return false;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == F(0) ? F(0) : beta * C[i * ldc + j];
  return true;
}
}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || empty_product(M, N, K, beta, C, ldc)) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(M),
              static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B, static_cast<int>(ldb), beta,
              C, static_cast<int>(ldc));
}

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || empty_product(M, N, K, beta, C, ldc)) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(M),
              static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B, static_cast<int>(ldb), beta,
              C, static_cast<int>(ldc));
}

}  // namespace lm::ops

#include "ops/gemm/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <cstring>

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
// C = alpha * A Bᵀ + beta * C for a few rows of A (decode steps, the CPU server's short prefill pieces): OpenBLAS
// packs all of B (the weight) on every call, which took twice its multiply's time at 8 rows. Here each B row is
// read once from memory and used for every A row while it sits in L1. Every row is summed in the same order,
// alone or in a group, so a row's result does not depend on M (nor on the thread count).
constexpr int64_t kFewRows = 8;
using v8 = float __attribute__((vector_size(32)));

// (Macros, not functions: a 32-byte vector passed or returned changes the ABI where AVX is off.)
#define LM_LOAD8(v, p) std::memcpy(&(v), (p), sizeof(v8))

// R rows of A (a[r] = A + r * lda) against one row b of B: out[r] = dot(a[r], b), each in the order of R = 1.
template <int R>
inline void dots(const float* const* a, const float* b, int64_t K, float* out) {
  v8 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = v8{}, s1[r] = v8{};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v8 b0, b1, x0, x1;
    LM_LOAD8(b0, b + k);
    LM_LOAD8(b1, b + k + 8);
    for (int r = 0; r < R; ++r) {
      LM_LOAD8(x0, a[r] + k);
      LM_LOAD8(x1, a[r] + k + 8);
      s0[r] += x0 * b0;
      s1[r] += x1 * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    const v8 v = s0[r] + s1[r];
    float t = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
    for (int64_t j = k; j < K; ++j) t += a[r][j] * b[j];
    out[r] = t;
  }
}

#undef LM_LOAD8

void few_rows_abt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                  int64_t ldb, float beta, float* C, int64_t ldc) {
  constexpr int64_t kCols = 32;  // columns per work item
  const int64_t items = (N + kCols - 1) / kCols;
  parallel_for(
      items,
      [&](int64_t it) {
        const int64_t j1 = std::min(N, (it + 1) * kCols);
        for (int64_t j = it * kCols; j < j1; ++j) {
          const float* b = B + j * ldb;
          float d[kFewRows];
          for (int64_t i = 0; i < M; i += 4) {
            const float* a[4] = {A + i * lda, A + std::min(i + 1, M - 1) * lda, A + std::min(i + 2, M - 1) * lda,
                                 A + std::min(i + 3, M - 1) * lda};
            if (M - i >= 4) dots<4>(a, b, K, d + i);
            else if (M - i == 3) dots<3>(a, b, K, d + i);
            else if (M - i == 2) dots<2>(a, b, K, d + i);
            else dots<1>(a, b, K, d + i);
          }
          for (int64_t i = 0; i < M; ++i) {
            float& c = C[i * ldc + j];
            c = beta == 0.0f ? alpha * d[i] : alpha * d[i] + beta * c;
          }
        }
      },
      std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, M * K * kCols)));
}
}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || empty_product(M, N, K, beta, C, ldc)) return;
  if (!ta && tb && M <= kFewRows && K >= 16) return few_rows_abt(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
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

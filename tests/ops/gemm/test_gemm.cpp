// CPU GEMM (ops/gemm): every transpose pair against a float64 product, and the few-row path of A Bᵀ (decode steps,
// short prefill pieces) with strides, alpha, beta and K off its vector width; a row's result must not depend on how
// many rows come with it or on the thread count (the server's pieces and the decode batch rely on it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/parallel.hpp"
#include "ops/gemm/gemm.hpp"
#include "tests/testing.hpp"

using namespace lm;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

struct Case {
  bool ta, tb;
  int64_t M, N, K, pad;
  float alpha, beta;
};

// C = alpha op(A) op(B) + beta C in float64 from the float operands; lda/ldb/ldc = row length + pad.
std::vector<double> reference(const Case& c, const std::vector<float>& A, int64_t lda, const std::vector<float>& B,
                              int64_t ldb, const std::vector<float>& C0, int64_t ldc) {
  std::vector<double> C(C0.begin(), C0.end());
  for (int64_t i = 0; i < c.M; ++i)
    for (int64_t j = 0; j < c.N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < c.K; ++k)
        s += double(c.ta ? A[k * lda + i] : A[i * lda + k]) * double(c.tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = c.alpha * s + (c.beta == 0 ? 0.0 : c.beta * C[i * ldc + j]);
    }
  return C;
}

double run_case(const Case& c) {
  const int64_t lda = (c.ta ? c.M : c.K) + c.pad, ldb = (c.tb ? c.K : c.N) + c.pad, ldc = c.N + c.pad;
  const auto A = randn<float>(static_cast<size_t>((c.ta ? c.K : c.M) * lda), 1);
  const auto B = randn<float>(static_cast<size_t>((c.tb ? c.N : c.K) * ldb), 2);
  auto C = randn<float>(static_cast<size_t>(c.M * ldc), 3);
  const auto ref = reference(c, A, lda, B, ldb, C, ldc);
  ops::gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc);
  return rel_rms_vec(ref, std::vector<double>(C.begin(), C.end()));
}

}  // namespace

TEST(Gemm, EveryShapeAgainstFloat64) {
  std::vector<Case> cases;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t M : {1, 3, 4, 5, 8, 9, 40})
        for (int64_t K : {16, 19, 64, 257})
          cases.push_back({ta, tb, M, 70, K, M % 2 ? int64_t(3) : int64_t(0), M == 4 ? 0.5f : 1.0f,
                           K == 19 ? 0.75f : 0.0f});
  cases.push_back({false, true, 8, 4096, 256, 0, 1.0f, 0.0f});  // a decode step's vocabulary projection
  cases.push_back({false, true, 2, 1, 7, 0, 1.0f, 1.0f});      // below the few-row path's K
  for (const Case& c : cases) {
    const double e = run_case(c);
    EXPECT_LT(e, 1e-6) << "ta " << c.ta << " tb " << c.tb << " M " << c.M << " N " << c.N << " K " << c.K;
  }
}

TEST(Gemm, FewRowsNaNInCIsIgnoredWhenBetaIsZero) {
  const int64_t M = 3, N = 40, K = 32;
  const auto A = randn<float>(M * K, 4), B = randn<float>(N * K, 5);
  std::vector<float> C(M * N, std::numeric_limits<float>::quiet_NaN());
  ops::gemm(false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N);
  for (float v : C) ASSERT_TRUE(std::isfinite(v));
}

TEST(Gemm, ARowsResultDependsNeitherOnItsCompanyNorOnThreads) {
  const int64_t N = 300, K = 203;  // K leaves a scalar tail after the 16-wide steps
  const auto A = randn<float>(8 * K, 6), B = randn<float>(N * K, 7);
  const int saved = num_threads();
  std::vector<float> all(8 * N);
  ops::gemm(false, true, 8, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, all.data(), N);
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    for (int64_t M = 1; M <= 8; ++M)
      for (int64_t first = 0; first + M <= 8; first += M) {
        std::vector<float> part(static_cast<size_t>(M * N));
        ops::gemm(false, true, M, N, K, 1.0f, A.data() + first * K, K, B.data(), K, 0.0f, part.data(), N);
        EXPECT_EQ(std::memcmp(part.data(), all.data() + first * N, part.size() * sizeof(float)), 0)
            << "rows " << first << ".." << first + M - 1 << " with " << threads << " thread(s)";
      }
  }
  set_num_threads(saved);
}

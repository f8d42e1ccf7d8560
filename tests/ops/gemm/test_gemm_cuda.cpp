// Dense bf16 GEMMs on the GPU (ops/gemm/cuda: cuBLASLt with a timed algorithm choice, cublasGemmEx fallback)
// against a double-precision product of the same bf16 values. Skips without a CUDA device.
//
// Legend: row-major C [M, N] = alpha · op(A) · op(B) + beta · C; lda, ldb, ldc row strides in elements.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

struct Case {
  bool ta, tb;
  int64_t M, N, K, pad;  // pad: extra elements per row of A, B and C (odd pads misalign the rows)
  float beta;
  DType ct;
  int64_t row_step = 1;  // rows checked against the double product: every row_step-th (a large product's sample)
  bool c_src = false;    // beta reads C0 from a separate buffer (C holds other values and is only written)
};

// op(X)[r, c] of a row-major [rows, ld] matrix stored transposed when t.
double at(const Vec& x, int64_t ld, bool t, int64_t r, int64_t c) { return t ? x[c * ld + r] : x[r * ld + c]; }

void run(const Case& cs, uint64_t seed) {
  const int64_t ar = cs.ta ? cs.K : cs.M, ac = cs.ta ? cs.M : cs.K;  // A as stored
  const int64_t br = cs.tb ? cs.N : cs.K, bc = cs.tb ? cs.K : cs.N;
  const int64_t lda = ac + cs.pad, ldb = bc + cs.pad, ldc = cs.N + cs.pad;
  const Vec A = round_bf16(lm::testing::randn<float>(size_t(ar * lda), seed));
  const Vec B = round_bf16(lm::testing::randn<float>(size_t(br * ldb), seed + 1));
  const Vec C0 = round_bf16(lm::testing::randn<float>(size_t(cs.M * ldc), seed + 2));
  const float alpha = 0.75f;
  Vec ref, got;
  for (int64_t i = 0; i < cs.M; i += cs.row_step)
    for (int64_t j = 0; j < cs.N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < cs.K; ++k) acc += at(A, lda, cs.ta, i, k) * at(B, ldb, cs.tb, k, j);
      ref.push_back(float(alpha * acc + cs.beta * C0[size_t(i * ldc + j)]));
    }
  Dev dA(A.size() * 2), dB(B.size() * 2), dC(C0.size() * 4), dCsrc(cs.c_src ? C0.size() * 4 : 4);
  up_bf16(dA, A), up_bf16(dB, B);
  auto up_c = [&](Dev& d, const Vec& x) {
    if (cs.ct == DType::F32)
      up(d, x);
    else
      up_bf16(d, x);
  };
  auto down_c = [&](const Dev& d) { return cs.ct == DType::F32 ? down<float>(d, C0.size()) : down_bf16(d, C0.size()); };
  // With a separate source, C starts as other values (which must not leak into the result or its padding).
  Vec Cstart = C0;
  if (cs.c_src) {
    up_c(dCsrc, C0);
    for (float& x : Cstart) x = 7.f - 3.f * x;
    if (cs.ct == DType::BF16) Cstart = round_bf16(Cstart);
  }
  up_c(dC, Cstart);
  oc::gemm_bf16(cs.ta, cs.tb, cs.M, cs.N, cs.K, alpha, dA.p, lda, dB.p, ldb, cs.beta, dC.p, ldc, cs.ct, nullptr,
                cs.c_src ? dCsrc.p : nullptr);
  const Vec out = down_c(dC);
  if (cs.c_src) {
    ASSERT_EQ(down_c(dCsrc), C0) << "the C source was written";
  }
  for (int64_t i = 0; i < cs.M; i += cs.row_step)
    for (int64_t j = 0; j < cs.N; ++j) got.push_back(out[size_t(i * ldc + j)]);
  // The padding columns of C keep their values (no write past N).
  for (int64_t i = 0; i < cs.M; ++i)
    for (int64_t j = cs.N; j < ldc; ++j)
      ASSERT_EQ(out[size_t(i * ldc + j)], Cstart[size_t(i * ldc + j)]) << "C padding written at " << i << "," << j;
  const double e = err(ref, got);
  std::printf("gemm ta%d tb%d M%lld N%lld K%lld pad%lld beta %.0f%s %s, %zu rows checked: %.2e\n", cs.ta, cs.tb,
              (long long)cs.M, (long long)cs.N, (long long)cs.K, (long long)cs.pad, cs.beta,
              cs.c_src ? " (separate C source)" : "", cs.ct == DType::F32 ? "f32" : "bf16", ref.size() / size_t(cs.N),
              e);
  EXPECT_LT(e, cs.ct == DType::F32 ? 1e-5 : 5e-3);
}

TEST(GemmCuda, EveryLayoutAgainstDoubleReference) {
  REQUIRE_GPU();
  uint64_t seed = 11;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const DType ct : {DType::F32, DType::BF16}) {
        run({ta, tb, 192, 320, 256, 0, 0.f, ct}, seed += 3);   // tile-aligned, fresh output
        run({ta, tb, 77, 136, 264, 8, 1.f, ct}, seed += 3);    // ragged M, padded rows, accumulate
        run({ta, tb, 37, 50, 24, 1, 1.f, ct}, seed += 3);      // odd strides: 2-byte aligned rows
      }
}

// beta reading a separate C source (the model's residual states: state_out = state_in + x · Wᵀ), on the cuBLASLt
// path with a padded, misaligned stride too, and with beta 0 (the source is then ignored).
TEST(GemmCuda, SeparateCSource) {
  REQUIRE_GPU();
  for (const DType ct : {DType::F32, DType::BF16}) {
    run({false, true, 300, 256, 192, 0, 1.f, ct, 1, true}, 41);
    run({false, false, 77, 136, 264, 1, 1.f, ct, 1, true}, 43);
    run({true, false, 64, 96, 128, 0, 0.f, ct, 1, true}, 47);
  }
}

// The same problem twice (the second call reuses the chosen algorithm) and after a different one in between.
TEST(GemmCuda, RepeatedProblemsGiveTheSameResult) {
  REQUIRE_GPU();
  run({false, true, 256, 384, 512, 0, 0.f, DType::F32}, 101);
  run({true, false, 384, 512, 256, 0, 1.f, DType::F32}, 202);
  run({false, true, 256, 384, 512, 0, 0.f, DType::F32}, 303);
}

// A product large enough for the timed algorithm choice (2·M·N·K >= 1e10), accumulating into fp32 as the model's
// residual projections do; checked on every 85th row (a full double reference would take seconds).
TEST(GemmCuda, LargeProductWithTimedChoice) {
  REQUIRE_GPU();
  run({false, true, 4096, 1024, 1280, 0, 1.f, DType::F32, 85}, 7);
}

}  // namespace

// The strided batch in the MLA decode step's two shapes (per-head slices of q against per-head slices of one
// weight; the heads' outputs side by side), against a double product per head; other rows of C are not written.
TEST(GemmCuda, StridedBatchAgainstDoubleReference) {
  REQUIRE_GPU();
  struct SB {
    bool tb;
    int64_t S, H, N, K, lda, sA, ldb, sB;  // C [S, H·N]: head h's block at column h·N
  };
  // q̃: A = q [S, H, 24] (K = 16 of each head's 24), B = rows h·40 .. of W [H·40, 72] (N = 72);
  // o: A = ō [S, H, 72], B = rows h·40 + 16 .. +24 of the same W, transposed (N = 24, K = 72).
  for (const SB& c : {SB{false, 5, 3, 72, 16, 3 * 24, 24, 72, 40 * 72}, SB{true, 7, 4, 24, 72, 4 * 72, 72, 72, 40 * 72},
                      SB{false, 1, 32, 512, 128, 32 * 192, 192, 512, 256 * 512}}) {
    for (const DType ct : {DType::F32, DType::BF16}) {
      const int64_t ldc = c.H * c.N + 8, rowsB = c.H * c.sB / c.ldb + 64;
      const Vec A = round_bf16(lm::testing::randn<float>(size_t(c.S * c.lda), 71));
      const Vec B = round_bf16(lm::testing::randn<float>(size_t(rowsB * c.ldb), 72));
      Dev dA(A.size() * 2), dB(B.size() * 2), dC(size_t(c.S * ldc) * 4);
      up_bf16(dA, A), up_bf16(dB, B);
      const Vec C0(size_t(c.S * ldc), 5.f);
      if (ct == DType::F32) up(dC, C0);
      else up_bf16(dC, C0);
      const int64_t off = c.tb ? 16 * c.ldb : 0;  // (the o shape reads each head's rows after its first 16)
      oc::gemm_bf16_strided_batched(false, c.tb, c.S, c.N, c.K, 1.f, dA.p, c.lda, c.sA,
                                    static_cast<const uint16_t*>(dB.p) + off, c.ldb, c.sB, 0.f, dC.p, ldc, c.N, c.H,
                                    ct);
      const Vec out = ct == DType::F32 ? down<float>(dC, C0.size()) : down_bf16(dC, C0.size());
      Vec ref, got;
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t s = 0; s < c.S; ++s)
          for (int64_t n = 0; n < c.N; ++n) {
            double acc = 0;
            for (int64_t k = 0; k < c.K; ++k) {
              const double b = c.tb ? B[size_t(off + h * c.sB + n * c.ldb + k)] : B[size_t(h * c.sB + k * c.ldb + n)];
              acc += double(A[size_t(s * c.lda + h * c.sA + k)]) * b;
            }
            ref.push_back(float(acc)), got.push_back(out[size_t(s * ldc + h * c.N + n)]);
          }
      for (int64_t s = 0; s < c.S; ++s)
        for (int64_t j = c.H * c.N; j < ldc; ++j) ASSERT_EQ(out[size_t(s * ldc + j)], 5.f) << "C padding written";
      const double e = err(ref, got);
      std::printf("strided batch tb%d S%lld H%lld N%lld K%lld %s: %.2e\n", c.tb, (long long)c.S, (long long)c.H,
                  (long long)c.N, (long long)c.K, ct == DType::F32 ? "f32" : "bf16", e);
      EXPECT_LT(e, ct == DType::F32 ? 1e-5 : 5e-3);
    }
  }
}

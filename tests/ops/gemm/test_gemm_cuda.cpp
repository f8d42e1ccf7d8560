// Dense bf16 GEMMs on the GPU (ops/gemm/cuda: cuBLASLt with a timed algorithm choice, cublasGemmEx fallback)
// against a double-precision product of the same bf16 values. Skips without a CUDA device.
//
// Legend: row-major C [M, N] = alpha · op(A) · op(B) + beta · C; lda, ldb, ldc row strides in elements.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
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

// The few-row product (few_rows.cu) that decode steps' projections take: every row count 1..8 against a double
// product of the same bf16 values, with fresh, accumulated (beta 1, in place) and separate-base outputs, bf16 and
// fp32, K neither a multiple of the 256-k warp step nor of the U-step batch, N not a multiple of the 16 rows a
// block covers, and a small N that splits K across warps. A row's bits must not depend on how many rows came
// with it (a sequence decoded alone or in a batch).
TEST(GemmCuda, FewRowsAgainstDoubleReferenceAndRowCountInvariant) {
  REQUIRE_GPU();
  struct FR {
    int64_t N, K, pad;
  };
  for (const char* mma : {"0", "1"}) {  // CUDA cores, then tensor cores (read at every launch)
    ::setenv(env::kGemmFewRowsMma, mma, 1);
    uint64_t seed = 500;
    for (const FR& c : {FR{4100, 2304, 0}, FR{36, 1064, 8}, FR{8, 8, 0}, FR{520, 4104, 16}}) {
      const int64_t ldx = c.K + c.pad, ldw = c.K + c.pad, ldy = c.N + 3;
      const Vec X = round_bf16(lm::testing::randn<float>(size_t(8 * ldx), seed += 7));
      const Vec W = round_bf16(lm::testing::randn<float>(size_t(c.N * ldw), seed += 7));
      const Vec B0 = round_bf16(lm::testing::randn<float>(size_t(8 * ldy), seed += 7));
      std::vector<double> dot(size_t(8 * c.N));  // x_i · w_j in double, once per case
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t j = 0; j < c.N; ++j)
          for (int64_t k = 0; k < c.K; ++k)
            dot[size_t(i * c.N + j)] += double(X[size_t(i * ldx + k)]) * W[size_t(j * ldw + k)];
      Dev dX(X.size() * 2), dW(W.size() * 2);
      up_bf16(dX, X), up_bf16(dW, W);
      for (const DType ct : {DType::F32, DType::BF16}) {
        const size_t es = ct == DType::F32 ? 4 : 2;
        auto up_c = [&](Dev& d, const Vec& v) { ct == DType::F32 ? up(d, v) : up_bf16(d, v); };
        auto down_c = [&](const Dev& d) {
          return ct == DType::F32 ? down<float>(d, B0.size()) : down_bf16(d, B0.size());
        };
        Vec row0_alone;
        for (int64_t M = 1; M <= oc::kFewRowsMax; ++M)
          for (int mode = 0; mode < 3; ++mode) {  // y = x·Wᵀ; y += 0.5·x·Wᵀ (in place); y = base + x·Wᵀ
            const float alpha = mode == 1 ? 0.5f : 1.f, beta = mode == 0 ? 0.f : 1.f;
            Dev dY(B0.size() * es), dBase(B0.size() * es);
            Vec start(B0.size(), 3.f);
            if (mode == 1) start = B0;
            up_c(dY, start), up_c(dBase, B0);
            ASSERT_TRUE(oc::gemm_bf16_few_rows(M, c.N, c.K, alpha, dX.p, ldx, dW.p, ldw, beta, dY.p, ldy, ct, nullptr,
                                               mode == 2 ? dBase.p : nullptr));
            const Vec out = down_c(dY);
            Vec ref, got;
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < c.N; ++j) {
                const double acc = dot[size_t(i * c.N + j)];
                ref.push_back(float(alpha * acc + (beta != 0.f ? B0[size_t(i * ldy + j)] : 0.0)));
                got.push_back(out[size_t(i * ldy + j)]);
              }
            for (int64_t i = 0; i < 8; ++i)  // rows past M and columns past N are not written
              for (int64_t j = 0; j < ldy; ++j)
                if (i >= M || j >= c.N) {
                  ASSERT_EQ(out[size_t(i * ldy + j)], start[size_t(i * ldy + j)]) << "wrote " << i << "," << j;
                }
            const double e = err(ref, got);
            EXPECT_LT(e, ct == DType::F32 ? 1e-5 : 5e-3)
                << mma << " M " << M << " N " << c.N << " K " << c.K << " mode " << mode;
            if (mode == 0) {
              const Vec row0(got.begin(), got.begin() + c.N);
              if (M == 1) row0_alone = row0;
              else ASSERT_EQ(row0, row0_alone) << "row 0 changed with " << M << " rows (N " << c.N << ")";
            }
          }
        std::printf("few rows (%s) N%lld K%lld pad%lld %s: M 1..8 x 3 modes checked\n", *mma == '1' ? "mma" : "fma",
                    (long long)c.N, (long long)c.K, (long long)c.pad, ct == DType::F32 ? "f32" : "bf16");
      }
    }
  }
  ::unsetenv(env::kGemmFewRowsMma);
  // Where it does not apply it declines (gemm_bf16 then takes cuBLAS): 9 rows, K or a stride not a multiple of 8.
  Dev d(1 << 16);
  EXPECT_FALSE(oc::gemm_bf16_few_rows(9, 16, 64, 1.f, d.p, 64, d.p, 64, 0.f, d.p, 16, DType::F32));
  EXPECT_FALSE(oc::gemm_bf16_few_rows(1, 16, 60, 1.f, d.p, 60, d.p, 60, 0.f, d.p, 16, DType::F32));
  EXPECT_FALSE(oc::gemm_bf16_few_rows(1, 16, 64, 1.f, d.p, 65, d.p, 64, 0.f, d.p, 16, DType::F32));
  // Through gemm_bf16 (the model's path): one row takes the few-row kernel by default, more rows (a padded x, an
  // odd stride that the few-row kernel declines) take cuBLAS.
  for (const DType ct : {DType::F32, DType::BF16}) {
    run({false, true, 1, 2304, 2304, 0, 0.f, ct}, 601);
    run({false, true, 5, 300, 520, 8, 1.f, ct, 1, true}, 603);
    run({false, true, 3, 50, 24, 1, 1.f, ct}, 605);
  }
}

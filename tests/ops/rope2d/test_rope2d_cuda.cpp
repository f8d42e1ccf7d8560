// 2-D RoPE on the GPU against the CPU fp32 path (ops/rope2d), in place on a strided bf16 x (a column slice of a
// wider [rows, 3Q] buffer, as q and k of the fused projection), from the CPU's table uploaded; the inverse turn
// returns the input. Skips without a CUDA device.
//
// Legend: rows tokens, H heads, Dh head dim, Q = H·Dh, ld = 3Q row stride.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/rope2d/cuda/rope2d_cuda.hpp"
#include "ops/rope2d/rope2d.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

TEST(OpsCuda, Rope2dForwardInverse) {
  REQUIRE_GPU();
  for (const int64_t Dh : {int64_t(32), int64_t(96), int64_t(12)}) {
    const int64_t rows = 333, H = 3, Q = H * Dh, ld = 3 * Q;
    // Two images: 9×25 and 12×9 patches; places within each image.
    std::vector<int32_t> prow(static_cast<size_t>(rows)), pcol(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const bool first = r < 225;
      const int64_t i = first ? r : r - 225, w = first ? 25 : 9;
      prow[size_t(r)] = int32_t(i / w), pcol[size_t(r)] = int32_t(i % w);
    }
    Vec cs(size_t(rows * Dh));
    ops::rope2d_table<float>(prow.data(), pcol.data(), rows, Dh, 10000.0, cs.data());
    const Vec x = round_bf16(randn(size_t(rows * ld), uint64_t(Dh), 1.0));
    Vec ref = x;
    ops::rope2d_apply<float>(ref.data(), rows, H, Dh, ld, cs.data());

    Dev gx(x.size() * 2), gcs(cs.size() * 4);
    up_bf16(gx, x), up(gcs, cs);
    const std::vector<uint8_t> before = bytes_of(gx, x.size() * 2);
    oc::rope2d_apply(gx.p, rows, H, Dh, ld, gcs.f());
    const Vec y = down_bf16(gx, x.size());
    const std::vector<uint8_t> after = bytes_of(gx, x.size() * 2);
    const double ef = err(cols(ref, rows, ld, Q), cols(y, rows, ld, Q));
    // The turn really moved the input (a no-op kernel would fail here, not pass by tolerance).
    const double moved = err(cols(x, rows, ld, Q), cols(ref, rows, ld, Q));
    oc::rope2d_apply(gx.p, rows, H, Dh, ld, gcs.f(), /*inverse=*/true);
    const Vec back = down_bf16(gx, x.size());
    kc::synchronize();
    const double eb = err(cols(x, rows, ld, Q), cols(back, rows, ld, Q));
    const size_t pads = pad_changes(before, after, rows, ld, Q, 2);
    std::printf("RoPE2D Dh%lld: forward %.2e (moved %.2e), forward+inverse vs input %.2e, pad changes %zu\n",
                (long long)Dh, ef, moved, eb, pads);
    EXPECT_LE(ef, kTolBf16);
    EXPECT_GT(moved, 0.1);
    EXPECT_LE(eb, kTolBf16);
    EXPECT_EQ(pads, 0u);
  }
}

TEST(OpsCuda, Rope2dRejectsBadShapes) {
  REQUIRE_GPU();
  Dev x(1024), cs(1024);
  EXPECT_THROW(oc::rope2d_apply(x.p, 4, 1, 6, 6, cs.f()), lm::Error);   // Dh not a multiple of 4
  EXPECT_THROW(oc::rope2d_apply(x.p, 4, 2, 8, 12, cs.f()), lm::Error);  // ld < H·Dh
}

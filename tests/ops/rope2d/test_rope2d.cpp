// 2-D RoPE: the table-driven kernel against the formula (float and double, strided rows), which pairs turn by
// column and which by row, and the inverse turn as the exact transpose (the backward).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "ops/rope2d/rope2d.hpp"
#include "tests/testing.hpp"

using namespace lm::ops;
using lm::testing::randn;

namespace {
struct Places {
  std::vector<int32_t> row, col;
};
Places places(int64_t rows) {
  Places p;
  for (int64_t r = 0; r < rows; ++r) p.row.push_back(static_cast<int32_t>((r * 7) % 13)), p.col.push_back(static_cast<int32_t>((r * 5) % 29));
  return p;
}
}  // namespace

TEST(Rope2d, MatchesTheFormula) {
  const int64_t rows = 37, H = 3, Dh = 16, ld = H * Dh + 5;  // strided: a column slice of a wider buffer
  const Places p = places(rows);
  const auto x = randn<double>(rows * ld, 3);
  std::vector<double> dense(rows * H * Dh), ref(dense.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < H * Dh; ++c) dense[r * H * Dh + c] = x[r * ld + c];
  rope2d_reference(dense.data(), ref.data(), rows, H, Dh, p.row.data(), p.col.data(), 10000.0);
  std::vector<double> cs(rows * Dh), y = x;
  rope2d_table(p.row.data(), p.col.data(), rows, Dh, 10000.0, cs.data());
  rope2d_apply(y.data(), rows, H, Dh, ld, cs.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < H * Dh; ++c) EXPECT_NEAR(y[r * ld + c], ref[r * H * Dh + c], 1e-13);
    for (int64_t c = H * Dh; c < ld; ++c) EXPECT_EQ(y[r * ld + c], x[r * ld + c]);  // untouched
  }
  std::vector<float> xf(x.begin(), x.end()), csf(rows * Dh);
  rope2d_table(p.row.data(), p.col.data(), rows, Dh, 10000.0, csf.data());
  rope2d_apply(xf.data(), rows, H, Dh, ld, csf.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < H * Dh; ++c) EXPECT_NEAR(xf[r * ld + c], ref[r * H * Dh + c], 1e-5);
}

TEST(Rope2d, PairsTurnByColumnThenRow) {
  // One token at row 2, column 3, Dh = 8 (J = 2): θ_0 = 1, θ_1 = 10000^(-1/2) = 0.01.
  const int32_t row = 2, col = 3;
  std::vector<double> cs(8), x{1, 0, 1, 0, 1, 0, 1, 0};
  rope2d_table(&row, &col, 1, 8, 10000.0, cs.data());
  rope2d_apply(x.data(), 1, 1, 8, 8, cs.data());
  const double ang[4] = {3 * 1.0, 2 * 1.0, 3 * 0.01, 2 * 0.01};  // pairs 0 (col), 1 (row), 2 (col), 3 (row)
  for (int m = 0; m < 4; ++m) {
    EXPECT_NEAR(x[2 * m], std::cos(ang[m]), 1e-15) << m;
    EXPECT_NEAR(x[2 * m + 1], std::sin(ang[m]), 1e-15) << m;
  }
}

TEST(Rope2d, InverseIsTheTranspose) {
  const int64_t rows = 20, H = 2, Dh = 12;
  const Places p = places(rows);
  std::vector<double> cs(rows * Dh);
  rope2d_table(p.row.data(), p.col.data(), rows, Dh, 10000.0, cs.data());
  const auto x = randn<double>(rows * H * Dh, 5), y = randn<double>(rows * H * Dh, 6);
  auto Rx = x, Rty = y;
  rope2d_apply(Rx.data(), rows, H, Dh, H * Dh, cs.data());
  rope2d_apply(Rty.data(), rows, H, Dh, H * Dh, cs.data(), true);
  EXPECT_NEAR(lm::testing::dot(Rx, y), lm::testing::dot(x, Rty), 1e-12);  // <R x, y> = <x, Rᵀ y>
  rope2d_apply(Rx.data(), rows, H, Dh, H * Dh, cs.data(), true);
  EXPECT_LT(lm::testing::rel_rms_vec(x, Rx), 1e-15);
  EXPECT_THROW(rope2d_apply(Rx.data(), rows, H, 6, H * 6, cs.data()), lm::Error);  // Dh not a multiple of 4
}

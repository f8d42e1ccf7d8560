// 2-D RoPE on the CPU (see rope2d.hpp). Legend: rows tokens, H heads, Dh head dim, J = Dh/4, ld row stride.
#include "ops/rope2d/rope2d.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {

namespace {

void check(const char* who, int64_t rows, int64_t H, int64_t Dh, int64_t ld) {
  LM_CHECK(rows >= 0 && H >= 1 && Dh >= 4 && Dh % 4 == 0, "{}: need rows >= 0, H >= 1 and Dh a multiple of 4, got "
           "rows={} H={} Dh={}", who, rows, H, Dh);
  LM_CHECK(ld >= H * Dh, "{}: row stride {} < H·Dh = {}", who, ld, H * Dh);
}

double theta_j(double theta, int64_t j, int64_t Dh) {
  return std::pow(theta, -4.0 * static_cast<double>(j) / static_cast<double>(Dh));
}

}  // namespace

template <class F>
void rope2d_table(const int32_t* row, const int32_t* col, int64_t rows, int64_t Dh, double theta, F* cs) {
  check("rope2d_table", rows, 1, Dh, Dh);
  const int64_t J = Dh / 4;
  parallel_for(
      rows,
      [&](int64_t r) {
        for (int64_t j = 0; j < J; ++j) {
          const double t = theta_j(theta, j, Dh);
          const double pc = static_cast<double>(col[r]) * t, pr = static_cast<double>(row[r]) * t;
          F* c = cs + (r * J + j) * 4;
          c[0] = static_cast<F>(std::cos(pc)), c[1] = static_cast<F>(std::sin(pc));
          c[2] = static_cast<F>(std::cos(pr)), c[3] = static_cast<F>(std::sin(pr));
        }
      },
      64);
}

template <class F>
void rope2d_apply(F* x, int64_t rows, int64_t H, int64_t Dh, int64_t ld, const F* cs, bool inverse) {
  check("rope2d_apply", rows, H, Dh, ld);
  const int64_t J = Dh / 4;
  const F sgn = inverse ? F(-1) : F(1);
  parallel_for(
      rows,
      [&](int64_t r) {
        const F* c = cs + r * J * 4;
        for (int64_t h = 0; h < H; ++h) {
          F* xh = x + r * ld + h * Dh;
          // channels (4j, 4j+1): pair 2j by the column angle; (4j+2, 4j+3): pair 2j+1 by the row angle.
          for (int64_t j = 0; j < J; ++j)
            for (int64_t s = 0; s < 2; ++s) {
              const F co = c[j * 4 + 2 * s], si = sgn * c[j * 4 + 2 * s + 1];
              F* z = xh + 4 * j + 2 * s;
              const F a = z[0], b = z[1];
              z[0] = a * co - b * si;
              z[1] = a * si + b * co;
            }
        }
      },
      16);
}

template <class F>
void rope2d_reference(const F* x, F* y, int64_t rows, int64_t H, int64_t Dh, const int32_t* row, const int32_t* col,
                      double theta) {
  check("rope2d_reference", rows, H, Dh, H * Dh);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t m = 0; m < Dh / 2; ++m) {
        const int64_t j = m / 2;
        const double pos = (m % 2 == 0) ? col[r] : row[r];  // even pair: column, odd pair: row
        const double phi = pos * theta_j(theta, j, Dh);
        const double a = static_cast<double>(x[(r * H + h) * Dh + 2 * m]);
        const double b = static_cast<double>(x[(r * H + h) * Dh + 2 * m + 1]);
        y[(r * H + h) * Dh + 2 * m] = static_cast<F>(a * std::cos(phi) - b * std::sin(phi));
        y[(r * H + h) * Dh + 2 * m + 1] = static_cast<F>(a * std::sin(phi) + b * std::cos(phi));
      }
}

#define LM_INST(F)                                                                                   \
  template void rope2d_table<F>(const int32_t*, const int32_t*, int64_t, int64_t, double, F*);      \
  template void rope2d_apply<F>(F*, int64_t, int64_t, int64_t, int64_t, const F*, bool);            \
  template void rope2d_reference<F>(const F*, F*, int64_t, int64_t, int64_t, const int32_t*, const int32_t*, double);
LM_INST(float)
LM_INST(double)
#undef LM_INST

}  // namespace lm::ops

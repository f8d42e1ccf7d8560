#pragma once
// Bias-free linear layers in the nn.Linear convention: W [out, in], y [rows, out] = x [rows, in] Wᵀ.
// Row strides (ld*) let a layer read or write a column slice of a wider buffer without copies.
#include <cstdint>

#include "ops/gemm/gemm.hpp"

namespace lm::model {

// y = x Wᵀ (+ y when accumulate).
template <class F>
inline void linear_forward(const F* x, const F* W, F* y, int64_t rows, int64_t in, int64_t out, bool accumulate = false,
                           int64_t ldx = 0, int64_t ldy = 0) {
  ops::gemm(false, true, rows, out, in, F(1), x, ldx ? ldx : in, W, in, accumulate ? F(1) : F(0), y, ldy ? ldy : out);
}

// dx (+)= dy W   (dx nullable);   dW += dyᵀ x   (dW nullable: frozen weight).
template <class F>
inline void linear_backward(const F* x, const F* W, const F* dy, F* dx, F* dW, int64_t rows, int64_t in, int64_t out,
                            bool accumulate_dx = false, int64_t ldx = 0, int64_t lddy = 0, int64_t lddx = 0) {
  const int64_t ldy = lddy ? lddy : out;
  if (dx) ops::gemm(false, false, rows, in, out, F(1), dy, ldy, W, in, accumulate_dx ? F(1) : F(0), dx, lddx ? lddx : in);
  if (dW) ops::gemm(true, false, out, in, rows, F(1), dy, ldy, x, ldx ? ldx : in, F(1), dW, in);
}

}  // namespace lm::model

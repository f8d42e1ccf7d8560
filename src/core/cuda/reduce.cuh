#pragma once
// Deterministic reductions for the CUDA kernels: butterfly sums and maxima over a warp (every lane ends with the
// same bits, a + b == b + a, in a fixed order), and column sums of per-block partials (the weight and gain
// gradients of the norms: ops/rmsnorm/cuda, ops/attnres/cuda) in a fixed order, in double.
#include <cstdint>

namespace lm::cu {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Two sums at once (their shuffles interleaved).
__device__ __forceinline__ float2 warp_sum(float2 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  return v;
}

// Σ_b part[b, j] over the nb rows of part [nb, ld], for the COLS columns of one block of COLS x SLICES threads:
// thread (slice s, column cx) of the block sums rows s, s + SLICES, ... of column j (its own; j < ld, or false
// `valid` for none) in order, in double, then the slices meet in a fixed tree in `acc` (the block's shared
// memory). The total of column cx is acc[0][cx] when this returns (every thread of the block must call it).
// A fixed order with SLICES times the parallelism of one thread per column (a serial chain of ~1000 rows per
// column was latency-bound: tens of µs).
template <int COLS, int SLICES>
__device__ __forceinline__ void column_sum(double (&acc)[SLICES][COLS], const float* part, int64_t nb, int ld, int j,
                                           bool valid, int s, int cx) {
  double sum = 0;
  if (valid) {
#pragma unroll 8
    for (int64_t b = s; b < nb; b += SLICES) sum += part[b * ld + j];
  }
  acc[s][cx] = sum;
#pragma unroll
  for (int half = SLICES / 2; half > 0; half >>= 1) {
    __syncthreads();
    if (s < half) acc[s][cx] += acc[s + half][cx];
  }
}

}  // namespace lm::cu

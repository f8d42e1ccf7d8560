// Quantile Balancing on the GPU (moe_cuda.hpp; the CPU estimators are ops/moe/balance.cpp): the exact estimator as
// one transpose to per-expert residual segments, a segmented descending radix sort (cub), and one block that reads
// each expert's order statistics and centres the bias. Scratch is stream-ordered (cudaMallocAsync).
//
// Legend: m tokens, n experts, k experts per token; q = m·k/n = Q + f (Q = floor, 0 <= f < 1) the target load.
//   r [n, m] = s[i, j] − alpha[i] by expert; sorted [n, m] each segment descending; off [n + 1] = j·m
//   β_j = (1 − f)·sorted_j[Q] + f·sorted_j[Q + 1] (ranks clamped to m − 1);  b_new = −β + mean(β)
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/stream.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace lm::ops::cuda {

namespace {

// (The messages name the model's glue, where this estimator was first written: the same text as before.)
constexpr cu::Checker qb_check{"model cuda"};

// QB: r [E, m] = s[i, j] − alpha[i] laid out by expert (segments for the sort).
__global__ void qb_residual_kernel(const float* s, const float* alpha, float* r, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / n, j = idx % n;  // read s row-major (coalesced), write transposed
    r[j * m + i] = s[idx] - alpha[i];
  }
}
// One block: β_j from the descending-sorted segments, b_new = −β + mean(β).
__global__ void qb_beta_kernel(const float* sorted, float* b_new, int64_t m, int n, int64_t Q, double f) {
  extern __shared__ float beta[];
  __shared__ double total;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float* col = sorted + int64_t(j) * m;
    const int64_t i1 = Q < m ? Q : m - 1, i2 = Q + 1 < m ? Q + 1 : m - 1;  // 0-based ranks Q+1, Q+2
    const double r1 = col[i1], r2 = col[i2];
    beta[j] = f == 0.0 ? static_cast<float>(r1) : static_cast<float>((1.0 - f) * r1 + f * r2);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += beta[j];
    total = sum / n;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) b_new[j] = static_cast<float>(-beta[j] + total);
}

__global__ void seg_offsets_kernel(int* off, int n, int m) {
  for (int j = threadIdx.x; j <= n; j += blockDim.x) off[j] = j * m;
}

}  // namespace

void qb_update(const float* s, const float* alpha, float* b_new, int64_t m, int64_t n, int64_t k, void* stream) {
  if (m <= 0 || n <= 0 || k <= 0 || k >= n) qb_check.fail("qb_update: needs m > 0 and 0 < k < n");
  if (m * n > (int64_t(1) << 31)) qb_check.fail("qb_update: m·n too large");
  cudaStream_t t = lm::cu::stream(stream);
  float *r = nullptr, *sorted = nullptr;
  int* off = nullptr;
  void* tmp = nullptr;
  size_t tmp_bytes = 0;
  qb_check(cu::malloc_async(&r, sizeof(float) * m * n, t), "qb alloc");
  qb_check(cu::malloc_async(&sorted, sizeof(float) * m * n, t), "qb alloc");
  qb_check(cu::malloc_async(&off, sizeof(int) * (n + 1), t), "qb alloc");
  const int64_t blocks = (m * n + 255) / 256;  // of 256 threads, at most 65535 · 16 (a grid-stride loop)
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
  qb_residual_kernel<<<grid, 256, 0, t>>>(s, alpha, r, m, n);
  seg_offsets_kernel<<<1, 256, 0, t>>>(off, int(n), int(m));
  qb_check(cudaGetLastError(), "qb_update");
  cub::DeviceSegmentedRadixSort::SortKeysDescending(nullptr, tmp_bytes, r, sorted, int(m * n), int(n), off, off + 1, 0,
                                                    32, t);
  qb_check(cu::malloc_async(&tmp, tmp_bytes, t), "qb alloc");
  qb_check(cub::DeviceSegmentedRadixSort::SortKeysDescending(tmp, tmp_bytes, r, sorted, int(m * n), int(n), off,
                                                             off + 1, 0, 32, t),
           "qb sort");
  // q = Q + f with Q = floor(m·k/n), f = ((m·k) mod n)/n, exactly as the CPU estimator.
  const int64_t Q = (m * k) / n;
  const double f = static_cast<double>((m * k) % n) / static_cast<double>(n);
  qb_beta_kernel<<<1, 256, sizeof(float) * n, t>>>(sorted, b_new, m, int(n), Q, f);
  qb_check(cudaGetLastError(), "qb_update");
  cudaFreeAsync(tmp, t), cudaFreeAsync(r, t), cudaFreeAsync(sorted, t), cudaFreeAsync(off, t);
}

}  // namespace lm::ops::cuda

#pragma once
// Device queries and settings shared by the CUDA code (host). The cached answers are per process and describe
// the device that was current at the first call (one device per process).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/env.hpp"

namespace lm::cu {

// CUDA devices visible to this process; 0 (with the sticky "no device" error cleared) without a device or driver.
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

// Streaming multiprocessors of the current device (persistent kernels' grids, occupancy-sized grids); 132, an
// H200's count, when the attribute cannot be read.
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
    return v > 0 ? v : 132;
  }();
  return n;
}

// cudaMallocAsync for per-call scratch. With LONGMOE_POISON_SCRATCH=1 the block is filled with 0xFF bytes (NaN in
// fp32 and bf16, -1 in integers) before use, so a kernel that reads scratch it did not write shows up instead of
// reading whatever the pool's last user left there (a debugging aid; off by default).
template <class T>
inline cudaError_t malloc_async(T** p, size_t bytes, cudaStream_t s) {
  static const bool poison = env::poison_scratch();
  const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(p), bytes, s);
  if (e != cudaSuccess || !poison || bytes == 0) return e;
  return cudaMemsetAsync(*p, 0xFF, bytes, s);
}

// Keeps memory freed by cudaFreeAsync in the current device's default pool (the default release threshold
// returns it to the driver at every synchronisation), so per-call scratch is reused instead of re-mapped.
inline void keep_freed_memory_in_pool() {
  static const bool done = [] {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess) {
      uint64_t thr = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
    }
    return true;
  }();
  (void)done;
}

// Device-to-device copy bandwidth in bytes/s (bytes read + written; ten 1 GiB copies timed with events): the
// physical limit a bandwidth-bound kernel is measured against in the same run. 0 if the buffers cannot be had.
inline double copy_bandwidth() {
  const size_t n = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  double bw = 0;
  if (cudaMalloc(&a, n) == cudaSuccess && cudaMalloc(&b, n) == cudaSuccess && cudaEventCreate(&e0) == cudaSuccess &&
      cudaEventCreate(&e1) == cudaSuccess) {
    constexpr int kReps = 10;
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);  // warm-up
    cudaEventRecord(e0, nullptr);
    for (int r = 0; r < kReps; ++r) cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, nullptr);
    cudaEventRecord(e1, nullptr);
    float ms = 0;
    if (cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0)
      bw = 2.0 * double(n) * kReps / (double(ms) * 1e-3);
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (a) cudaFree(a);
  if (b) cudaFree(b);
  cudaGetLastError();
  return bw;
}

}  // namespace lm::cu

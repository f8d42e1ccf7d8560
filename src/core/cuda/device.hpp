#pragma once
// Device queries and settings shared by the CUDA code (host). The cached answers are per process and describe
// the device that was current at the first call (one device per process).
#include <cuda_runtime_api.h>

#include <cstdint>

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

}  // namespace lm::cu

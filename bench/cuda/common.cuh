#pragma once
// Shared pieces of the CUDA benchmarks behind `longmoe bench {kda,attention,moe} --device cuda`: error checks,
// deterministic random device tensors, the median of CUDA-event timings, and RESULT lines (stdout, and a copy for
// the peer driver bench/peer_attention_moe.py when one is set).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/cuda/check.hpp"

namespace lm::bench_cuda {

// CK(call): a failed CUDA call throws lm::Error("bench cuda: <call>: <CUDA's error string>") (core/cuda/check.hpp).
inline constexpr cu::Checker kCheck{"bench cuda"};
#define CK(x) ::lm::bench_cuda::kCheck((x), #x)

__device__ inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return x;
}
// Normal(0, 1) from a hash of (seed, index): Box-Muller.
__device__ inline float normal(uint32_t seed, size_t i) {
  const uint32_t a = hash32(uint32_t(i) * 2u + seed * 0x9e3779b9u), b = hash32(uint32_t(i) * 2u + 1u + seed * 0x85ebca6bu);
  const float u1 = (float(a >> 8) + 1.f) / 16777217.f, u2 = float(b >> 8) / 16777216.f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}
// static: each benchmark file launches its own copy (no relocatable device code needed).
static __global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float sd) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(sd * normal(seed, i));
}
static __global__ void fill_f32(float* p, size_t n, uint32_t seed, float sd, float mean = 0.f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = mean + sd * normal(seed, i);
}

template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}
inline __nv_bfloat16* rand_bf16(size_t n, uint32_t seed, float sd = 1.f) {
  auto* p = dalloc<__nv_bfloat16>(n);
  fill_bf16<<<1024, 256>>>(p, n, seed, sd);
  CK(cudaGetLastError());
  return p;
}
inline float* rand_f32(size_t n, uint32_t seed, float sd, float mean = 0.f) {
  auto* p = dalloc<float>(n);
  fill_f32<<<1024, 256>>>(p, n, seed, sd, mean);
  CK(cudaGetLastError());
  return p;
}

// Median of `reps` CUDA-event timings (ms) after `warm` untimed runs.
template <class F>
double median_ms(F&& f, int warm, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Prints the device's name and SM count; false (after "no CUDA device") when there is none.
bool print_device();

// printf to stdout, and the same text to the results file when one is set (set_results_file).
void result(const char* fmt, ...);

}  // namespace lm::bench_cuda

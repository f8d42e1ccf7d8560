// Shared pieces of the CUDA benchmarks (common.cuh).
#include "bench/cuda/benches.hpp"
#include "bench/cuda/common.cuh"
#include "core/cuda/device.hpp"

namespace lm::bench_cuda {

namespace {
FILE* results_file = nullptr;
}

void set_results_file(FILE* f) { results_file = f; }

bool print_device() {
  if (cu::device_count() == 0) {
    std::printf("no CUDA device\n");
    return false;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  return true;
}

void result(const char* fmt, ...) {
  va_list a, b;
  va_start(a, fmt);
  va_copy(b, a);
  std::vfprintf(stdout, fmt, a);
  if (results_file) std::vfprintf(results_file, fmt, b);
  va_end(b);
  va_end(a);
}

}  // namespace lm::bench_cuda

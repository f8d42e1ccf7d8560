// Shared pieces of the CUDA benchmarks (common.cuh).
#include "bench/cuda/benches.hpp"
#include "bench/cuda/common.cuh"

namespace lm::bench_cuda {

namespace {
FILE* results_file = nullptr;
}

void set_results_file(FILE* f) { results_file = f; }

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

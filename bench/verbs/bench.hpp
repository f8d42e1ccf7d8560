#pragma once
// `longmoe bench <what>`: each benchmark (a file of bench/verbs/) registers itself as a nested verb of `bench`,
// a CLI verb like the others (apps/longmoe/commands.hpp); the CLI links these files as one object library.
#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "apps/longmoe/commands.hpp"

namespace lm::app {

std::vector<Command>& bench_registry();

struct RegisterBench {
  explicit RegisterBench(Command c) { bench_registry().push_back(std::move(c)); }
};

// Median wall time in seconds of `reps` runs of f after `warmup` runs.
inline double time_median(const std::function<void()>& f, int reps, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < std::max(reps, 1); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The CUDA benchmarks of bench/cuda ("kda", "attention", "moe"); `peer`: run the PyTorch peer driver in the same
// run. Throws lm::Error when built without CUDA or without a device.
int run_cuda_bench(const std::string& what, int reps, bool prof, bool peer);

// Measured fp32 GEMM rate of this machine (GFLOP/s) with all threads, square n x n x n.
double measure_sgemm_gflops(int n = 2048, int reps = 5);

}  // namespace lm::app

#pragma once
// OpenMP parallel loops. Bodies must not throw across the parallel region: exceptions are
// captured and re-thrown on the calling thread.
#include <omp.h>

#include <cstdint>
#include <exception>
#include <mutex>

namespace lm {

inline int num_threads() { return omp_get_max_threads(); }
inline void set_num_threads(int n) { if (n > 0) omp_set_num_threads(n); }

// The BLAS library's own thread count, set through a hook the GEMM layer installs (core does not
// link BLAS). Debian's OpenBLAS 0.3.21 (OpenMP flavour) does not drop to one thread when called from
// inside our parallel loops: concurrent calls then queue on its shared buffers and run many times
// slower. Every parallel loop below therefore pins BLAS to one thread for its duration.
using BlasThreadsHook = void (*)(int);
inline BlasThreadsHook& blas_threads_hook() {
  static BlasThreadsHook hook = nullptr;
  return hook;
}

// RAII: BLAS single-threaded inside, restored (with our OpenMP thread count) on exit.
class BlasSerialScope {
 public:
  BlasSerialScope() : threads_(num_threads()) {
    if (auto h = blas_threads_hook()) {
      h(1);
      omp_set_num_threads(threads_);  // OpenBLAS's setter also sets the caller's OpenMP count
    }
  }
  ~BlasSerialScope() {
    if (auto h = blas_threads_hook()) {
      h(threads_);
      omp_set_num_threads(threads_);
    }
  }
  BlasSerialScope(const BlasSerialScope&) = delete;
  BlasSerialScope& operator=(const BlasSerialScope&) = delete;

 private:
  int threads_;
};

// f(i) for i in [0, n), statically scheduled (deterministic partition for a given thread count).
template <class F>
void parallel_for(int64_t n, F&& f, int64_t min_per_thread = 1) {
  if (n <= 0) return;
  if (n < 2 * min_per_thread || omp_in_parallel() || num_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  BlasSerialScope blas_serial;
  std::exception_ptr err;
  std::mutex mu;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

// Dynamic schedule for uneven work items (e.g. varlen sequences × heads).
template <class F>
void parallel_for_dynamic(int64_t n, F&& f) {
  if (n <= 0) return;
  if (n == 1 || omp_in_parallel() || num_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  BlasSerialScope blas_serial;
  std::exception_ptr err;
  std::mutex mu;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace lm

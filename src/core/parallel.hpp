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

// f(i) for i in [0, n), statically scheduled (deterministic partition for a given thread count).
template <class F>
void parallel_for(int64_t n, F&& f, int64_t min_per_thread = 1) {
  if (n <= 0) return;
  if (n < 2 * min_per_thread || omp_in_parallel() || num_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
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

#pragma once
// Helpers shared by the GPU tests: the skip without a device, poisoned device buffers, and bf16/fp32 copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/half.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"  // device helpers (alloc, copies)
#include "testing.hpp"

#define REQUIRE_GPU() \
  if (::lm::kda::cuda::device_count() <= 0) GTEST_SKIP() << "no CUDA device"

namespace lm::cuda_testing {

using Vec = std::vector<float>;

// Device buffer, poisoned with 0xff bytes (NaN as fp32 and bf16) so an element never written shows up.
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : p(kda::cuda::device_alloc(std::max<size_t>(n, 16))), bytes(std::max<size_t>(n, 16)) {
    kda::cuda::device_fill(p, 0xff, bytes);
  }
  ~Dev() { kda::cuda::device_free(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  float* f() const { return static_cast<float*>(p); }
  int32_t* i() const { return static_cast<int32_t*>(p); }
};

inline Vec round_bf16(const Vec& x) {
  Vec r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return r;
}
inline void up_bf16(Dev& d, const Vec& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16(x[i]);
  kda::cuda::copy_to_device(d.p, b.data(), b.size() * 2);
}
template <class T>
void up(Dev& d, const std::vector<T>& x) {
  kda::cuda::copy_to_device(d.p, x.data(), x.size() * sizeof(T));
}
inline Vec down_bf16(const Dev& d, size_t n) {
  std::vector<uint16_t> b(n);
  kda::cuda::copy_to_host(b.data(), d.p, n * 2);
  Vec r(n);
  for (size_t i = 0; i < n; ++i) r[i] = bf16_to_f32(b[i]);
  return r;
}
template <class T>
std::vector<T> down(const Dev& d, size_t n) {
  std::vector<T> r(n);
  kda::cuda::copy_to_host(r.data(), d.p, n * sizeof(T));
  return r;
}
inline double err(const Vec& ref, const Vec& x) { return testing::rel_rms_vec(ref, x); }

}  // namespace lm::cuda_testing

#pragma once
// Helpers shared by the GPU tests (tests/<layer>/test_*_cuda.cpp): the skip without a device, poisoned device
// buffers, bf16/fp32 copies, random inputs and tolerances, and comparisons of strided results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/dtype.hpp"
#include "core/half.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"  // device helpers (alloc, copies)
#include "testing.hpp"

#define REQUIRE_GPU() \
  if (::lm::kda::cuda::device_count() <= 0) GTEST_SKIP() << "no CUDA device"

namespace lm::ops::cuda {}  // the ops' *_cuda.hpp headers declare its functions

namespace lm::cuda_testing {

namespace kc = lm::kda::cuda;  // the CUDA APIs under test (kc also: device buffers, copies, synchronize)
namespace oc = lm::ops::cuda;

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

inline constexpr double kTolBf16 = 1e-2;  // outputs stored as bf16 (rounding alone is ~2e-3)
inline constexpr double kTolF32 = 1e-5;   // fp32 outputs (summation order only)

// x as the given dtype (F32 or BF16; a BF16 x should already be bf16-exact).
inline void up_as(Dev& d, const Vec& x, DType t) {
  if (t == DType::BF16)
    up_bf16(d, x);
  else
    up(d, x);
}
inline Vec down_as(const Dev& d, size_t n, DType t) { return t == DType::BF16 ? down_bf16(d, n) : down<float>(d, n); }
inline double tol(DType t) { return t == DType::BF16 ? kTolBf16 : kTolF32; }
inline const char* name(DType t) { return t == DType::BF16 ? "bf16" : "f32"; }

inline Vec randn(size_t n, uint64_t seed, double sd = 1.0) { return lm::testing::randn<float>(n, seed, sd); }
inline Vec maybe_round(const Vec& x, DType t) { return t == DType::BF16 ? round_bf16(x) : x; }
// 1 + sd·N(0, 1): a norm gain near its init.
inline Vec gain(size_t n, uint64_t seed, double sd) {
  Vec g = randn(n, seed, sd);
  for (float& v : g) v += 1.f;
  return g;
}

// The first D columns of a [rows, ld] matrix.
inline Vec cols(const Vec& a, int64_t rows, int64_t ld, int64_t D) {
  Vec r(size_t(rows * D));
  for (int64_t i = 0; i < rows; ++i)
    std::copy(a.begin() + i * ld, a.begin() + i * ld + D, r.begin() + i * D);
  return r;
}
// Number of elements in columns [D, ld) that differ bitwise between two [rows, ld] matrices of esize bytes.
inline size_t pad_changes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t rows, int64_t ld,
                          int64_t D, size_t esize) {
  size_t n = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = D; c < ld; ++c) {
      const size_t o = size_t(i * ld + c) * esize;
      n += std::memcmp(a.data() + o, b.data() + o, esize) != 0;
    }
  return n;
}
inline std::vector<uint8_t> bytes_of(const Dev& d, size_t n) { return down<uint8_t>(d, n); }
// a - b elementwise (an accumulated gradient minus its starting value).
inline Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

}  // namespace lm::cuda_testing

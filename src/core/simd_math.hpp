#pragma once
// exp for float that the compiler can vectorise inside `#pragma omp simd` loops (glibc's expf is
// only vectorised under -ffast-math, which would also break NaN handling everywhere else).
// Range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, 2^n built in the
// exponent bits. Max relative error ~2 ulp on [-87, 88]. Arguments below -87.3 return 0 (no
// denormals: they are ~100x slower on x86 and below fp32's useful range), above 88.7 return inf.
#include <cstdint>
#include <cstring>

namespace lm {

#if defined(__GNUC__)
#define LM_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define LM_ALWAYS_INLINE inline
#endif

LM_ALWAYS_INLINE float exp_approx(float x) {
  const float cx = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // Round to nearest by the 1.5 * 2^23 trick (vectorises, unlike roundf).
  const float n = (cx * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // Cody-Waite split of ln2 keeps r exact to ~1 ulp.
  const float r = (cx - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  float y = p * scale;
  y = x < -87.3f ? 0.0f : y;
  y = x > 88.7f ? __builtin_inff() : y;
  return x != x ? x : y;  // NaN propagates
}

}  // namespace lm

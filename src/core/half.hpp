#pragma once
// bf16 / f16 <-> f32 conversions, round-to-nearest-even, NaN preserved. Usable from CUDA too.
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LM_HD __host__ __device__ __forceinline__
#else
#define LM_HD inline
#endif

namespace lm {

LM_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
LM_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

LM_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
LM_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

LM_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // subnormal: renormalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    man &= 0x3ffu;
    return bits_f32(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (man << 13));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

LM_HD uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;         // overflow (incl. inf) after rounding
  if (u < 0x38800000u) {                               // subnormal or zero in f16
    if (u < 0x33000000u) return sign;                  // rounds to zero
    const uint32_t e = u >> 23, m = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;                    // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  u += 0xfffu + ((u >> 13) & 1u);                      // round mantissa to 10 bits
  return sign | static_cast<uint16_t>(((u >> 23) - 112u) << 10 | ((u >> 13) & 0x3ffu));
}

// Storage types with explicit conversion; arithmetic is always done in f32.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  LM_HD explicit bf16(float f) : bits(f32_to_bf16(f)) {}
  LM_HD explicit operator float() const { return bf16_to_f32(bits); }
};
struct f16 {
  uint16_t bits = 0;
  f16() = default;
  LM_HD explicit f16(float f) : bits(f32_to_f16(f)) {}
  LM_HD explicit operator float() const { return f16_to_f32(bits); }
};

}  // namespace lm

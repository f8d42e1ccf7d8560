#pragma once
// Counter-based RNG (Philox4x32-10, Salmon et al. 2011). Draw i of stream s under seed k is a pure
// function of (k, s, i), so the CPU, every GPU thread and a resumed run all see the same numbers
// without sharing generator state.
#include <cmath>
#include <cstdint>

#include "core/half.hpp"  // LM_HD

namespace lm {

struct Philox4 {
  uint32_t v[4];
};

LM_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(M0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(M1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// A stream of random numbers; draw(i) is independent of how many other draws were made.
struct Rng {
  uint64_t seed = 0;
  uint64_t stream = 0;

  LM_HD Philox4 bits(uint64_t i) const {
    return philox4x32_10(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(stream),
                         static_cast<uint32_t>(stream >> 32), static_cast<uint32_t>(seed),
                         static_cast<uint32_t>(seed >> 32));
  }
  // Uniform in (0, 1): 24 random bits, offset by half a step so 0 and 1 never occur.
  LM_HD float uniform(uint64_t i) const { return (static_cast<float>(bits(i).v[0] >> 8) + 0.5f) * (1.0f / 16777216.0f); }
  // Uniform in (0, 1) with 53 bits, for float64 tests and initialisation done in double.
  LM_HD double uniform_f64(uint64_t i) const {
    const Philox4 b = bits(i);
    const uint64_t m = (static_cast<uint64_t>(b.v[0]) << 21) ^ (b.v[1] >> 11);
    return (static_cast<double>(m & ((1ull << 53) - 1)) + 0.5) * (1.0 / 9007199254740992.0);
  }
  // Standard normal by Box-Muller on two uniforms of the same draw.
  LM_HD float normal(uint64_t i) const {
    const Philox4 b = bits(i);
    const float u1 = (static_cast<float>(b.v[0] >> 8) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = (static_cast<float>(b.v[1] >> 8) + 0.5f) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
  }
  LM_HD double normal_f64(uint64_t i) const {
    const Philox4 b = bits(i);
    const double u1 = (static_cast<double>((static_cast<uint64_t>(b.v[0]) << 21) ^ (b.v[1] >> 11)) + 0.5) *
                      (1.0 / 9007199254740992.0);
    const double u2 = (static_cast<double>((static_cast<uint64_t>(b.v[2]) << 21) ^ (b.v[3] >> 11)) + 0.5) *
                      (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
  }
  // A derived, independent stream (e.g. one per parameter tensor or per step).
  LM_HD Rng fork(uint64_t sub) const { return Rng{seed, stream * 0x9E3779B97F4A7C15ull + sub + 1}; }
};

}  // namespace lm

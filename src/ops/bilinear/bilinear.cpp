// Bilinear resize on the CPU (see bilinear.hpp). Legend: Hi×Wi -> Ho×Wo grids of C channels.
#include "ops/bilinear/bilinear.hpp"

#include <algorithm>
#include <utility>

#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::ops {

namespace {
void check(const char* who, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho, int64_t Wo) {
  LM_CHECK(Hi >= 1 && Wi >= 1 && C >= 1 && Ho >= 1 && Wo >= 1,
           "{}: grids must be non-empty, got {}x{} -> {}x{} with {} channels", who, Hi, Wi, Ho, Wo, C);
}
constexpr int64_t kChannelBlock = 64;
}  // namespace

BilinearTaps bilinear_taps(int64_t n_in, int64_t n_out) {
  LM_CHECK(n_in >= 1 && n_out >= 1, "bilinear_taps: sizes must be >= 1, got {} -> {}", n_in, n_out);
  BilinearTaps t;
  t.i0.resize(n_out), t.i1.resize(n_out), t.l0.resize(n_out), t.l1.resize(n_out);
  const double scale = static_cast<double>(n_in) / static_cast<double>(n_out);
  for (int64_t o = 0; o < n_out; ++o) {
    const double s = std::max(scale * (static_cast<double>(o) + 0.5) - 0.5, 0.0);
    const int64_t i0 = std::min(static_cast<int64_t>(s), n_in - 1);
    const double lam = std::min(s - static_cast<double>(i0), 1.0);
    t.i0[o] = i0;
    t.i1[o] = std::min(i0 + 1, n_in - 1);
    t.l1[o] = lam;
    t.l0[o] = 1.0 - lam;
  }
  return t;
}

template <class F>
void bilinear_resize_forward(const F* src, int64_t Hi, int64_t Wi, int64_t C, F* dst, int64_t Ho, int64_t Wo) {
  check("bilinear_resize_forward", Hi, Wi, C, Ho, Wo);
  const BilinearTaps th = bilinear_taps(Hi, Ho), tw = bilinear_taps(Wi, Wo);
  parallel_for(
      Ho * Wo,
      [&](int64_t p) {
        const int64_t y = p / Wo, x = p % Wo;
        const F h0 = static_cast<F>(th.l0[y]), h1 = static_cast<F>(th.l1[y]);
        const F w0 = static_cast<F>(tw.l0[x]), w1 = static_cast<F>(tw.l1[x]);
        const F* s00 = src + (th.i0[y] * Wi + tw.i0[x]) * C;
        const F* s01 = src + (th.i0[y] * Wi + tw.i1[x]) * C;
        const F* s10 = src + (th.i1[y] * Wi + tw.i0[x]) * C;
        const F* s11 = src + (th.i1[y] * Wi + tw.i1[x]) * C;
        F* d = dst + p * C;
        // PyTorch's association: h0·(w0·x00 + w1·x01) + h1·(w0·x10 + w1·x11).
        for (int64_t c = 0; c < C; ++c) d[c] = h0 * (w0 * s00[c] + w1 * s01[c]) + h1 * (w0 * s10[c] + w1 * s11[c]);
      },
      4);
}

template <class F>
void bilinear_resize_backward(const F* ddst, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho, int64_t Wo, F* dsrc) {
  check("bilinear_resize_backward", Hi, Wi, C, Ho, Wo);
  const BilinearTaps th = bilinear_taps(Hi, Ho), tw = bilinear_taps(Wi, Wo);
  // Outputs scatter into shared sources: split the channels over threads, never the outputs.
  const int64_t nblk = (C + kChannelBlock - 1) / kChannelBlock;
  parallel_for(nblk, [&](int64_t b) {
    const int64_t c0 = b * kChannelBlock, c1 = std::min(C, c0 + kChannelBlock);
    for (int64_t y = 0; y < Ho; ++y)
      for (int64_t x = 0; x < Wo; ++x) {
        const F* g = ddst + (y * Wo + x) * C;
        const std::pair<int64_t, double> taps[4] = {
            {th.i0[y] * Wi + tw.i0[x], th.l0[y] * tw.l0[x]}, {th.i0[y] * Wi + tw.i1[x], th.l0[y] * tw.l1[x]},
            {th.i1[y] * Wi + tw.i0[x], th.l1[y] * tw.l0[x]}, {th.i1[y] * Wi + tw.i1[x], th.l1[y] * tw.l1[x]}};
        for (const auto& [idx, wt] : taps) {
          const F w = static_cast<F>(wt);
          F* s = dsrc + idx * C;
          for (int64_t c = c0; c < c1; ++c) s[c] += w * g[c];
        }
      }
  });
}

#define LM_INST(F)                                                                                            \
  template void bilinear_resize_forward<F>(const F*, int64_t, int64_t, int64_t, F*, int64_t, int64_t);        \
  template void bilinear_resize_backward<F>(const F*, int64_t, int64_t, int64_t, int64_t, int64_t, F*);
LM_INST(float)
LM_INST(double)
#undef LM_INST

}  // namespace lm::ops

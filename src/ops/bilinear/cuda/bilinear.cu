// Bilinear resize (align_corners=False) of a channels-last grid on the GPU, forward and its transpose (the
// definition in ops/bilinear/bilinear.hpp, the loops of bilinear.cpp).
//
// Legend: Hi×Wi -> Ho×Wo grids of C channels; fp32. src, dsrc [Hi, Wi, C]; dst, ddst [Ho, Wo, C].
// The taps are recomputed per thread in double with explicitly rounded operations (no fused multiply-add), the
// expressions of ops::bilinear_taps, so every index and weight equals the CPU's. The weights are rounded to
// float as the CPU does (forward: each axis' weight; backward: the double product of the two), and the float
// sums use the CPU's association, unfused.
//   forward: one thread per (output cell, channel), grid-stride.
//   backward: one thread per (source cell, channel); it scans the outputs that can name its cell (per axis a
//   window around the inverse of the tap map, with a margin; every candidate is tested exactly) in the CPU's
//   order, so dsrc gets the CPU's sums, deterministically, with no atomics.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "ops/bilinear/cuda/bilinear_cuda.hpp"

namespace lm::ops::cuda {

namespace {

constexpr cu::Checker check{"bilinear cuda"};

struct Tap {
  int64_t i0, i1;
  double l0, l1;
};

// ops::bilinear_taps for one output index o of an axis n_in -> n_out.
__device__ __forceinline__ Tap tap_of(int64_t n_in, int64_t n_out, int64_t o) {
  const double scale = __ddiv_rn(double(n_in), double(n_out));
  const double s = fmax(__dsub_rn(__dmul_rn(scale, __dadd_rn(double(o), 0.5)), 0.5), 0.0);
  Tap t;
  t.i0 = min(int64_t(s), n_in - 1);
  const double lam = fmin(__dsub_rn(s, double(t.i0)), 1.0);
  t.i1 = min(t.i0 + 1, n_in - 1);
  t.l1 = lam;
  t.l0 = __dsub_rn(1.0, lam);
  return t;
}

// Outputs [lo, hi] of an axis whose taps may name source index i: i0(o) ∈ {i − 1, i} means the source coordinate
// s(o) = (n_in/n_out)(o + ½) − ½ lies in [i − 1, i + 1); the margin of 2 covers rounding (candidates are tested).
__device__ __forceinline__ void window_of(int64_t n_in, int64_t n_out, int64_t i, int64_t& lo, int64_t& hi) {
  const double inv = double(n_out) / double(n_in);
  lo = max(int64_t(0), int64_t(floor((double(i) - 0.5) * inv - 0.5)) - 2);
  hi = min(n_out - 1, int64_t(ceil((double(i) + 1.5) * inv - 0.5)) + 2);
}

__global__ void bilinear_fwd_kernel(const float* __restrict__ src, int64_t Hi, int64_t Wi, int64_t C,
                                    float* __restrict__ dst, int64_t Ho, int64_t Wo) {
  const int64_t n = Ho * Wo * C;
  for (int64_t it = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; it < n; it += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = it / C, c = it - p * C, y = p / Wo, x = p - y * Wo;
    const Tap th = tap_of(Hi, Ho, y), tw = tap_of(Wi, Wo, x);
    const float h0 = float(th.l0), h1 = float(th.l1), w0 = float(tw.l0), w1 = float(tw.l1);
    const float s00 = src[(th.i0 * Wi + tw.i0) * C + c], s01 = src[(th.i0 * Wi + tw.i1) * C + c];
    const float s10 = src[(th.i1 * Wi + tw.i0) * C + c], s11 = src[(th.i1 * Wi + tw.i1) * C + c];
    // PyTorch's (and the CPU's) association: h0·(w0·x00 + w1·x01) + h1·(w0·x10 + w1·x11).
    const float top = __fadd_rn(__fmul_rn(w0, s00), __fmul_rn(w1, s01));
    const float bot = __fadd_rn(__fmul_rn(w0, s10), __fmul_rn(w1, s11));
    dst[it] = __fadd_rn(__fmul_rn(h0, top), __fmul_rn(h1, bot));
  }
}

__global__ void bilinear_bwd_kernel(const float* __restrict__ ddst, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho,
                                    int64_t Wo, float* __restrict__ dsrc) {
  const int64_t n = Hi * Wi * C;
  for (int64_t it = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; it < n; it += int64_t(gridDim.x) * blockDim.x) {
    const int64_t cell = it / C, c = it - cell * C, yi = cell / Wi, xi = cell - yi * Wi;
    int64_t ylo, yhi, xlo, xhi;
    window_of(Hi, Ho, yi, ylo, yhi);
    window_of(Wi, Wo, xi, xlo, xhi);
    float acc = dsrc[it];
    for (int64_t y = ylo; y <= yhi; ++y) {
      const Tap th = tap_of(Hi, Ho, y);
      if (th.i0 != yi && th.i1 != yi) continue;
      for (int64_t x = xlo; x <= xhi; ++x) {
        const Tap tw = tap_of(Wi, Wo, x);
        if (tw.i0 != xi && tw.i1 != xi) continue;
        const float g = ddst[(y * Wo + x) * C + c];
        // The CPU's tap order; a tap naming this cell twice (clamped edges) adds twice, as there.
        if (th.i0 == yi && tw.i0 == xi) acc = __fadd_rn(acc, __fmul_rn(float(__dmul_rn(th.l0, tw.l0)), g));
        if (th.i0 == yi && tw.i1 == xi) acc = __fadd_rn(acc, __fmul_rn(float(__dmul_rn(th.l0, tw.l1)), g));
        if (th.i1 == yi && tw.i0 == xi) acc = __fadd_rn(acc, __fmul_rn(float(__dmul_rn(th.l1, tw.l0)), g));
        if (th.i1 == yi && tw.i1 == xi) acc = __fadd_rn(acc, __fmul_rn(float(__dmul_rn(th.l1, tw.l1)), g));
      }
    }
    dsrc[it] = acc;
  }
}

__global__ void add_kernel(const float* __restrict__ a, float* __restrict__ b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    b[i] += a[i];
}

constexpr int kThreads = 256;

int grid_for(int64_t items) {
  return int(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16)));
}

void check_dims(const char* who, const void* in, const void* out, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho,
                int64_t Wo) {
  if (!(Hi >= 1 && Wi >= 1 && C >= 1 && Ho >= 1 && Wo >= 1))
    check.fail(std::string(who) + ": grids must be non-empty, got " + std::to_string(Hi) + "x" + std::to_string(Wi) +
               " -> " + std::to_string(Ho) + "x" + std::to_string(Wo) + " with " + std::to_string(C) + " channels");
  if (!in || !out) check.fail(std::string(who) + ": null argument");
}

}  // namespace

void bilinear_resize_forward(const float* src, int64_t Hi, int64_t Wi, int64_t C, float* dst, int64_t Ho, int64_t Wo,
                             void* stream) {
  check_dims("bilinear_resize_forward", src, dst, Hi, Wi, C, Ho, Wo);
  const auto s = lm::cu::stream(stream);
  if (Hi == Ho && Wi == Wo) {
    check(cudaMemcpyAsync(dst, src, size_t(Hi * Wi * C) * sizeof(float), cudaMemcpyDeviceToDevice, s),
          "bilinear_resize_forward copy");
    return;
  }
  bilinear_fwd_kernel<<<grid_for(Ho * Wo * C), kThreads, 0, s>>>(src, Hi, Wi, C, dst, Ho, Wo);
  check(cudaGetLastError(), "bilinear_resize_forward launch");
}

void bilinear_resize_backward(const float* ddst, int64_t Hi, int64_t Wi, int64_t C, int64_t Ho, int64_t Wo, float* dsrc,
                              void* stream) {
  check_dims("bilinear_resize_backward", ddst, dsrc, Hi, Wi, C, Ho, Wo);
  const auto s = lm::cu::stream(stream);
  if (Hi == Ho && Wi == Wo)
    add_kernel<<<grid_for(Hi * Wi * C), kThreads, 0, s>>>(ddst, dsrc, Hi * Wi * C);
  else
    bilinear_bwd_kernel<<<grid_for(Hi * Wi * C), kThreads, 0, s>>>(ddst, Hi, Wi, C, Ho, Wo, dsrc);
  check(cudaGetLastError(), "bilinear_resize_backward launch");
}

}  // namespace lm::ops::cuda

// GELU forward/backward on the GPU, elementwise (formulas in ops/gelu/gelu.hpp, same constants as gelu.cpp).
//
// Legend: n elements. a fp32 [n]; g, da bf16 [n]; dg F32 or BF16 [n] (da may alias a bf16 dg).
// One thread per element, grid-stride; memory bound, so the accurate tanhf / erff / expf cost nothing measurable.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "ops/gelu/cuda/gelu_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"gelu cuda"};

constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // √(2/π)
constexpr float kCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1/√(2π)

__device__ __forceinline__ float gelu_tanh(float x) {
  const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  const float t = tanhf(kSqrt2OverPi * (x + kCubic * x * x * x));
  const float du = kSqrt2OverPi * (1.f + 3.f * kCubic * x * x);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
}
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * kInvSqrt2)); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  const float cdf = 0.5f * (1.f + erff(x * kInvSqrt2));
  return cdf + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}

__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

template <bool TANH>
__global__ void gelu_fwd_kernel(const float* __restrict__ a, bf16* __restrict__ g, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    g[i] = __float2bfloat16_rn(TANH ? gelu_tanh(a[i]) : gelu_erf(a[i]));
}

// dg and da may be the same bf16 buffer: no __restrict__ on them; each thread reads dg[i] before writing da[i].
template <bool TANH, class G>
__global__ void gelu_bwd_kernel(const float* __restrict__ a, const G* dg, bf16* da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = a[i], d = to_f(dg[i]);
    da[i] = __float2bfloat16_rn(d * (TANH ? gelu_tanh_grad(x) : gelu_erf_grad(x)));
  }
}

constexpr int kThreads = 256;

int grid_for(int64_t items) {
  // A few waves on a 132-SM H200; the grid-stride loop covers the rest.
  return int(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16)));
}

template <bool TANH, class G>
void launch_bwd(const float* a, const void* dg, void* da, int64_t n, cudaStream_t s) {
  gelu_bwd_kernel<TANH, G><<<grid_for(n), kThreads, 0, s>>>(a, static_cast<const G*>(dg), static_cast<bf16*>(da), n);
}

}  // namespace

void gelu_forward(const float* a, void* g, int64_t n, GeluKind kind, void* stream) {
  if (n < 0) check.fail("gelu_forward: n = " + std::to_string(n) + " must be >= 0");
  if (n == 0) return;
  if (!a || !g) check.fail("gelu_forward: null argument");
  const auto s = lm::cu::stream(stream);
  if (kind == GeluKind::Tanh)
    gelu_fwd_kernel<true><<<grid_for(n), kThreads, 0, s>>>(a, static_cast<bf16*>(g), n);
  else
    gelu_fwd_kernel<false><<<grid_for(n), kThreads, 0, s>>>(a, static_cast<bf16*>(g), n);
  check(cudaGetLastError(), "gelu_forward launch");
}

void gelu_backward(const float* a, const void* dg, DType dg_type, void* da, int64_t n, GeluKind kind, void* stream) {
  if (n < 0) check.fail("gelu_backward: n = " + std::to_string(n) + " must be >= 0");
  if (dg_type != DType::F32 && dg_type != DType::BF16) check.fail("gelu_backward: dg must be F32 or BF16");
  if (n == 0) return;
  if (!a || !dg || !da) check.fail("gelu_backward: null argument");
  const auto s = lm::cu::stream(stream);
  const bool tanh = kind == GeluKind::Tanh;
  if (dg_type == DType::F32) {
    if (tanh) launch_bwd<true, float>(a, dg, da, n, s);
    else launch_bwd<false, float>(a, dg, da, n, s);
  } else {
    if (tanh) launch_bwd<true, bf16>(a, dg, da, n, s);
    else launch_bwd<false, bf16>(a, dg, da, n, s);
  }
  check(cudaGetLastError(), "gelu_backward launch");
}

}  // namespace lm::ops::cuda

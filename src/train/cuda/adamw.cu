// The fused AdamW update (adamw.hpp): fp32 master, moments and gradient in 16-byte vectors where the pointers allow
// it (checked on the host), else the scalar path, with the bf16 copy written beside; the per-element math is one
// inline function shared by both paths, so they give the same bits.
//
// Legend: n elements, nv 16-byte vectors of 4 fp32 (then a scalar tail); w master, g gradient, m, v moments, wb bf16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "train/cuda/adamw.hpp"

namespace lm::train::cuda {

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }

__device__ __forceinline__ void adamw1(float& w, float g, float& m, float& v, bf16& wb, const AdamWArgs& a) {
  const float gi = g * a.gscale;
  const float mi = a.b1 * m + (1.f - a.b1) * gi;
  const float vi = a.b2 * v + (1.f - a.b2) * gi * gi;
  m = mi, v = vi;
  float wi = w;
  wi -= a.lr * ((mi / a.bc1) / (sqrtf(vi / a.bc2) + a.eps) + a.wd * wi);
  w = wi;
  wb = __float2bfloat16(wi);
}
__global__ void adamw_kernel(float* w, const float* g, float* m, float* v, bf16* wb, int64_t n, int64_t nv,
                             AdamWArgs a) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < nv; i += step) {
    float4 w4 = ld4(w + 4 * i), m4 = ld4(m + 4 * i), v4 = ld4(v + 4 * i);
    const float4 g4 = ld4(g + 4 * i);
    bf16 b[4];
    adamw1(w4.x, g4.x, m4.x, v4.x, b[0], a);
    adamw1(w4.y, g4.y, m4.y, v4.y, b[1], a);
    adamw1(w4.z, g4.z, m4.z, v4.z, b[2], a);
    adamw1(w4.w, g4.w, m4.w, v4.w, b[3], a);
    st4(m + 4 * i, m4), st4(v + 4 * i, v4), st4(w + 4 * i, w4);
    *reinterpret_cast<uint2*>(wb + 4 * i) =
        make_uint2(uint32_t(__bfloat16_as_ushort(b[0])) | uint32_t(__bfloat16_as_ushort(b[1])) << 16,
                   uint32_t(__bfloat16_as_ushort(b[2])) | uint32_t(__bfloat16_as_ushort(b[3])) << 16);
  }
  for (int64_t i = 4 * nv + t; i < n; i += step) adamw1(w[i], g[i], m[i], v[i], wb[i], a);
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void adamw_update(float* w, const float* g, float* m, float* v, void* wb, int64_t n, const AdamWArgs& a, void* s) {
  if (n <= 0) return;
  const int64_t nv = aligned(w, 16) && aligned(g, 16) && aligned(m, 16) && aligned(v, 16) && aligned(wb, 8) ? n / 4 : 0;
  const int64_t blocks = ((nv ? nv : n) + 255) / 256;  // of 256 threads, at most 65535 · 16 (grid-stride loops)
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 16 ? blocks : 65535 * 16);
  adamw_kernel<<<grid, 256, 0, lm::cu::stream(s)>>>(w, g, m, v, static_cast<bf16*>(wb), n, nv, a);
  constexpr cu::Checker check{"model cuda"};
  check(cudaGetLastError(), "adamw_update");
}

}  // namespace lm::train::cuda

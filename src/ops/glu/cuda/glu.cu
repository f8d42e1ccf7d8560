// SiTU-GLU and SwiGLU forward/backward on the GPU, elementwise (formulas in ops/glu/glu.hpp).
//
// Legend: rows tokens, I intermediate width, a = ab[:, :I], b = ab[:, I:]. ab bf16 [rows, 2I];
//         h bf16 [rows, I]; dh F32 or BF16 [rows, I]; dab bf16 [rows, 2I] (may alias ab).
// One thread per 8 consecutive columns of a row when I % 8 == 0 (16-byte loads of a, b, h), else per
// column. Math in fp32; tanhf / expf-based sigmoid (the kernels are memory bound, so the accurate
// versions cost nothing measurable).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/pdl.cuh"
#include "core/cuda/stream.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"glu cuda"};

// Constants in fp32; cap false: B(b) = b (beta2 <= 0 or infinite).
struct Consts {
  float beta1, inv_beta1, beta2, inv_beta2;
};

enum Mode { kSwiGLU = 0, kSituCap = 1, kSituNoCap = 2 };

__device__ __forceinline__ float sigmoidf_(float z) { return 1.f / (1.f + __expf(-z)); }

template <int MODE>
__device__ __forceinline__ float glu_fwd(float a, float b, const Consts& c) {
  const float s = sigmoidf_(a);
  if (MODE == kSwiGLU) return a * s * b;
  const float A = c.beta1 * tanhf(a * c.inv_beta1) * s;
  const float B = MODE == kSituCap ? c.beta2 * tanhf(b * c.inv_beta2) : b;
  return A * B;
}

// da, db from a, b and the upstream gradient g.
template <int MODE>
__device__ __forceinline__ void glu_bwd(float a, float b, float g, const Consts& c, float& da, float& db) {
  const float s = sigmoidf_(a);
  if (MODE == kSwiGLU) {
    da = g * b * s * (1.f + a * (1.f - s));
    db = g * a * s;
    return;
  }
  const float t = tanhf(a * c.inv_beta1);
  const float A = c.beta1 * t * s;
  const float dA = (1.f - t * t) * s + c.beta1 * t * s * (1.f - s);
  float B = b, dB = 1.f;
  if (MODE == kSituCap) {
    const float u = tanhf(b * c.inv_beta2);
    B = c.beta2 * u;
    dB = 1.f - u * u;
  }
  da = g * B * dA;
  db = g * A * dB;
}

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 v = __bfloat1622float2(h[q]);
    f[2 * q] = v.x, f[2 * q + 1] = v.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
  return u;
}

template <class G>
__device__ __forceinline__ void load8(const G* p, float* f);
template <>
__device__ __forceinline__ void load8<bf16>(const bf16* p, float* f) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float* f) {
  const float4 x = reinterpret_cast<const float4*>(p)[0], y = reinterpret_cast<const float4*>(p)[1];
  f[0] = x.x, f[1] = x.y, f[2] = x.z, f[3] = x.w, f[4] = y.x, f[5] = y.y, f[6] = y.z, f[7] = y.w;
}
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }

// VEC 8 or 1 columns per work item; items = rows · I / VEC, grid-stride.
template <int MODE, int VEC>
__global__ void glu_fwd_kernel(const bf16* ab, bf16* h, int64_t rows, int64_t I, int64_t lda, Consts c) {
  lm::cu::pdl_launch_dependents();  // the next projection may start streaming its weights (core/cuda/pdl.cuh)
  const int64_t per_row = I / VEC, n = rows * per_row;
  for (int64_t it = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; it < n; it += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = it / per_row, j = (it - r * per_row) * VEC;
    const bf16* a = ab + r * lda + j;
    if constexpr (VEC == 8) {
      float fa[8], fb[8], fh[8];
      load8(a, fa);
      load8(a + I, fb);
#pragma unroll
      for (int q = 0; q < 8; ++q) fh[q] = glu_fwd<MODE>(fa[q], fb[q], c);
      *reinterpret_cast<uint4*>(h + r * I + j) = pack8(fh);
    } else {
      h[r * I + j] = __float2bfloat16_rn(glu_fwd<MODE>(__bfloat162float(a[0]), __bfloat162float(a[I]), c));
    }
  }
}

// Each item reads its a, b (and g) before writing da, db at the same places: dab == ab is safe.
template <int MODE, int VEC, class G>
__global__ void glu_bwd_kernel(const bf16* ab, const G* dh, bf16* dab, int64_t rows, int64_t I, int64_t lda,
                               int64_t ldd, Consts c) {
  const int64_t per_row = I / VEC, n = rows * per_row;
  for (int64_t it = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; it < n; it += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = it / per_row, j = (it - r * per_row) * VEC;
    const bf16* a = ab + r * lda + j;
    bf16* da = dab + r * ldd + j;
    if constexpr (VEC == 8) {
      float fa[8], fb[8], fg[8], fda[8], fdb[8];
      load8(a, fa);
      load8(a + I, fb);
      load8(dh + r * I + j, fg);
#pragma unroll
      for (int q = 0; q < 8; ++q) glu_bwd<MODE>(fa[q], fb[q], fg[q], c, fda[q], fdb[q]);
      *reinterpret_cast<uint4*>(da) = pack8(fda);
      *reinterpret_cast<uint4*>(da + I) = pack8(fdb);
    } else {
      float x, y;
      glu_bwd<MODE>(__bfloat162float(a[0]), __bfloat162float(a[I]), to_f(dh[r * I + j]), c, x, y);
      da[0] = __float2bfloat16_rn(x);
      da[I] = __float2bfloat16_rn(y);
    }
  }
}

constexpr int kThreads = 256;

int grid_for(int64_t items) {
  // Enough blocks for a few waves on a 132-SM H200; the grid-stride loop covers the rest.
  return int(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16)));
}

Consts consts_of(const GluParams& p) {
  const bool cap = p.beta2 > 0 && std::isfinite(p.beta2);
  return Consts{float(p.beta1), float(1.0 / p.beta1), cap ? float(p.beta2) : 0.f, cap ? float(1.0 / p.beta2) : 0.f};
}

int mode_of(const GluParams& p) {
  if (p.kind == GluKind::SwiGLU) return kSwiGLU;
  return p.beta2 > 0 && std::isfinite(p.beta2) ? kSituCap : kSituNoCap;
}

void check_args(const char* who, const void* ab, const void* out, int64_t rows, int64_t I, const GluParams& p) {
  if (rows < 0 || I <= 0) check.fail(std::string(who) + ": need rows >= 0 and I > 0");
  if (p.kind == GluKind::SiTU && !(p.beta1 > 0 && std::isfinite(p.beta1)))
    check.fail(std::string(who) + ": SiTU beta1 must be finite and > 0");
  if (rows > 0 && (!ab || !out)) check.fail(std::string(who) + ": null argument");
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <int MODE>
void launch_fwd(const bf16* ab, bf16* h, int64_t rows, int64_t I, int64_t lda, const Consts& c, cudaStream_t s) {
  if (I % 8 == 0 && lda % 8 == 0 && aligned16(ab) && aligned16(h))
    glu_fwd_kernel<MODE, 8><<<grid_for(rows * I / 8), kThreads, 0, s>>>(ab, h, rows, I, lda, c);
  else
    glu_fwd_kernel<MODE, 1><<<grid_for(rows * I), kThreads, 0, s>>>(ab, h, rows, I, lda, c);
}

template <int MODE, class G>
void launch_bwd(const bf16* ab, const G* dh, bf16* dab, int64_t rows, int64_t I, int64_t lda, int64_t ldd,
                const Consts& c, cudaStream_t s) {
  if (I % 8 == 0 && lda % 8 == 0 && ldd % 8 == 0 && aligned16(ab) && aligned16(dh) && aligned16(dab))
    glu_bwd_kernel<MODE, 8, G><<<grid_for(rows * I / 8), kThreads, 0, s>>>(ab, dh, dab, rows, I, lda, ldd, c);
  else
    glu_bwd_kernel<MODE, 1, G><<<grid_for(rows * I), kThreads, 0, s>>>(ab, dh, dab, rows, I, lda, ldd, c);
}

}  // namespace

void glu_forward(const void* ab, void* h, int64_t rows, int64_t I, const GluParams& p, void* stream, int64_t ldab) {
  check_args("glu_forward", ab, h, rows, I, p);
  if (!ldab) ldab = 2 * I;
  if (ldab < 2 * I) check.fail("glu_forward: ldab must be at least 2I");
  if (rows == 0) return;
  const auto* a = static_cast<const bf16*>(ab);
  auto* o = static_cast<bf16*>(h);
  const Consts c = consts_of(p);
  const auto s = lm::cu::stream(stream);
  switch (mode_of(p)) {
    case kSwiGLU: launch_fwd<kSwiGLU>(a, o, rows, I, ldab, c, s); break;
    case kSituCap: launch_fwd<kSituCap>(a, o, rows, I, ldab, c, s); break;
    default: launch_fwd<kSituNoCap>(a, o, rows, I, ldab, c, s); break;
  }
  check(cudaGetLastError(), "glu_forward launch");
}

void glu_backward(const void* ab, const void* dh, DType dh_type, void* dab, int64_t rows, int64_t I,
                  const GluParams& p, void* stream, int64_t ldab, int64_t lddab) {
  check_args("glu_backward", ab, dab, rows, I, p);
  if (!ldab) ldab = 2 * I;
  if (!lddab) lddab = 2 * I;
  if (ldab < 2 * I || lddab < 2 * I) check.fail("glu_backward: ldab and lddab must be at least 2I");
  if (dh_type != DType::F32 && dh_type != DType::BF16) check.fail("glu_backward: dh must be F32 or BF16");
  if (rows == 0) return;
  if (!dh) check.fail("glu_backward: null dh");
  const auto* a = static_cast<const bf16*>(ab);
  auto* o = static_cast<bf16*>(dab);
  const Consts c = consts_of(p);
  const auto s = lm::cu::stream(stream);
  const int mode = mode_of(p);
  if (dh_type == DType::F32) {
    const auto* g = static_cast<const float*>(dh);
    if (mode == kSwiGLU) launch_bwd<kSwiGLU>(a, g, o, rows, I, ldab, lddab, c, s);
    else if (mode == kSituCap) launch_bwd<kSituCap>(a, g, o, rows, I, ldab, lddab, c, s);
    else launch_bwd<kSituNoCap>(a, g, o, rows, I, ldab, lddab, c, s);
  } else {
    const auto* g = static_cast<const bf16*>(dh);
    if (mode == kSwiGLU) launch_bwd<kSwiGLU>(a, g, o, rows, I, ldab, lddab, c, s);
    else if (mode == kSituCap) launch_bwd<kSituCap>(a, g, o, rows, I, ldab, lddab, c, s);
    else launch_bwd<kSituNoCap>(a, g, o, rows, I, ldab, lddab, c, s);
  }
  check(cudaGetLastError(), "glu_backward launch");
}

}  // namespace lm::ops::cuda

#pragma once
// SiTU-GLU / SwiGLU of one output column (SPEC §4, as ops/glu) in the expert GEMMs' epilogues: the wgmma kernel
// (gemm.cu) and the few-row kernel (few_rows.cu) share it, so both paths round h the same way.
#include <cmath>

namespace lm::ops::cuda::detail {

struct GluConsts {
  int swiglu = 0;
  float beta1 = 4.f, beta2 = 0.f, inv_beta1 = 0.25f, inv_beta2 = 0.f;  // beta2 0: no cap on b
};

// tanh.approx (one MUFU op, relative error ~2^-11, below the bf16 rounding of h); σ(x) = (1 + tanh(x/2)) / 2.
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float glu_epilogue(float a, float b, const GluConsts& g) {
  const float sig = fmaf(0.5f, tanh_fast(0.5f * a), 0.5f);
  if (g.swiglu) return a * sig * b;
  const float A = g.beta1 * tanh_fast(a * g.inv_beta1) * sig;
  const float B = g.beta2 > 0.f ? g.beta2 * tanh_fast(b * g.inv_beta2) : b;
  return A * B;
}

// From the host's GluArgs fields: beta2 that is not finite or <= 0 means no cap.
inline GluConsts glu_consts(bool swiglu, float beta1, float beta2) {
  GluConsts c;
  c.swiglu = swiglu ? 1 : 0, c.beta1 = beta1, c.beta2 = std::isfinite(beta2) && beta2 > 0 ? beta2 : 0.f;
  c.inv_beta1 = 1.f / beta1, c.inv_beta2 = c.beta2 > 0 ? 1.f / c.beta2 : 0.f;
  return c;
}

}  // namespace lm::ops::cuda::detail

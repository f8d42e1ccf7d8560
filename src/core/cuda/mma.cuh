#pragma once
// Warp-level tensor-core helpers (sm_80+, used on sm_90a): mma.sync (bf16 / fp16 m16n8k16, tf32 m16n8k8, fp32
// accumulate), ldmatrix fragment loads, cp.async copies into shared memory, and the register packings the
// fragments use. Shared by the attention kernels (ops/attention/cuda) and the KDA kernels (ops/kda/cuda).
//
// Fragment names follow the PTX ISA: g = lane / 4 (row in an 8-row group), t = lane % 4 (column pair).
// An m16n8 fp32 accumulator c[4] holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lm::cu {

// ---- packing ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
// fp16 carries 3 more mantissa bits than bf16 (KDA keeps values of bounded range in it; gradients stay bf16).
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float2 unpack_f16(uint32_t u) { return __half22float2(*reinterpret_cast<const __half2*>(&u)); }
template <bool F16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return F16 ? pack_f16(lo, hi) : pack_bf16(lo, hi);
}
template <bool F16>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  return F16 ? unpack_f16(u) : unpack_bf16(u);
}
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// ---- streamed weights (the few-row products of decode steps: ops/gemm/cuda, ops/moe/cuda) --------------------
// 16 bytes read once: past L1, which keeps what the block reads again (the rows of x). A plain (not .nc) load:
// ptxas sinks read-only .nc loads down to their first use, past a __syncwarp, which leaves few of a batch in flight.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Asks L2 for `bytes` (a multiple of 16, from a 16-byte aligned p) in one bulk request: weights fetched before
// the kernel waits for its inputs (programmatic dependent launch, core/cuda/pdl.cuh).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
// The eight bf16 of v as four float pairs, in order.
__device__ __forceinline__ void unpack8_bf16(const uint4& v, float2 (&f)[4]) {
  f[0] = unpack_bf16(v.x), f[1] = unpack_bf16(v.y), f[2] = unpack_bf16(v.z), f[3] = unpack_bf16(v.w);
}
// acc += Σ_j w_j · x_j over the eight bf16 of w, in order, and the eight floats of x[0..3].
__device__ __forceinline__ void fma8_bf16(float& acc, const uint4& w, const float2* x) {
  const uint32_t wu[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 wf = unpack_bf16(wu[j]);
    acc = fmaf(wf.x, x[j].x, acc), acc = fmaf(wf.y, x[j].y, acc);
  }
}

// ---- shared memory, ldmatrix, mma ----------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// x4 non-transposed: A fragment of a row-major [m][k] tile (lane address: row lane & 15, col (lane >> 4) * 8),
// or two n8 B fragments of an [n][k] tile (row (lane & 7) + (lane >> 4) * 8, col ((lane >> 3) & 1) * 8).
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// x4 transposed: A fragment of a [k][m] tile (row (lane & 7) + (lane >> 4) * 8, col ((lane >> 3) & 1) * 8),
// or two n8 B fragments of a [k][n] tile (row (lane & 7) + ((lane >> 3) & 1) * 8, col (lane >> 4) * 8).
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// Lane offsets (in elements, for a row stride ld) of the four addressing patterns above.
__device__ __forceinline__ int a_off(int lane, int ld) { return (lane & 15) * ld + (lane >> 4) * 8; }
__device__ __forceinline__ int bn_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int at_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int bt_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool F16>
__device__ __forceinline__ void mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if (F16) mma_f16(c, a, b0, b1);
  else mma_bf16(c, a, b0, b1);
}
// Two adjacent n8 accumulator tiles (16 x 16) as the A fragment (bf16 or fp16) of the next product.
template <bool F16 = false>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4], float s = 1.f) {
  a[0] = pack2<F16>(s * c0[0], s * c0[1]);
  a[1] = pack2<F16>(s * c0[2], s * c0[3]);
  a[2] = pack2<F16>(s * c1[0], s * c1[1]);
  a[3] = pack2<F16>(s * c1[2], s * c1[3]);
}

// ---- cp.async ------------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace lm::cu

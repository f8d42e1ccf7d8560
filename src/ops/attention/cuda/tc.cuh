#pragma once
// Warp-level tensor-core helpers of the attention kernels: mma.sync m16n8k16 (bf16 in, fp32 accumulate),
// ldmatrix fragment loads and cp.async tile copies.
//
// Fragment names follow the PTX ISA: g = lane / 4 (row in an 8-row group), t = lane % 4 (column pair).
// An m16n8 fp32 accumulator c[4] holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
#include <cuda_bf16.h>

#include <cstdint>

namespace lm::ops::cuda::detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ldmatrix x4. Lane address patterns (element offsets for a row stride ld):
//   a_off : A fragment (16 x 16) of a row-major [m][k] tile
//   bn_off: two n8 B fragments (16 n x 16 k) of an [n][k] tile (k contiguous)
//   (transposed forms, with .trans)
//   at_off: A fragment of a [k][m] tile (m contiguous)
//   bt_off: two n8 B fragments of a [k][n] tile (n contiguous)
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ int a_off(int lane, int ld) { return (lane & 15) * ld + (lane >> 4) * 8; }
__device__ __forceinline__ int bn_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int at_off(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int bt_off(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two adjacent n8 accumulators (16 x 16) as the A fragment of the next product.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// R x COLS bf16 tile from rows of stride gstride (elements) into shared memory of row stride LD, rows >= nr
// zero-filled (their source address is clamped to row 0, which is always valid).
template <int R, int COLS, int LD, int NT>
__device__ __forceinline__ void load_rows(bf16* s, const bf16* g, int64_t gstride, int nr, int tid) {
  constexpr int VPR = COLS / 8;
#pragma unroll
  for (int idx = tid; idx < R * VPR; idx += NT) {
    const int r = idx / VPR, c = (idx % VPR) * 8;
    const bool ok = r < nr;
    cp_async16(s + r * LD + c, g + (ok ? static_cast<int64_t>(r) * gstride : 0) + c, ok);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace lm::ops::cuda::detail

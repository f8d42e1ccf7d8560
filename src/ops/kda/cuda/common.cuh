#pragma once
// Device helpers shared by the KDA kernels: conversions, cp.async tile loads, the gate, the row norms on tensor
// cores, and the parameter blocks the host fills; the warp MMAs (mma.sync bf16 / fp16 m16n8k16, tf32 m16n8k8),
// ldmatrix and cp.async themselves are core/cuda/mma.cuh's.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C chunk 64, KP = K and V padded to 64|128,
//         NC chunks over all sequences. Fragment names follow the PTX ISA: g = lane / 4, t = lane % 4.
// Workspace tensors are chunk-padded: [NC, H, 64, KP] (W, U, Qg, Kd, E, dE), [NC, H, 64, 64] (A_qk, M,
// P_kk), [NC, H, KP, KP] (S0, dS), [NC, H, KP] (Γ_last); padded rows and columns hold zeros.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/cuda/mma.cuh"

namespace lm::kda::cuda::detail {

using namespace lm::cu;  // core/cuda/mma.cuh: packing, ldmatrix, mma.sync, cp.async
using bf16 = __nv_bfloat16;
constexpr int kC = 64;

// One chunk of one sequence: first token `row0` in the packed [B*T] rows, `len` <= 64 tokens.
struct ChunkInfo {
  int seq, row0, len, pad;
};

// ---- conversions ----------------------------------------------------------------------------
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float2 ld_bf16x2(const bf16* p) {
  return unpack_bf16(*reinterpret_cast<const uint32_t*>(p));
}
__device__ __forceinline__ void st_bf16x2(bf16* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack_bf16(a, b);
}
template <bool F16>
__device__ __forceinline__ uint16_t bits16(float x) {
  if (F16) return __half_as_ushort(__float2half_rn(x));
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
// x ≈ hi + lo in bf16 (a 16-bit mantissa in two MMAs' operands).
__device__ __forceinline__ void split_bf16(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(x, y);
  const float2 h = unpack_bf16(hi);
  lo = pack_bf16(x - h.x, y - h.y);
}

// R x COLS bf16 tile (row stride gstride elements) into shared memory (row stride LD), zero-filling rows
// >= nr and columns >= nc (nc a multiple of 8).
template <int R, int COLS, int LD, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t gstride, int nr, int nc, int tid) {
  constexpr int VPR = COLS / 8;
#pragma unroll 4
  for (int idx = tid; idx < R * VPR; idx += NT) {
    const int r = idx / VPR, c = (idx % VPR) * 8;
    const bool ok = r < nr && c < nc;
    cp_async16(s + r * LD + c, ok ? g + static_cast<int64_t>(r) * gstride + c : g, ok);
  }
}
// 64 x KP tile of 2- or 4-byte elements, dense rows (KP elements), zero-filled beyond nr rows and nc columns
// (nc * ES a multiple of 16 bytes).
template <int KP, int ES, int NT>
__device__ __forceinline__ void load_raw(void* s, const void* g, int64_t gstride, int nr, int nc, int tid) {
  constexpr int VPR = KP * ES / 16;
  const char* gb = static_cast<const char*>(g);
  char* sb = static_cast<char*>(s);
  for (int idx = tid; idx < 64 * VPR; idx += NT) {
    const int r = idx / VPR, cb = (idx % VPR) * 16;
    const bool ok = r < nr && cb < nc * ES;
    cp_async16(sb + r * KP * ES + cb, ok ? gb + static_cast<int64_t>(r) * gstride * ES + cb : gb, ok);
  }
}
template <int N, int NT>
__device__ __forceinline__ void load_f32(float* s, const float* g, int tid) {
  for (int idx = tid; idx < N / 4; idx += NT) cp_async16(s + idx * 4, g + idx * 4, true);
}

// ---- gate (SPEC §2): x = g_raw + dt_bias, a = exp(A_log) --------------------------------------
// Fast reciprocal (MUFU): IEEE division costs ~10 instructions with a slow path, and every chunk kernel runs
// 64 x K gates per block; 1 / inf = 0 keeps the large-negative limit.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float sigmoidf_(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }
__device__ __forceinline__ float gate_fwd(float x, float a, float lb, bool softplus) {
  if (softplus) return -a * (x > 20.f ? x : log1pf(__expf(x)));
  return lb * rcp_approx(1.f + __expf(-(a * x)));  // σ as sigmoidf_ without the division's range checks
}
// 1/|q_i|, 1/|k_i| (+1e-6 under the root) of the 64 rows of two [64][LDB] bf16 tiles, from the diagonals of the
// 16x16 Gram blocks Q Qᵀ, K Kᵀ on tensor cores: warp w < 8 takes row block w & 3 of Q (w < 4) or K. The
// ldmatrix A fragment of a row block doubles as the B fragments of its transpose; the sums are fp32 over exact
// bf16 products, as CUDA-core sums would be, at ~24 instructions per warp instead of a shuffle tree per row.
template <int KP, int LDB>
__device__ __forceinline__ void unit_row_norms(const bf16* sQ, const bf16* sK, float* sRq, float* sRk, int warp,
                                               int lane) {
  if (warp >= 8) return;
  const int ti = warp & 3, isk = warp >> 2, g = lane >> 2, t = lane & 3;
  const bf16* src = (isk ? sK : sQ) + 16 * ti * LDB;
  float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int ks = 0; ks < KP / 16; ++ks) {
    uint32_t fr[4];
    ldsm4(fr, src + 16 * ks + a_off(lane, LDB));
    mma_bf16(c0, fr, fr[0], fr[2]);  // columns = rows 0..7 of the block
    mma_bf16(c1, fr, fr[1], fr[3]);  // columns = rows 8..15
  }
  if ((g >> 1) == t) {  // this lane holds (g, g) of c0 and (g + 8, g + 8) of c1
    float* dst = (isk ? sRk : sRq) + 16 * ti;
    dst[g] = 1.f / sqrtf(((g & 1) ? c0[1] : c0[0]) + 1e-6f);
    dst[g + 8] = 1.f / sqrtf(((g & 1) ? c1[3] : c1[2]) + 1e-6f);
  }
}
// dg/dx and the dA_log term (dx * x for the bounded form, dg * g for softplus).
__device__ __forceinline__ void gate_bwd(float x, float a, float lb, bool softplus, float dg, float& dx, float& dA) {
  if (softplus) {
    const float sp = x > 20.f ? x : log1pf(__expf(x));
    dx = -dg * a * (x > 20.f ? 1.f : sigmoidf_(x));
    dA = dg * (-a * sp);
  } else {
    const float s = sigmoidf_(a * x);
    dx = dg * lb * s * (1.f - s) * a;
    dA = dx * x;
  }
}

// ---- parameter blocks -----------------------------------------------------------------------
struct Ws {  // workspace pointers (chunk-padded layouts above); the forward keeps Kd, U, A_qk in fp16 bits
  bf16 *W, *U, *Qg, *Kd, *Aqk, *M, *Pkk, *S0, *dS, *E, *dE;
  float *Gl, *ddt_part, *dA_part;
};

struct OpParams {
  const bf16 *q, *k, *v;
  const void *g_raw, *beta_raw;
  const float *A_log, *dt_bias, *h0;
  const ChunkInfo* chunks;
  const int* seq_chunk0;  // [N + 1]: chunks of sequence n are [seq_chunk0[n], seq_chunk0[n+1])
  int H, K, V, NC;
  int64_t beta_ld;  // row stride of beta_raw and dbeta_raw per token (H when they are dense [.., H])
  float scale, lb;
  int softplus;
  Ws ws;
  // forward outputs
  bf16* o;
  float* ht;
  // backward
  const bf16* dout;
  const float* dht;
  bf16 *dq, *dk, *dv;
  void *dg_raw, *dbeta_raw;
  float *dA_log, *ddt_bias, *dh0;
  // host only: the programmatic event of the recurrence that produces o (forward) or dS (backward), see launch.hpp
  void* started;
};

}  // namespace lm::kda::cuda::detail

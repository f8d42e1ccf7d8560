// Full (non-causal) varlen attention on mma.sync bf16 tensor cores (m16n8k16, fp32 accumulate), forward and
// backward, FlashAttention-2 structure (the math in full_attention_cuda.hpp; the fp32 CUDA-core kernels of
// full_attention.cu are the fallback for unaligned strides and the tests' second opinion).
//
// Legend: B = 64 rows per tile, 4 warps per block, each warp owns 16 rows of its block's tile (queries in the
//         forward and dq kernels, keys in the dk/dv kernel); DP = Dh rounded up to 16 (the k extent of a score
//         product; columns [Dh, DP) of the shared tiles are zero); LD = DP + 8 the shared row stride in bf16
//         (16 bytes of padding: conflict-free ldmatrix); NT = DP / 8 the n8 tiles of a [16, DP] accumulator.
// Fragment names as core/cuda/mma.cuh: g = lane / 4, t = lane % 4; an m16n8 accumulator c[4] holds (g, 2t),
// (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
// Softmax in the log2 domain (scores · scale · log2 e). P and dS enter their products rounded to bf16; every sum
// is fp32 and in a fixed order: deterministic, no atomics.
//   forward: block per (query tile, head); per key tile S = Q Kᵀ, online softmax, O += P V.
//   dk/dv:   block per (key tile, head); per query tile Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ = exp2(Sᵀ − lse),
//            dSᵀ = Pᵀ (dPᵀ − Δ), dV += Pᵀ dO, dK += dSᵀ Q.
//   dq:      block per (query tile, head); per key tile S, dP = dO Vᵀ, dS, dQ += dS K.
// Measured on one H200 (cudaEvent, mean of 5 after 2 warm-ups), one 4096-row image, H = 12, Dh = 128: forward
// 0.51 ms (~200 TFLOP/s), backward 1.40 ms, against 9.9 and 22.8 ms for the fp32 CUDA-core kernels; 64 images of
// 256 rows: 0.23 and 0.62 ms. Errors vs the CPU fp32 path (tests): o ~1.8e-3, dq/dk/dv ~2.4e-3 relative RMS.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/mma.cuh"
#include "ops/full_attention/cuda/media.cuh"

namespace lm::ops::cuda::fa {

namespace {

using bf16 = __nv_bfloat16;
using namespace lm::cu;  // packing, ldmatrix, mma.sync, cp.async

constexpr cu::Checker check{"full attention cuda"};
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

__device__ __forceinline__ float ex2(float x) {  // ex2.approx: ex2(−∞) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Rows [0, m) of g (row stride ld elements; 16-byte aligned rows), columns [0, Dh), into s [kB][LD]; rows >= m
// and columns [Dh, DP) zero. Asynchronous (cp.async): the caller commits and waits.
template <int DP>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t ld, int m, int Dh) {
  constexpr int LD = DP + 8, VPR = DP / 8;
  for (int idx = threadIdx.x; idx < kB * VPR; idx += kThreads) {
    const int r = idx / VPR, c = (idx - r * VPR) * 8;
    if (c >= Dh) {
      *reinterpret_cast<uint4*>(s + r * LD + c) = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const bool ok = r < m;
    cp_async16(s + r * LD + c, g + (ok ? int64_t(r) * ld : 0) + c, ok);  // !ok: zero fill from a valid row
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// c[8][4] (+)= A[16 rows at a][DP] · B[64 rows at b][DP]ᵀ: A's rows are the warp's, B's rows the tile's columns.
template <int DP>
__device__ __forceinline__ void dots_64(float (&c)[8][4], const bf16* a, const bf16* b, int lane) {
  constexpr int LD = DP + 8;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    uint32_t fa_[4];
    ldsm4(fa_, a + kk * 16 + a_off(lane, LD));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t fb[4];
      ldsm4(fb, b + (np * 16) * LD + kk * 16 + bn_off(lane, LD));
      mma_bf16(c[2 * np], fa_, fb[0], fb[1]);
      mma_bf16(c[2 * np + 1], fa_, fb[2], fb[3]);
    }
  }
}

// acc[NT][4] += X[16][64] · Y[64 rows][DP] with X given as accumulators x[8][4] (rounded to bf16), Y in shared.
template <int DP>
__device__ __forceinline__ void acc_xy(float (&acc)[DP / 8][4], const float (&x)[8][4], const bf16* y, int lane) {
  constexpr int LD = DP + 8;
#pragma unroll
  for (int kk = 0; kk < kB / 16; ++kk) {
    uint32_t fa_[4];
    c_to_a(fa_, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
    for (int np = 0; np < DP / 16; ++np) {
      uint32_t fb[4];
      ldsm4t(fb, y + (kk * 16) * LD + np * 16 + bt_off(lane, LD));
      mma_bf16(acc[2 * np], fa_, fb[0], fb[1]);
      mma_bf16(acc[2 * np + 1], fa_, fb[2], fb[3]);
    }
  }
}

// Rows [row0, row0 + 16) of a warp's accumulator, times mul, to bf16 rows (stride ld) of which the first m are
// real; columns [0, Dh).
template <int DP>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t ld, const float (&acc)[DP / 8][4], int row0, int m,
                                           int Dh, float mul, int g, int t) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = row0 + g + 8 * hr;
    if (r >= m) continue;
    bf16* d = dst + int64_t(r) * ld;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      const int c = n * 8 + 2 * t;
      if (c >= Dh) continue;  // Dh % 8 == 0: both columns of the pair are real or neither
      d[c] = __float2bfloat16_rn(mul * acc[n][2 * hr]);
      d[c + 1] = __float2bfloat16_rn(mul * acc[n][2 * hr + 1]);
    }
  }
}

template <int DP>
__global__ void __launch_bounds__(kThreads) tc_fwd_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                          const bf16* k, const bf16* v, bf16* o, float* lse, int H,
                                                          int Dh, int64_t ld, int64_t ldo, float scale_log2) {
  constexpr int LD = DP + 8, NT = DP / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + kB * LD;
  bf16* sV = sK + kB * LD;
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mq = min(kB, T - tl.r0);
  const int64_t col = int64_t(h) * Dh, q0 = tl.start + tl.r0;

  load_tile<DP>(sQ, q + q0 * ld + col, ld, mq, Dh);
  cp_commit();
  float acc[NT][4];
  zero(acc);
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l_run: this lane's share of the row sum

  for (int k0 = 0; k0 < T; k0 += kB) {
    const int mk = min(kB, T - k0);
    __syncthreads();  // every warp is done with the previous K, V
    load_tile<DP>(sK, k + (tl.start + k0) * ld + col, ld, mk, Dh);
    load_tile<DP>(sV, v + (tl.start + k0) * ld + col, ld, mk, Dh);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    float s[8][4];
    zero(s);
    dots_64<DP>(s, sQ + warp * 16 * LD, sK, lane);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = n * 8 + 2 * t + (e & 1) < mk ? s[n][e] * scale_log2 : -INFINITY;
    // Rows g and g + 8; the 4 lanes of a quad share a row. Key 0 is real, so the new max is finite.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * hr], s[n][2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hr], mx), alpha = ex2(m_run[hr] - m_new);
      m_run[hr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float p0 = ex2(s[n][2 * hr] - m_new), p1 = ex2(s[n][2 * hr + 1] - m_new);
        s[n][2 * hr] = p0, s[n][2 * hr + 1] = p1;
        sum += p0 + p1;
      }
      l_run[hr] = l_run[hr] * alpha + sum;
#pragma unroll
      for (int n = 0; n < NT; ++n) acc[n][2 * hr] *= alpha, acc[n][2 * hr + 1] *= alpha;
    }
    acc_xy<DP>(acc, s, sV, lane);
  }

  float inv[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = l_run[hr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[hr] = 1.f / l;
    const int r = warp * 16 + g + 8 * hr;
    if (t == 0 && r < mq) lse[(q0 + r) * H + h] = (m_run[hr] + log2f(l)) * kLn2;
  }
  // store_rows takes one multiplier: scale each half-row by its own 1 / l first.
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] *= inv[0], acc[n][1] *= inv[0], acc[n][2] *= inv[1], acc[n][3] *= inv[1];
  store_rows<DP>(o + q0 * ldo + col, ldo, acc, warp * 16, mq, Dh, 1.f, g, t);
}

// lse (as log2: lse · log2 e) and Δ of rows [r, r + m) of head h into sL, sD; rows >= m get +∞ and 0, so
// their P = exp2(s − ∞) = 0.
__device__ __forceinline__ void load_stats(float* sL, float* sD, const float* lse, const float* delta, int64_t r,
                                           int m, int H, int h) {
  const int i = threadIdx.x;
  if (i < kB) {
    sL[i] = i < m ? lse[(r + i) * H + h] * kLog2e : INFINITY;
    sD[i] = i < m ? delta[(r + i) * H + h] : 0.f;
  }
}

template <int DP>
__global__ void __launch_bounds__(kThreads) tc_dkdv_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                           const bf16* k, const bf16* v, const bf16* dout,
                                                           const float* lse, const float* delta, bf16* dk, bf16* dv,
                                                           int H, int Dh, int64_t ld, int64_t ldo, float scale,
                                                           float scale_log2) {
  constexpr int LD = DP + 8, NT = DP / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + kB * LD;
  bf16* sQ = sV + kB * LD;
  bf16* sdO = sQ + kB * LD;
  float* sL = reinterpret_cast<float*>(sdO + kB * LD);
  float* sD = sL + kB;
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mk = min(kB, T - tl.r0);
  const int64_t col = int64_t(h) * Dh, k0 = tl.start + tl.r0;

  load_tile<DP>(sK, k + k0 * ld + col, ld, mk, Dh);
  load_tile<DP>(sV, v + k0 * ld + col, ld, mk, Dh);
  cp_commit();
  float adk[NT][4], adv[NT][4];
  zero(adk);
  zero(adv);

  for (int r0 = 0; r0 < T; r0 += kB) {
    const int mq = min(kB, T - r0);
    const int64_t qa = tl.start + r0;
    __syncthreads();  // every warp is done with the previous Q, dO, statistics
    load_tile<DP>(sQ, q + qa * ld + col, ld, mq, Dh);
    load_tile<DP>(sdO, dout + qa * ldo + col, ldo, mq, Dh);
    load_stats(sL, sD, lse, delta, qa, mq, H, h);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    // This warp's 16 keys (rows) against the tile's 64 queries (columns).
    float st[8][4], dpt[8][4];
    zero(st);
    zero(dpt);
    dots_64<DP>(st, sK + warp * 16 * LD, sQ, lane);
    dots_64<DP>(dpt, sV + warp * 16 * LD, sdO, lane);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = n * 8 + 2 * t + (e & 1);
        const float p = ex2(st[n][e] * scale_log2 - sL[qc]);
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - sD[qc]);
      }
    acc_xy<DP>(adv, st, sdO, lane);  // dV += Pᵀ dO
    acc_xy<DP>(adk, dpt, sQ, lane);  // dK += dSᵀ Q (scale at the end)
  }
  store_rows<DP>(dk + k0 * ld + col, ld, adk, warp * 16, mk, Dh, scale, g, t);
  store_rows<DP>(dv + k0 * ld + col, ld, adv, warp * 16, mk, Dh, 1.f, g, t);
}

template <int DP>
__global__ void __launch_bounds__(kThreads) tc_dq_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                         const bf16* k, const bf16* v, const bf16* dout,
                                                         const float* lse, const float* delta, bf16* dq, int H, int Dh,
                                                         int64_t ld, int64_t ldo, float scale, float scale_log2) {
  constexpr int LD = DP + 8, NT = DP / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + kB * LD;
  bf16* sK = sdO + kB * LD;
  bf16* sV = sK + kB * LD;
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mq = min(kB, T - tl.r0);
  const int64_t col = int64_t(h) * Dh, qa = tl.start + tl.r0;

  load_tile<DP>(sQ, q + qa * ld + col, ld, mq, Dh);
  load_tile<DP>(sdO, dout + qa * ldo + col, ldo, mq, Dh);
  cp_commit();
  float L[2], D[2];  // rows g and g + 8 of this warp
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = warp * 16 + g + 8 * hr;
    L[hr] = r < mq ? lse[(qa + r) * H + h] * kLog2e : INFINITY;
    D[hr] = r < mq ? delta[(qa + r) * H + h] : 0.f;
  }
  float adq[NT][4];
  zero(adq);

  for (int k0 = 0; k0 < T; k0 += kB) {
    const int mk = min(kB, T - k0);
    __syncthreads();  // every warp is done with the previous K, V
    load_tile<DP>(sK, k + (tl.start + k0) * ld + col, ld, mk, Dh);
    load_tile<DP>(sV, v + (tl.start + k0) * ld + col, ld, mk, Dh);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    dots_64<DP>(s, sQ + warp * 16 * LD, sK, lane);
    dots_64<DP>(dp, sdO + warp * 16 * LD, sV, lane);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e >> 1;
        const bool real = n * 8 + 2 * t + (e & 1) < mk;
        const float p = ex2(s[n][e] * scale_log2 - L[hr]);
        dp[n][e] = real ? p * (dp[n][e] - D[hr]) : 0.f;
      }
    acc_xy<DP>(adq, dp, sK, lane);  // dQ += dS K (scale at the end)
  }
  store_rows<DP>(dq + qa * ld + col, ld, adq, warp * 16, mq, Dh, scale, g, t);
}

template <int DP>
constexpr int fwd_bytes() {
  return 3 * kB * (DP + 8) * 2;
}
template <int DP>
constexpr int bwd_bytes() {
  return 4 * kB * (DP + 8) * 2 + 2 * kB * 4;
}

template <class K>
void allow(K kernel, int bytes, const char* what) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
}

template <int DP>
void fwd_t(const MediaTable& t, int32_t tiles, const TcArgs& a, const bf16* q, const bf16* k, const bf16* v, bf16* o,
           float* lse, cudaStream_t st) {
  constexpr int bytes = fwd_bytes<DP>();
  allow(tc_fwd_kernel<DP>, bytes, "full_attention_forward smem");
  tc_fwd_kernel<DP><<<dim3(unsigned(tiles), unsigned(a.H)), kThreads, bytes, st>>>(t, q, k, v, o, lse, a.H, a.Dh, a.ld,
                                                                                 a.ldo, a.scale * kLog2e);
  check(cudaGetLastError(), "full_attention_forward launch");
}

template <int DP>
void bwd_t(const MediaTable& t, int32_t tiles, const TcArgs& a, const bf16* q, const bf16* k, const bf16* v,
           const bf16* dout, const float* lse, const float* delta, bf16* dq, bf16* dk, bf16* dv, cudaStream_t st) {
  constexpr int bytes = bwd_bytes<DP>();
  allow(tc_dkdv_kernel<DP>, bytes, "full_attention_backward dk/dv smem");
  allow(tc_dq_kernel<DP>, bytes, "full_attention_backward dq smem");
  const dim3 grid(unsigned(tiles), unsigned(a.H));
  tc_dkdv_kernel<DP><<<grid, kThreads, bytes, st>>>(t, q, k, v, dout, lse, delta, dk, dv, a.H, a.Dh, a.ld, a.ldo,
                                                    a.scale, a.scale * kLog2e);
  check(cudaGetLastError(), "full_attention_backward dk/dv launch");
  tc_dq_kernel<DP><<<grid, kThreads, bytes, st>>>(t, q, k, v, dout, lse, delta, dq, a.H, a.Dh, a.ld, a.ldo, a.scale,
                                                  a.scale * kLog2e);
  check(cudaGetLastError(), "full_attention_backward dq launch");
}

#define LM_DP_SWITCH(Dh, CALL)        \
  switch ((Dh + 15) / 16) {           \
    case 1: CALL(16); break;          \
    case 2: CALL(32); break;          \
    case 3: CALL(48); break;          \
    case 4: CALL(64); break;          \
    case 5: CALL(80); break;          \
    case 6: CALL(96); break;          \
    case 7: CALL(112); break;         \
    default: CALL(128); break;        \
  }

}  // namespace

void tc_forward(const MediaTable& t, int32_t tiles, const TcArgs& a, const bf16* q, const bf16* k, const bf16* v,
                bf16* o, float* lse, cudaStream_t st) {
#define LM_F(DP) fwd_t<DP>(t, tiles, a, q, k, v, o, lse, st)
  LM_DP_SWITCH(a.Dh, LM_F)
#undef LM_F
}

void tc_backward(const MediaTable& t, int32_t tiles, const TcArgs& a, const bf16* q, const bf16* k, const bf16* v,
                 const bf16* dout, const float* lse, const float* delta, bf16* dq, bf16* dk, bf16* dv,
                 cudaStream_t st) {
#define LM_B(DP) bwd_t<DP>(t, tiles, a, q, k, v, dout, lse, delta, dq, dk, dv, st)
  LM_DP_SWITCH(a.Dh, LM_B)
#undef LM_B
}

}  // namespace lm::ops::cuda::fa

// Causal flash attention backward on Hopper warpgroup MMAs, warp-specialised.
//
// Legend: T tokens of a sequence (len), H query heads, Hkv kv heads, G = H / Hkv, Dk q/k head dim (128 | 192),
//         Dv = 128, Bk = 64 keys per block (dK, dV owned in registers), Bq = 64 query rows per step.
// One block per (key tile, kv head), heavy tiles first; it walks the G query heads of its kv head and the query
// tiles from the diagonal to the sequence end. Warp roles (384 threads):
//   warpgroup 0, producer: one thread loads K, V once and Q_i, dO_i per step by TMA into a two-stage ring;
//     warp 1 copies the step's row statistics (lse·log2 e and D = rowsum(dO ⊙ O)) into the same stage.
//   warpgroup 1, dK/dV: Sᵀ = K·Q_iᵀ and dPᵀ = V·dO_iᵀ (keys on the M side, so P and dS come out transposed,
//     already the A operands of the next products); Pᵀ = exp2(Sᵀ·scale·log2 e − lse2), dSᵀ = scale·Pᵀ⊙(dPᵀ − D);
//     dV += Pᵀ·dO_i and dK += dSᵀ·Q_i with Pᵀ, dSᵀ straight from registers and dO_i, Q_i read N-major; dSᵀ also
//     goes to shared memory (M-major with the 128-byte swizzle) for
//   warpgroup 2, dQ: dQ_i = dS·K from shared memory (A M-major, B N-major), staged as fp32 and added to the
//     accumulator [H, rows + 64, Dk] with one bulk asynchronous reduction per row.
// The two compute warpgroups overlap: dQ of step i runs while warpgroup 1 computes step i + 1.
#include <cuda.h>

#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"
#include "ops/moe/cuda/hopper.cuh"
#include "ops/moe/cuda/tensor_map.hpp"

namespace lm::ops::cuda::detail {

namespace {

constexpr int kB = 64, kDv = 128, kThreads = 384;

template <int DK>
struct BwSmem {
  static constexpr int K = DK * kB * 2, V = kDv * kB * 2, Q = K, DO = V, DS = kB * kB * 2, LDQ = DK + 8;
  static constexpr int oK = 0, oV = oK + K, oQ = oV + V, oDO = oQ + 2 * Q, oDS = oDO + 2 * DO, oDQ = oDS + 2 * DS,
                       oST = oDQ + kB * LDQ * 4, oBar = oST + 2 * 2 * kB * 4, bytes = oBar + 16 * 8 + 1024;
};

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_reduce_add_f32(float* g, const float* s, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(g),
               "r"(smem_u32(s)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

template <int DK>
__global__ void __launch_bounds__(kThreads, 1)
    attn_bwd_wgmma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                          const __grid_constant__ CUtensorMap tmV, const __grid_constant__ CUtensorMap tmDO,
                          const BwdParams p) {
  using L = BwSmem<DK>;
  constexpr int NK = DK / 8;  // n8 blocks of a dK / dQ row
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char *sK = smem + L::oK, *sV = smem + L::oV;
  float* sDQ = reinterpret_cast<float*>(smem + L::oDQ);
  float* sST = reinterpret_cast<float*>(smem + L::oST);  // [2][lse2 64 | D 64]
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::oBar);
  uint64_t *kvfull = bar, *qfull = bar + 1, *qempty = bar + 3, *dsfull = bar + 5, *dsempty = bar + 7;

  const int hk = blockIdx.x % p.Hkv;
  const int2 tl = p.tiles[blockIdx.x / p.Hkv];
  const int s0 = p.seq_start[tl.x], len = p.seq_start[tl.x + 1] - s0;
  const int kt = tl.y, k0 = kt * kB;
  const int nqt = (len + kB - 1) / kB, nsteps_h = nqt - kt, nsteps = nsteps_h * p.G;
  const int tid = threadIdx.x, wg = tid / 128, ltid = tid % 128, warp = ltid >> 5, lane = ltid & 31;
  const int g = lane >> 2, t = lane & 3;

  if (tid == 0) {
    mbar_init(kvfull, 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(&qfull[s], 1 + 32);  // TMA thread (with the byte count) + the 32 lanes copying statistics
      mbar_init(&qempty[s], 128);
      mbar_init(&dsfull[s], 128);
      mbar_init(&dsempty[s], 128);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (warp == 0 && lane == 0) {
      mbar_expect_tx(kvfull, L::K + L::V);
      for (int a = 0; a < DK / 64; ++a) tma_load_3d(sK + a * kB * 128, &tmK, kvfull, 64 * a, hk, s0 + k0);
      for (int a = 0; a < kDv / 64; ++a) tma_load_3d(sV + a * kB * 128, &tmV, kvfull, 64 * a, hk, s0 + k0);
      for (int step = 0; step < nsteps; ++step) {
        const int s = step & 1, h = hk * p.G + step / nsteps_h, q0 = (kt + step % nsteps_h) * kB;
        mbar_wait(&qempty[s], ((step >> 1) & 1) ^ 1);
        unsigned char* sQ = smem + L::oQ + s * L::Q;
        unsigned char* sDO = smem + L::oDO + s * L::DO;
        mbar_expect_tx(&qfull[s], L::Q + L::DO);
        for (int a = 0; a < DK / 64; ++a) tma_load_3d(sQ + a * kB * 128, &tmQ, &qfull[s], 64 * a, h, s0 + q0);
        for (int a = 0; a < kDv / 64; ++a) tma_load_3d(sDO + a * kB * 128, &tmDO, &qfull[s], 64 * a, h, s0 + q0);
      }
    } else if (warp == 1) {
      for (int step = 0; step < nsteps; ++step) {
        const int s = step & 1, h = hk * p.G + step / nsteps_h, q0 = (kt + step % nsteps_h) * kB;
        const int nq = min(kB, len - q0);
        mbar_wait(&qempty[s], ((step >> 1) & 1) ^ 1);
        const int64_t so = int64_t(h) * p.rows + s0 + q0;
        for (int i = lane; i < kB; i += 32) {
          sST[s * 2 * kB + i] = i < nq ? p.lse2[so + i] : 0.f;
          sST[s * 2 * kB + kB + i] = i < nq ? p.D[so + i] : 0.f;
        }
        mbar_arrive(&qfull[s]);  // release: the stores above are visible to the waiting consumers
      }
    }
    return;
  }

  if (wg == 1) {
    // ---------------------------------------------------------------- dK, dV
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    float dv[64], dk[DK / 2];
#pragma unroll
    for (int i = 0; i < 64; ++i) dv[i] = 0.f;
#pragma unroll
    for (int i = 0; i < DK / 2; ++i) dk[i] = 0.f;
    mbar_wait(kvfull, 0);
    for (int step = 0; step < nsteps; ++step) {
      const int s = step & 1, q0 = (kt + step % nsteps_h) * kB;
      const uint32_t ph = (step >> 1) & 1;
      const unsigned char* sQ = smem + L::oQ + s * L::Q;
      const unsigned char* sDO = smem + L::oDO + s * L::DO;
      float st[32], dpt[32];
      mbar_wait(&qfull[s], ph);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk)
        wgmma_m64n64k16_ss(st, wg_desc(sK + (kk >> 2) * kB * 128 + (kk & 3) * 32),
                           wg_desc(sQ + (kk >> 2) * kB * 128 + (kk & 3) * 32), kk > 0 ? 1 : 0);
#pragma unroll
      for (int kk = 0; kk < kDv / 16; ++kk)
        wgmma_m64n64k16_ss(dpt, wg_desc(sV + (kk >> 2) * kB * 128 + (kk & 3) * 32),
                           wg_desc(sDO + (kk >> 2) * kB * 128 + (kk & 3) * 32), kk > 0 ? 1 : 0);
      wg_commit();
      wg_wait<0>();
      wg_fence_regs(st);
      wg_fence_regs(dpt);

      // Pᵀ and dSᵀ: rows are keys (16·warp + g, + 8), columns queries 8n + 2t (+1).
      const float* stat = sST + s * 2 * kB;
      const bool need_mask = (q0 == k0) || (q0 + kB > len);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = 8 * n + 2 * t + (e & 1), key = k0 + 16 * warp + g + 8 * (e >> 1), q = q0 + qc;
          float pv = fast_exp2(st[4 * n + e] * p.scale_log2 - stat[qc]);
          if (need_mask && (key > q || q >= len)) pv = 0.f;
          st[4 * n + e] = pv;
          dpt[4 * n + e] = p.scale * pv * (dpt[4 * n + e] - stat[kB + qc]);
        }
      uint32_t pa[4][4], da[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[kk][r] = pack_bf16(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
          da[kk][r] = pack_bf16(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
        }
      // dSᵀ [64 keys][64 queries] for warpgroup 2, 128-byte swizzle: 16-byte chunk n of row r at n ^ (r % 8).
      const int b = step & 1;
      mbar_wait(&dsempty[b], ((step >> 1) & 1) ^ 1);
      unsigned char* sDS = smem + L::oDS + b * L::DS;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 16 * warp + g + 8 * hr;
          *reinterpret_cast<uint32_t*>(sDS + r * 128 + ((n ^ (r & 7)) << 4) + 4 * t) = da[n >> 1][(n & 1) * 2 + hr];
        }
      fence_proxy_async();
      mbar_arrive(&dsfull[b]);

      wg_fence_regs(dv);
      wg_fence_regs(dk);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16_rs_tb(dv, pa[kk], wg_desc_mn(sDO + kk * 16 * 128, kB * 128));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (DK == 192) wgmma_m64n192k16_rs_tb(dk, da[kk], wg_desc_mn(sQ + kk * 16 * 128, kB * 128));
        else wgmma_m64n128k16_rs_tb(dk, da[kk], wg_desc_mn(sQ + kk * 16 * 128, kB * 128));
      }
      wg_commit();
      wg_wait<0>();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      mbar_arrive(&qempty[s]);
    }
    // dK, dV of the owned keys (dS already carries the softmax scale).
    bf16* dKg = static_cast<bf16*>(p.dk) + (int64_t(s0 + k0) * p.Hkv + hk) * DK;
    bf16* dVg = static_cast<bf16*>(p.dv) + (int64_t(s0 + k0) * p.Hkv + hk) * kDv;
    const int nk = min(kB, len - k0);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = 16 * warp + g + 8 * hr;
      if (r < nk) {
#pragma unroll
        for (int n = 0; n < kDv / 8; ++n)
          *reinterpret_cast<uint32_t*>(dVg + int64_t(r) * p.Hkv * kDv + 8 * n + 2 * t) =
              pack_bf16(dv[4 * n + 2 * hr], dv[4 * n + 2 * hr + 1]);
#pragma unroll
        for (int n = 0; n < NK; ++n)
          *reinterpret_cast<uint32_t*>(dKg + int64_t(r) * p.Hkv * DK + 8 * n + 2 * t) =
              pack_bf16(dk[4 * n + 2 * hr], dk[4 * n + 2 * hr + 1]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ dQ
  asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
  mbar_wait(kvfull, 0);
  for (int step = 0; step < nsteps; ++step) {
    const int b = step & 1, h = hk * p.G + step / nsteps_h, q0 = (kt + step % nsteps_h) * kB;
    const unsigned char* sDS = smem + L::oDS + b * L::DS;
    float dq[DK / 2];
    mbar_wait(&dsfull[b], (step >> 1) & 1);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (DK == 192)
        wgmma_m64n192k16_ss_ta_tb(dq, wg_desc_mn(sDS + kk * 16 * 128, kB * 128), wg_desc_mn(sK + kk * 16 * 128, kB * 128),
                                  kk > 0 ? 1 : 0);
      else
        wgmma_m64n128k16_ss_ta_tb(dq, wg_desc_mn(sDS + kk * 16 * 128, kB * 128), wg_desc_mn(sK + kk * 16 * 128, kB * 128),
                                  kk > 0 ? 1 : 0);
    }
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(dq);
    mbar_arrive(&dsempty[b]);
    if (ltid < kB) bulk_wait_read();  // this thread's previous row reduction has read the staging rows
    wg_bar(1);
#pragma unroll
    for (int n = 0; n < NK; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * warp + g + 8 * hr;
        *reinterpret_cast<float2*>(sDQ + r * L::LDQ + 8 * n + 2 * t) = make_float2(dq[4 * n + 2 * hr], dq[4 * n + 2 * hr + 1]);
      }
    fence_proxy_async();
    wg_bar(1);
    if (ltid < kB && q0 + ltid < len)
      bulk_reduce_add_f32(p.dqacc + (int64_t(h) * (p.rows + kB) + s0 + q0 + ltid) * DK, sDQ + ltid * L::LDQ, DK * 4);
  }
  if (ltid < kB) bulk_wait_read();
}

CUtensorMap qkv_map(const void* base, int64_t rows, int64_t heads, int64_t D) {
  const uint64_t dims[3] = {uint64_t(D), uint64_t(heads), uint64_t(rows)};
  const uint64_t strides[2] = {uint64_t(D) * 2, uint64_t(heads * D) * 2};
  const uint32_t box[3] = {64u, 1u, uint32_t(kB)};
  return bf16_tensor_map(base, 3, dims, strides, box);
}

template <int DK>
void launch_t(const BwdParams& p, int ntiles, cudaStream_t s) {
  constexpr int bytes = BwSmem<DK>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(attn_bwd_wgmma_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
           cudaSuccess;
  }();
  (void)attr;
  const CUtensorMap tq = qkv_map(p.q, p.rows, p.H, DK), tk = qkv_map(p.k, p.rows, p.Hkv, DK),
                    tv = qkv_map(p.v, p.rows, p.Hkv, kDv), tdo = qkv_map(p.dout, p.rows, p.H, kDv);
  attn_bwd_wgmma_kernel<DK><<<ntiles * p.Hkv, kThreads, bytes, s>>>(tq, tk, tv, tdo, p);
}

}  // namespace

void launch_bwd_wgmma(const BwdParams& p, int Dk, int ntiles, cudaStream_t s) {
  if (Dk == 192) return launch_t<192>(p, ntiles, s);
  launch_t<128>(p, ntiles, s);
}

}  // namespace lm::ops::cuda::detail

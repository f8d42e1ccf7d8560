// Causal flash attention backward (FlashAttention-2 structure) on mma.sync bf16 tensor cores.
//
// Legend: T tokens of a sequence (len), H query heads, Hkv kv heads, G = H / Hkv, Dk/Dv head dims,
//         Bk = 64 keys per block (owned: dK, dV accumulate in registers), Bq = 64 query rows per step.
// One block (8 warps) per (key tile, kv head), heavy tiles first; it walks the G query heads of its kv head
// and the query tiles from the diagonal to the sequence end:
//   phase 1 (warps 4 q × 2 k): S = Q·Kᵀ, dP = dO·Vᵀ; P = exp2(S·scale·log2e − lse2), dS = scale·P⊙(dP − D);
//            P and dS go to shared memory as bf16.
//   phase 2 (warps 4 × 2 over output columns): dV += Pᵀ·dO, dK += dSᵀ·Q, and dQ_tile = dS·K, which is staged
//            in shared memory and added to the fp32 accumulator [H, rows, Dk] with bulk asynchronous
//            reductions (cp.reduce.async.bulk, one per row), so no per-element atomics leave the SM.
// Q, dO and the row statistics of the next step are prefetched (cp.async, double buffered).
#include <algorithm>

#include "core/cuda/hopper.cuh"  // bulk reductions
#include "core/cuda/reduce.cuh"
#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"

namespace lm::ops::cuda::detail {

namespace {

constexpr int kB = 64, kThreads = 256, kLDP = kB + 8;

template <int DK, int DV>
struct BwdSmem {
  static constexpr int LDK = DK + 8, LDV = DV + 8, LDQ32 = DK + 8;  // fp32 dQ rows: +32 bytes, float2 stores
  static constexpr int oK = 0, oV = oK + kB * LDK * 2, oQ = oV + kB * LDV * 2, oDO = oQ + 2 * kB * LDK * 2,
                       oP = oDO + 2 * kB * LDV * 2, oDS = oP + kB * kLDP * 2, oDQ = oDS + kB * kLDP * 2,
                       oL = oDQ + kB * LDQ32 * 4, oD = oL + 2 * kB * 4, bytes = oD + 2 * kB * 4;
};


// kB fp32 row statistics by 4-byte cp.async (the rows start anywhere); entries >= nv zero-filled.
__device__ __forceinline__ void load_stats(float* s, const float* g, int nv, int i) {
  const bool ok = i < nv;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(s + i)), "l"(ok ? g + i : g),
               "r"(ok ? 4 : 0));
}

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_kernel(const BwdParams p) {
  using L = BwdSmem<DK, DV>;
  constexpr int LDK = L::LDK, LDV = L::LDV, LDQ32 = L::LDQ32;
  constexpr int NDV = DV / 2 / 8, NDK = DK / 2 / 8;  // n8 tiles per warp in phase 2 (half the columns)
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem + L::oK);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::oV);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sDO = reinterpret_cast<bf16*>(smem + L::oDO);
  bf16* sP = reinterpret_cast<bf16*>(smem + L::oP);
  bf16* sDS = reinterpret_cast<bf16*>(smem + L::oDS);
  float* sDQ = reinterpret_cast<float*>(smem + L::oDQ);
  float* sL = reinterpret_cast<float*>(smem + L::oL);
  float* sD = reinterpret_cast<float*>(smem + L::oD);

  const int2 ht = head_and_tile(blockIdx.x, p.Hkv, gridDim.x / p.Hkv, p.head_group);
  const int hk = ht.x;
  const int2 tl = p.tiles[ht.y];
  const int s0 = p.seq_start[tl.x], len = p.seq_start[tl.x + 1] - s0;
  const int kt = tl.y, k0 = kt * kB, nk = min(kB, len - k0);
  const int nqt = (len + kB - 1) / kB, nsteps_h = nqt - kt, nsteps = nsteps_h * p.G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int w4 = warp & 3, w2 = warp >> 2;

  const bf16* Kg = static_cast<const bf16*>(p.k) + int64_t(s0 + k0) * p.sk + int64_t(hk) * DK;
  const bf16* Vg = static_cast<const bf16*>(p.v) + int64_t(s0 + k0) * p.sv + int64_t(hk) * DV;
  load_rows<kB, DK, LDK, kThreads>(sK, Kg, p.sk, nk, tid);
  load_rows<kB, DV, LDV, kThreads>(sV, Vg, p.sv, nk, tid);

  auto prefetch = [&](int step, int buf) {
    const int h = hk * p.G + step / nsteps_h, q0 = (kt + step % nsteps_h) * kB, nq = min(kB, len - q0);
    const int64_t r0 = int64_t(s0) + q0;
    load_rows<kB, DK, LDK, kThreads>(sQ + buf * kB * LDK, static_cast<const bf16*>(p.q) + r0 * p.sq + int64_t(h) * DK,
                                     p.sq, nq, tid);
    load_rows<kB, DV, LDV, kThreads>(sDO + buf * kB * LDV,
                                     static_cast<const bf16*>(p.dout) + r0 * p.sdo + int64_t(h) * DV, p.sdo, nq, tid);
    const int64_t so = int64_t(h) * p.rows + r0;
    if (tid < kB) load_stats(sL + buf * kB, p.lse2 + so, nq, tid);
    else if (tid < 2 * kB) load_stats(sD + buf * kB, p.D + so, nq, tid - kB);
  };
  prefetch(0, 0);
  cp_commit();

  float dv[NDV][4], dk[NDK][4];
#pragma unroll
  for (int n = 0; n < NDV; ++n) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < NDK; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;

  for (int step = 0; step < nsteps; ++step) {
    const int buf = step & 1;
    const int h = hk * p.G + step / nsteps_h, q0 = (kt + step % nsteps_h) * kB;
    cp_wait<0>();
    __syncthreads();
    if (step + 1 < nsteps) {
      prefetch(step + 1, buf ^ 1);
      cp_commit();
    }
    const bf16* cQ = sQ + buf * kB * LDK;
    const bf16* cDO = sDO + buf * kB * LDV;

    // ---- phase 1: warp (w4: 16 query rows, w2: 32 keys)
    float s[4][4], dp[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t a[4], b0[4], b1[4];
      ldsm4(a, cQ + (w4 * 16) * LDK + kk * 16 + a_off(lane, LDK));
      ldsm4(b0, sK + (w2 * 32) * LDK + kk * 16 + bn_off(lane, LDK));
      ldsm4(b1, sK + (w2 * 32 + 16) * LDK + kk * 16 + bn_off(lane, LDK));
      mma_bf16(s[0], a, b0[0], b0[1]);
      mma_bf16(s[1], a, b0[2], b0[3]);
      mma_bf16(s[2], a, b1[0], b1[1]);
      mma_bf16(s[3], a, b1[2], b1[3]);
    }
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      uint32_t a[4], b0[4], b1[4];
      ldsm4(a, cDO + (w4 * 16) * LDV + kk * 16 + a_off(lane, LDV));
      ldsm4(b0, sV + (w2 * 32) * LDV + kk * 16 + bn_off(lane, LDV));
      ldsm4(b1, sV + (w2 * 32 + 16) * LDV + kk * 16 + bn_off(lane, LDV));
      mma_bf16(dp[0], a, b0[0], b0[1]);
      mma_bf16(dp[1], a, b0[2], b0[3]);
      mma_bf16(dp[2], a, b1[0], b1[1]);
      mma_bf16(dp[3], a, b1[2], b1[3]);
    }
    const bool need_mask = (q0 == k0) || (q0 + kB > len);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = w4 * 16 + g + hr * 8, row = q0 + r;
      const float l2 = sL[buf * kB + r], Dr = sD[buf * kB + r];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int c = w2 * 32 + n * 8 + 2 * t;
        float pv[2], dsv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float pe = fast_exp2(s[n][2 * hr + e] * p.scale_log2 - l2);
          if (need_mask && (k0 + c + e > row || row >= len)) pe = 0.f;
          pv[e] = pe;
          dsv[e] = p.scale * pe * (dp[n][2 * hr + e] - Dr);
        }
        *reinterpret_cast<uint32_t*>(sP + r * kLDP + c) = pack_bf16(pv[0], pv[1]);
        *reinterpret_cast<uint32_t*>(sDS + r * kLDP + c) = pack_bf16(dsv[0], dsv[1]);
      }
    }
    __syncthreads();

    // ---- phase 2: dV (w4: 16 keys, w2: Dv/2 columns), dK (w4: 16 keys, w2: Dk/2 columns),
    //               dQ (w4: 16 query rows, w2: Dk/2 columns)
#pragma unroll
    for (int kk = 0; kk < kB / 16; ++kk) {  // over query rows
      uint32_t a[4];
      ldsm4t(a, sP + (kk * 16) * kLDP + w4 * 16 + at_off(lane, kLDP));
#pragma unroll
      for (int np = 0; np < NDV / 2; ++np) {
        uint32_t b[4];
        ldsm4t(b, cDO + (kk * 16) * LDV + w2 * (DV / 2) + np * 16 + bt_off(lane, LDV));
        mma_bf16(dv[2 * np], a, b[0], b[1]);
        mma_bf16(dv[2 * np + 1], a, b[2], b[3]);
      }
      ldsm4t(a, sDS + (kk * 16) * kLDP + w4 * 16 + at_off(lane, kLDP));
#pragma unroll
      for (int np = 0; np < NDK / 2; ++np) {
        uint32_t b[4];
        ldsm4t(b, cQ + (kk * 16) * LDK + w2 * (DK / 2) + np * 16 + bt_off(lane, LDK));
        mma_bf16(dk[2 * np], a, b[0], b[1]);
        mma_bf16(dk[2 * np + 1], a, b[2], b[3]);
      }
    }
    {
      float dq[NDK][4];
#pragma unroll
      for (int n = 0; n < NDK; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kB / 16; ++kk) {  // over keys
        uint32_t a[4];
        ldsm4(a, sDS + (w4 * 16) * kLDP + kk * 16 + a_off(lane, kLDP));
#pragma unroll
        for (int np = 0; np < NDK / 2; ++np) {
          uint32_t b[4];
          ldsm4t(b, sK + (kk * 16) * LDK + w2 * (DK / 2) + np * 16 + bt_off(lane, LDK));
          mma_bf16(dq[2 * np], a, b[0], b[1]);
          mma_bf16(dq[2 * np + 1], a, b[2], b[3]);
        }
      }
      // Each warp reduces its own 16 × Dk/2 block of dQ: 16 row segments of Dk/2 floats, one bulk reduction
      // per lane, so no block barrier is needed. A lane first waits until its previous reduction has read
      // the staging rows.
      if (lane < 16) bulk_wait_read();
      __syncwarp();
#pragma unroll
      for (int n = 0; n < NDK; ++n) {
        const int c = w2 * (DK / 2) + n * 8 + 2 * t, r = w4 * 16 + g;
        *reinterpret_cast<float2*>(sDQ + r * LDQ32 + c) = make_float2(dq[n][0], dq[n][1]);
        *reinterpret_cast<float2*>(sDQ + (r + 8) * LDQ32 + c) = make_float2(dq[n][2], dq[n][3]);
      }
      fence_proxy_async();  // the generic-proxy stores above are read next by the bulk copy engine
      __syncwarp();
      const int r = w4 * 16 + lane;
      if (lane < 16 && q0 + r < len) {
        bulk_reduce_add_f32(p.dqacc + (int64_t(h) * (p.rows + kB) + s0 + q0 + r) * DK + w2 * (DK / 2),
                            smem_u32(sDQ + r * LDQ32 + w2 * (DK / 2)), DK / 2 * 4);
        bulk_commit();
      }
    }
  }
  if (lane < 16) bulk_wait_read();  // the staging rows stay valid until the last reductions have read them

  // dK, dV of the owned keys (dS already carries the softmax scale).
  bf16* dKg = static_cast<bf16*>(p.dk) + (int64_t(s0 + k0) * p.Hkv + hk) * DK;
  bf16* dVg = static_cast<bf16*>(p.dv) + (int64_t(s0 + k0) * p.Hkv + hk) * DV;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = w4 * 16 + g + hr * 8;
    if (r < nk) {
#pragma unroll
      for (int n = 0; n < NDV; ++n)
        *reinterpret_cast<uint32_t*>(dVg + int64_t(r) * p.Hkv * DV + w2 * (DV / 2) + n * 8 + 2 * t) =
            pack_bf16(dv[n][2 * hr], dv[n][2 * hr + 1]);
#pragma unroll
      for (int n = 0; n < NDK; ++n)
        *reinterpret_cast<uint32_t*>(dKg + int64_t(r) * p.Hkv * DK + w2 * (DK / 2) + n * 8 + 2 * t) =
            pack_bf16(dk[n][2 * hr], dk[n][2 * hr + 1]);
    }
  }
}

// lse2 = lse · log2 e and D = rowsum(do ⊙ o), both [H, rows]: one warp per (row, head).
__global__ void bwd_pre_kernel(const bf16* o, const bf16* dout, const float* lse, float* lse2, float* D, int rows,
                               int H, int Dv) {
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (w >= rows * H) return;
  const int row = w / H, h = w % H;
  const bf16* op = o + int64_t(w) * Dv;
  const bf16* dp = dout + int64_t(w) * Dv;
  float acc = 0.f;
  for (int c = lane * 2; c < Dv; c += 64) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(op + c));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dp + c));
    acc += a.x * b.x + a.y * b.y;
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    D[int64_t(h) * rows + row] = acc;
    lse2[int64_t(h) * rows + row] = lse[w] * 1.4426950408889634f;
  }
}

__global__ void dq_convert_kernel(const float* acc, bf16* dq, int rows, int H, int Dk) {
  const int64_t n4 = int64_t(rows) * H * Dk / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i * 4, c = e % Dk, rh = e / Dk, row = rh / H, h = rh % H;
    const float4 v = *reinterpret_cast<const float4*>(acc + (h * (rows + kB) + row) * Dk + c);
    uint2 out;
    out.x = pack_bf16(v.x, v.y);
    out.y = pack_bf16(v.z, v.w);
    *reinterpret_cast<uint2*>(dq + e) = out;
  }
}

template <int DK, int DV>
void launch_bwd_t(const BwdParams& p, int ntiles, cudaStream_t s) {
  constexpr int bytes = BwdSmem<DK, DV>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(attn_bwd_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
           cudaSuccess;
  }();
  (void)attr;
  attn_bwd_kernel<DK, DV><<<ntiles * p.Hkv, kThreads, bytes, s>>>(p);
}

}  // namespace

void launch_bwd_pre(const void* o, const void* dout, const float* lse, float* lse2, float* D, int rows, int H, int Dv,
                    cudaStream_t s) {
  const int64_t warps = int64_t(rows) * H;
  if (warps == 0) return;
  bwd_pre_kernel<<<unsigned((warps + 7) / 8), 256, 0, s>>>(static_cast<const bf16*>(o), static_cast<const bf16*>(dout),
                                                           lse, lse2, D, rows, H, Dv);
}

void launch_bwd(const BwdParams& p, int Dk, int Dv, int ntiles, cudaStream_t s) {
  if (Dk == 192 && Dv == 128) return launch_bwd_t<192, 128>(p, ntiles, s);
  launch_bwd_t<128, 128>(p, ntiles, s);
}

void launch_dq_convert(const float* dqacc, void* dq, int rows, int H, int Dk, cudaStream_t s) {
  const int64_t n4 = int64_t(rows) * H * Dk / 4;
  if (n4 == 0) return;
  const int blocks = int(std::min<int64_t>((n4 + 255) / 256, 132 * 16));
  dq_convert_kernel<<<blocks, 256, 0, s>>>(dqacc, static_cast<bf16*>(dq), rows, H, Dk);
}

}  // namespace lm::ops::cuda::detail

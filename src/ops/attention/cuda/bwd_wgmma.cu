// Causal flash attention backward on Hopper warpgroup MMAs, Bk = 128 keys per block (the default backward).
//
// Legend: T tokens of a sequence (len), H query heads, Hkv kv heads, G = H / Hkv, Dk q/k head dim (128 | 192),
//         Dv = 128, Bk = 128 keys per block, Bq = 64 query rows per step, c = compute warpgroup (0 | 1).
// One block per (key tile, kv head), heavy tiles first, walking the G query heads and the query tiles from the
// diagonal to the sequence end. Warp roles (384 threads):
//   warpgroup 0, producer: one thread loads K, V once and Q_i, dO_i per step by TMA into a two-stage ring;
//     warp 1 copies the step's row statistics (lse·log2 e, D = rowsum(dO ⊙ O)) into the same stage.
//   warpgroups 1 and 2 (c = 0, 1) own keys 64c..64c+63: Sᵀ = K_c·Q_iᵀ, dPᵀ = V_c·dO_iᵀ; Pᵀ, dSᵀ in registers;
//     dV_c += Pᵀ·dO_i, dK_c += dSᵀ·Q_i with the A operands from registers. Both write their half of dSᵀ
//     [128 keys][64 queries] to shared memory, and each then computes 64-column slices of dQ_i = dS·K over all
//     128 keys (warpgroup c: columns 64c..64c+63; with Dk = 192 the last 64 alternate by step), staged in shared
//     memory and added to the fp32 accumulator [H, rows + 64, Dk] by TMA tensor reductions (add in L2).
//     Against 16-byte vector atomics from the registers (LONGMOE_ATTN_BWD_DQ_ATOMIC=1), one H200 run: backward
//     335 -> 360 TFLOP/s at 192/128, 359 -> 429 at 128/128; without any dQ reduction the backward ran ~25%
//     faster at 192/128, so the reduction traffic is what still separates it from cuDNN.
// Against bwd.cu's 64-key blocks with a separate dQ warpgroup this halves the dQ reduction traffic per FLOP.
// Schedule (as in the forward): the compute warpgroups take turns issuing their MMAs (named barriers 1 and 2),
// so one's elementwise work (softmax, dS, the dQ reduction) runs under the other's products. Dk = 128: two
// turns per step, (1) Sᵀ and dPᵀ together, the exponentials under dPᵀ, (2) dV, dK and the previous step's dQ
// columns together, whose reduction then runs under the other warpgroup's turn; backward 334 -> 393-405
// TFLOP/s in one H200 run. Dk = 192 has no registers for the deferred dQ next to dK; its four-turn form (Sᵀ,
// dPᵀ, dV + dK, dQ) trails the serial order once dQ leaves by bulk reductions, so Dk = 192 runs serially.
#include <cuda.h>

#include <cstdlib>

#include "core/cuda/tensor_map.hpp"
#include "core/cuda/wgmma.cuh"
#include "core/env.hpp"
#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"

namespace lm::ops::cuda::detail {

namespace {

constexpr int kBk = 128, kBq = 64, kDv = 128, kThreads = 384;

template <int DK>
struct Bw2Smem {
  static constexpr int K = DK * kBk * 2, V = kDv * kBk * 2, Q = DK * kBq * 2, DO = kDv * kBq * 2, DS = kBk * kBq * 2;
  // DQ: per compute warpgroup, one 64 x 64 fp32 dQ tile staged for the bulk reduction, as two [64][32] boxes with
  // the 128-byte swizzle (Dk = 192 uses 231,552 of the 232,448 bytes a block may have).
  static constexpr int DQ = kBq * 64 * 4;
  static constexpr int oK = 0, oV = oK + K, oQ = oV + V, oDO = oQ + 2 * Q, oDS = oDO + 2 * DO, oDQ = oDS + 2 * DS,
                       oST = oDQ + 2 * DQ, oBar = oST + 2 * 2 * kBq * 4, bytes = oBar + 16 * 8 + 1024;
};

template <int DK, int SCHED, bool BULK>
__global__ void __launch_bounds__(kThreads, 1)
    attn_bwd_wgmma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                           const __grid_constant__ CUtensorMap tmV, const __grid_constant__ CUtensorMap tmDO,
                           const __grid_constant__ CUtensorMap tmDQ, const BwdParams p) {
  using L = Bw2Smem<DK>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char *sK = smem + L::oK, *sV = smem + L::oV;
  float* sST = reinterpret_cast<float*>(smem + L::oST);  // [2][lse2 64 | D 64]
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::oBar);
  uint64_t *kvfull = bar, *qfull = bar + 1, *qempty = bar + 3, *dsfull = bar + 5, *dsempty = bar + 7;

  const int2 ht = head_and_tile(blockIdx.x, p.Hkv, gridDim.x / p.Hkv, p.head_group);
  const int hk = ht.x;
  const int2 tl = p.tiles[ht.y];
  const int s0 = p.seq_start[tl.x], len = p.seq_start[tl.x + 1] - s0;
  const int k0 = tl.y * kBk, qt0 = k0 / kBq;
  const int nqt = (len + kBq - 1) / kBq, nsteps_h = nqt - qt0, nsteps = nsteps_h * p.G;
  const int tid = threadIdx.x, wg = tid / 128, ltid = tid % 128, warp = ltid >> 5, lane = ltid & 31;
  const int g = lane >> 2, t = lane & 3;

  if (tid == 0) {
    mbar_init(kvfull, 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(&qfull[s], 1 + 32);  // TMA thread (with the byte count) + the 32 lanes copying statistics
      mbar_init(&qempty[s], 256);
      mbar_init(&dsfull[s], 256);
      mbar_init(&dsempty[s], 256);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (warp == 0 && lane == 0) {
      mbar_expect_tx(kvfull, L::K + L::V);
      for (int a = 0; a < DK / 64; ++a) tma_load_3d(sK + a * kBk * 128, &tmK, kvfull, 64 * a, hk, s0 + k0);
      for (int a = 0; a < kDv / 64; ++a) tma_load_3d(sV + a * kBk * 128, &tmV, kvfull, 64 * a, hk, s0 + k0);
      for (int step = 0; step < nsteps; ++step) {
        const int s = step & 1, h = hk * p.G + step / nsteps_h, q0 = (qt0 + step % nsteps_h) * kBq;
        mbar_wait(&qempty[s], ((step >> 1) & 1) ^ 1);
        unsigned char* sQ = smem + L::oQ + s * L::Q;
        unsigned char* sDO = smem + L::oDO + s * L::DO;
        mbar_expect_tx(&qfull[s], L::Q + L::DO);
        for (int a = 0; a < DK / 64; ++a) tma_load_3d(sQ + a * kBq * 128, &tmQ, &qfull[s], 64 * a, h, s0 + q0);
        for (int a = 0; a < kDv / 64; ++a) tma_load_3d(sDO + a * kBq * 128, &tmDO, &qfull[s], 64 * a, h, s0 + q0);
      }
    } else if (warp == 1) {
      for (int step = 0; step < nsteps; ++step) {
        const int s = step & 1, h = hk * p.G + step / nsteps_h, q0 = (qt0 + step % nsteps_h) * kBq;
        const int nq = min(kBq, len - q0);
        mbar_wait(&qempty[s], ((step >> 1) & 1) ^ 1);
        const int64_t so = int64_t(h) * p.rows + s0 + q0;
        for (int i = lane; i < kBq; i += 32) {
          sST[s * 2 * kBq + i] = i < nq ? p.lse2[so + i] : 0.f;
          sST[s * 2 * kBq + kBq + i] = i < nq ? p.D[so + i] : 0.f;
        }
        mbar_arrive(&qfull[s]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int c = wg - 1;
  float dv[64], dk[DK / 2];
#pragma unroll
  for (int i = 0; i < 64; ++i) dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < DK / 2; ++i) dk[i] = 0.f;

  // dQ_i[:, 64a .. 64a + 64) = dS·K over the 128 keys (one 64-column atom of K), issued (not committed), then
  // reduced into the accumulator.
  auto dq_issue = [&](float (&dq)[32], int a, const unsigned char* sDS) {
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk)
      wgmma_m64n64k16_ss_ta_tb(dq, wg_desc_mn(sDS + kk * 16 * 128, kBq * 128),
                               wg_desc_mn(sK + a * kBk * 128 + kk * 16 * 128, kBk * 128), kk > 0 ? 1 : 0);
  };
  auto dq_store = [&](const float (&dq)[32], int a, int h, int q0) {
    // Lane pairs (t, t^1) trade halves so that each lane holds 4 consecutive columns of one row: the even lane
    // row g, the odd lane row g + 8; one 16-byte reduction each.
    const bool odd = t & 1;
    const int row = q0 + 16 * warp + g + (odd ? 8 : 0);
    float* dst = p.dqacc + (int64_t(h) * (p.rows + kBq) + s0 + row) * DK + 64 * a + 2 * (t & ~1);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float x0 = dq[4 * n], x1 = dq[4 * n + 1], x2 = dq[4 * n + 2], x3 = dq[4 * n + 3];
      const float r0 = __shfl_xor_sync(0xffffffffu, odd ? x0 : x2, 1);
      const float r1 = __shfl_xor_sync(0xffffffffu, odd ? x1 : x3, 1);
      const float4 v = odd ? make_float4(r0, r1, x2, x3) : make_float4(x0, x1, r0, r1);
      if (row < len) atomicAdd(reinterpret_cast<float4*>(dst + 8 * n), v);
    }
  };
  // The same through shared memory: the tile goes to this warpgroup's staging buffer and leaves as two TMA
  // tensor reductions (add in L2) issued by one thread, so no thread waits on per-element atomics. Rows past the
  // sequence hold exact zeros (P is masked to 0 there), so the 64-row box may add into the next sequence's rows
  // or the accumulator's 64 spare rows.
  auto dq_store_bulk = [&](const float (&dq)[32], int a, int h, int q0) {
    unsigned char* stg = smem + L::oDQ + c * L::DQ;
    if (ltid == 0) bulk_wait_read();  // staging free again
    named_bar_sync<128>(3 + c);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * warp + g + 8 * hr, chunk = 2 * (n & 3) + (t >> 1);
        *reinterpret_cast<float2*>(stg + (n >> 2) * (kBq * 128) + r * 128 + ((chunk ^ (r & 7)) << 4) + (t & 1) * 8) =
            make_float2(dq[4 * n + 2 * hr], dq[4 * n + 2 * hr + 1]);
      }
    fence_proxy_async();
    named_bar_sync<128>(3 + c);
    if (ltid == 0) {
      const int y = h * (p.rows + kBq) + s0 + q0;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        asm volatile(
            "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                &tmDQ),
            "r"(64 * a + 32 * j), "r"(y), "r"(smem_u32(stg + j * kBq * 128))
            : "memory");
      bulk_commit();
    }
  };
  auto store_dq = [&](const float (&dq)[32], int a, int h, int q0) {
    if constexpr (BULK) dq_store_bulk(dq, a, h, q0);
    else dq_store(dq, a, h, q0);
  };
  auto dq_atom = [&](int a, const unsigned char* sDS, int h, int q0) {
    float dq[32];
    wg_fence();
    dq_issue(dq, a, sDS);
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(dq);
    store_dq(dq, a, h, q0);
  };
  // Sᵀ = K_c·Q_iᵀ and dPᵀ = V_c·dO_iᵀ (issued, not committed).
  auto issue_s = [&](float (&st)[32], const unsigned char* sQ) {
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
      wgmma_m64n64k16_ss(st, wg_desc(sK + (kk >> 2) * kBk * 128 + c * 64 * 128 + (kk & 3) * 32),
                         wg_desc(sQ + (kk >> 2) * kBq * 128 + (kk & 3) * 32), kk > 0 ? 1 : 0);
  };
  auto issue_dp = [&](float (&dpt)[32], const unsigned char* sDO) {
#pragma unroll
    for (int kk = 0; kk < kDv / 16; ++kk)
      wgmma_m64n64k16_ss(dpt, wg_desc(sV + (kk >> 2) * kBk * 128 + c * 64 * 128 + (kk & 3) * 32),
                         wg_desc(sDO + (kk >> 2) * kBq * 128 + (kk & 3) * 32), kk > 0 ? 1 : 0);
  };
  // P and dS fragments from the Sᵀ and dPᵀ accumulators (dS uses the bf16 P, and carries the softmax scale).
  auto make_p = [&](float (&st)[32], uint32_t (&pa)[4][4], const float* stat, int q0, bool need_mask) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = 8 * n + 2 * t + (e & 1), key = k0 + 64 * c + 16 * warp + g + 8 * (e >> 1), q = q0 + qc;
        float pv = fast_exp2(st[4 * n + e] * p.scale_log2 - stat[qc]);
        if (need_mask && (key > q || q >= len)) pv = 0.f;
        st[4 * n + e] = pv;
      }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack_bf16(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
  };
  auto make_ds = [&](const float (&dpt)[32], const uint32_t (&pa)[4][4], uint32_t (&da)[4][4], const float* stat) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float2 pv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pa[kk][r]));
        const int qc = 16 * kk + 8 * (r >> 1) + 2 * t;  // n8 block 2kk + (r >> 1), columns 2t, 2t + 1
        const float d0 = dpt[8 * kk + 2 * r], d1 = dpt[8 * kk + 2 * r + 1];
        da[kk][r] = pack_bf16(p.scale * pv.x * (d0 - stat[kBq + qc]), p.scale * pv.y * (d1 - stat[kBq + qc + 1]));
      }
  };
  // This warpgroup's 64 rows of dSᵀ [128 keys][64 queries], 128-byte swizzle (chunk n of row r at n ^ (r % 8)).
  auto write_ds = [&](unsigned char* sDS, const uint32_t (&da)[4][4]) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 64 * c + 16 * warp + g + 8 * hr;
        *reinterpret_cast<uint32_t*>(sDS + r * 128 + ((n ^ (r & 7)) << 4) + 4 * t) = da[n >> 1][(n & 1) * 2 + hr];
      }
    fence_proxy_async();
  };
  auto issue_dvdk = [&](const uint32_t (&pa)[4][4], const uint32_t (&da)[4][4], const unsigned char* sQ,
                        const unsigned char* sDO) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16_rs_tb(dv, pa[kk], wg_desc_mn(sDO + kk * 16 * 128, kBq * 128));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (DK == 192) wgmma_m64n192k16_rs_tb(dk, da[kk], wg_desc_mn(sQ + kk * 16 * 128, kBq * 128));
      else wgmma_m64n128k16_rs_tb(dk, da[kk], wg_desc_mn(sQ + kk * 16 * 128, kBq * 128));
    }
  };

  // Per step: Sᵀ, then bf16 Pᵀ; dPᵀ, then dSᵀ (from the bf16 P), written to shared memory; dV += Pᵀ·dO and
  // dK += dSᵀ·Q from registers; dQ columns once both halves of dSᵀ are written. SCHED 0 runs that in order;
  // SCHED 3 (Dk = 192) gives each product its own turn (Sᵀ | dPᵀ | dV + dK | dQ); SCHED 2 (Dk = 128) has two
  // turns, Sᵀ + dPᵀ (the exponentials under dPᵀ) and dV + dK + the previous step's dQ (its reduction then runs
  // under the other warpgroup's turn). Both halves of dSᵀ_{i-1} are written before either warpgroup's dV/dK turn
  // of step i (each writes its half before its own dV/dK turn of step i-1). Turns: pingpong_* in core/cuda/hopper.cuh.
  constexpr bool kTurns = SCHED != 0;
  auto turn_begin = [&] {
    if constexpr (kTurns) pingpong_wait_turn(c);
  };
  auto turn_end = [&] {
    if constexpr (kTurns) pingpong_pass_turn(c);
  };
  if constexpr (kTurns) pingpong_open(c);
  mbar_wait(kvfull, 0);
  int h_prev = 0, q0_prev = 0;
  for (int step = 0; step < nsteps; ++step) {
    const int s = step & 1, b = step & 1, h = hk * p.G + step / nsteps_h, q0 = (qt0 + step % nsteps_h) * kBq;
    const uint32_t ph = (step >> 1) & 1;
    const unsigned char* sQ = smem + L::oQ + s * L::Q;
    const unsigned char* sDO = smem + L::oDO + s * L::DO;
    unsigned char* sDS = smem + L::oDS + b * L::DS;
    const float* stat = sST + s * 2 * kBq;
    const bool need_mask = (q0 < k0 + kBk) || (q0 + kBq > len);
    uint32_t pa[4][4], da[4][4];
    mbar_wait(&qfull[s], ph);
    if constexpr (SCHED == 2) {
      float st[32], dpt[32];
      turn_begin();
      wg_fence();
      issue_s(st, sQ);
      wg_commit();
      issue_dp(dpt, sDO);
      wg_commit();
      turn_end();
      wg_wait<1>();
      wg_fence_regs(st);
      make_p(st, pa, stat, q0, need_mask);
      wg_wait<0>();
      wg_fence_regs(dpt);
      make_ds(dpt, pa, da, stat);
    } else {
      // One 32-register accumulator at a time next to dK, dV (with both live, ptxas runs out of registers for
      // Dk = 192 and serialises the MMAs).
      {
        float st[32];
        turn_begin();
        wg_fence();
        issue_s(st, sQ);
        wg_commit();
        turn_end();
        wg_wait<0>();
        wg_fence_regs(st);
        make_p(st, pa, stat, q0, need_mask);
      }
      float dpt[32];
      turn_begin();
      wg_fence();
      issue_dp(dpt, sDO);
      wg_commit();
      turn_end();
      wg_wait<0>();
      wg_fence_regs(dpt);
      make_ds(dpt, pa, da, stat);
    }
    mbar_wait(&dsempty[b], ph ^ 1);
    write_ds(sDS, da);
    mbar_arrive(&dsfull[b]);

    if constexpr (SCHED == 2) {
      float dq[32];
      turn_begin();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      wg_fence();
      issue_dvdk(pa, da, sQ, sDO);
      // Unconditional (a wgmma under a branch costs ptxas registers); at step 0 the product reads the idle
      // buffer and is dropped.
      if (step > 0) mbar_wait(&dsfull[b ^ 1], ((step - 1) >> 1) & 1);
      dq_issue(dq, c, smem + L::oDS + (b ^ 1) * L::DS);
      wg_commit();
      turn_end();
      wg_wait<0>();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      wg_fence_regs(dq);
      mbar_arrive(&qempty[s]);
      if (step > 0) {
        store_dq(dq, c, h_prev, q0_prev);
        mbar_arrive(&dsempty[b ^ 1]);
      }
      h_prev = h, q0_prev = q0;
    } else {
      turn_begin();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      wg_fence();
      issue_dvdk(pa, da, sQ, sDO);
      wg_commit();
      turn_end();
      wg_wait<0>();
      wg_fence_regs(dv);
      wg_fence_regs(dk);
      mbar_arrive(&qempty[s]);
      // dQ columns: warpgroup c takes atom c; with Dk = 192 the third atom alternates between them by step.
      float dq[32];
      mbar_wait(&dsfull[b], ph);  // both halves of dSᵀ written
      turn_begin();
      wg_fence();
      dq_issue(dq, c, sDS);
      wg_commit();
      turn_end();
      wg_wait<0>();
      wg_fence_regs(dq);
      store_dq(dq, c, h, q0);
      if (DK == 192 && (step & 1) == c) dq_atom(2, sDS, h, q0);
      mbar_arrive(&dsempty[b]);
    }
  }
  if constexpr (SCHED == 2) {  // the last step's dQ
    const int b = (nsteps - 1) & 1;
    float dq[32];
    turn_begin();
    mbar_wait(&dsfull[b], ((nsteps - 1) >> 1) & 1);
    wg_fence();
    dq_issue(dq, c, smem + L::oDS + b * L::DS);
    wg_commit();
    turn_end();
    wg_wait<0>();
    wg_fence_regs(dq);
    store_dq(dq, c, h_prev, q0_prev);
  }
  if constexpr (kTurns) pingpong_close(c);

  if (BULK && ltid == 0) bulk_wait();  // dQ reductions done
  // dK, dV of the owned keys (dS already carries the softmax scale).
  const int kr0 = k0 + 64 * c, nk = min(64, len - kr0);
  bf16* dKg = static_cast<bf16*>(p.dk) + (int64_t(s0 + kr0) * p.Hkv + hk) * DK;
  bf16* dVg = static_cast<bf16*>(p.dv) + (int64_t(s0 + kr0) * p.Hkv + hk) * kDv;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * warp + g + 8 * hr;
    if (r < nk) {
#pragma unroll
      for (int n = 0; n < kDv / 8; ++n)
        *reinterpret_cast<uint32_t*>(dVg + int64_t(r) * p.Hkv * kDv + 8 * n + 2 * t) =
            pack_bf16(dv[4 * n + 2 * hr], dv[4 * n + 2 * hr + 1]);
#pragma unroll
      for (int n = 0; n < DK / 8; ++n)
        *reinterpret_cast<uint32_t*>(dKg + int64_t(r) * p.Hkv * DK + 8 * n + 2 * t) =
            pack_bf16(dk[4 * n + 2 * hr], dk[4 * n + 2 * hr + 1]);
    }
  }
}

CUtensorMap qkv_map2(const void* base, int64_t rows, int64_t heads, int64_t D, int box_rows) {
  const uint64_t dims[3] = {uint64_t(D), uint64_t(heads), uint64_t(rows)};
  const uint64_t strides[2] = {uint64_t(D) * 2, uint64_t(heads * D) * 2};
  const uint32_t box[3] = {64u, 1u, uint32_t(box_rows)};
  return bf16_tensor_map(base, 3, dims, strides, box);
}

template <int DK, int SCHED, bool BULK>
void launch_t(const BwdParams& p, int ntiles, cudaStream_t s) {
  constexpr int bytes = Bw2Smem<DK>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(attn_bwd_wgmma_kernel<DK, SCHED, BULK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                bytes) == cudaSuccess;
  }();
  (void)attr;
  const CUtensorMap tq = qkv_map2(p.q, p.rows, p.H, DK, kBq), tk = qkv_map2(p.k, p.rows, p.Hkv, DK, kBk),
                    tv = qkv_map2(p.v, p.rows, p.Hkv, kDv, kBk), tdo = qkv_map2(p.dout, p.rows, p.H, kDv, kBq);
  // dQ accumulator [H * (rows + 64)][Dk] fp32, boxes of 32 columns (128 bytes) x 64 rows.
  const uint64_t dims[2] = {uint64_t(DK), uint64_t(p.H) * uint64_t(p.rows + kBq)}, strides[1] = {uint64_t(DK) * 4};
  const uint32_t box[2] = {32u, uint32_t(kBq)};
  const CUtensorMap tdq = tiled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.dqacc, 2, dims, strides, box);
  attn_bwd_wgmma_kernel<DK, SCHED, BULK><<<ntiles * p.Hkv, kThreads, bytes, s>>>(tq, tk, tv, tdo, tdq, p);
}

template <int DK, int SCHED>
void launch_s(const BwdParams& p, int ntiles, cudaStream_t s) {
  // LONGMOE_ATTN_BWD_DQ_ATOMIC=1 (A/B runs): dQ by 16-byte vector atomics from the registers.
  static const bool atomic = env::attn_bwd_dq_atomic();
  if (atomic) return launch_t<DK, SCHED, false>(p, ntiles, s);
  launch_t<DK, SCHED, true>(p, ntiles, s);
}

}  // namespace

void launch_bwd_wgmma(const BwdParams& p, int Dk, int ntiles, cudaStream_t s) {
  // Dk = 128: the two-turn ping-pong (SCHED 2); Dk = 192: the serial order (SCHED 0), which with the bulk dQ
  // reductions ran 3-5% ahead of the four-turn ping-pong (SCHED 3) on the H200; with vector atomics SCHED 3 led
  // by ~3%. LONGMOE_ATTN_BWD_MODE (A/B runs): 0 serial for both, 3 the four turns for Dk = 192.
  static const int mode = env::attn_bwd_mode();
  if (Dk == 192) return mode == 3 ? launch_s<192, 3>(p, ntiles, s) : launch_s<192, 0>(p, ntiles, s);
  mode == 0 ? launch_s<128, 0>(p, ntiles, s) : launch_s<128, 2>(p, ntiles, s);
}

}  // namespace lm::ops::cuda::detail

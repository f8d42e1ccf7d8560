// The sequential part of chunked KDA (SPEC §2.1, §2.2): one block per (sequence, head, group of 16*NW value
// columns), walking the chunks in order (forward) or in reverse (backward), with the state in registers.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C chunk 64, KP = K, V padded to 64|128,
//         NW warps per block; warp w owns 16 value columns e of the state. i, j chunk rows, d key channel.
// Each warp holds Sᵀ (16 x KP, fp32) as mma accumulators. Every product then keeps Sᵀ, Eᵀ and dOᵀ on the
// row side, so an accumulator turns into the next A operand in registers and warps never exchange data:
//   forward:  Eᵀ = Uᵀ - Sᵀ Wᵀ,   Oᵀ = Sᵀ Qgᵀ + Eᵀ A_qkᵀ,   Sᵀ <- Sᵀ Diag(Γ_last) + Eᵀ Kd
//   backward: dEᵀ = dSᵀ Kdᵀ + dOᵀ A_qk,   dSᵀ <- dSᵀ Diag(Γ_last) + dOᵀ Qg - dEᵀ W
// (Qg carries the scale.) The chunk tiles (W, Qg, Kd, A_qk, U or dO, Γ_last) are shared by the block and
// double-buffered with cp.async, so loading chunk c+1 overlaps the products of chunk c. The forward's
// products with E (Eᵀ A_qkᵀ, Eᵀ Kd) run in fp16 (A_qk, U, Kd come in fp16), the backward's in bf16.
#include "ops/kda/cuda/launch.hpp"
#include "ops/kda/cuda/recur_common.cuh"

namespace lm::kda::cuda::detail {
namespace {

template <int KP, int NW>
struct RecSmem {
  static constexpr int LDB = KP + 8, LDA = 72, LDU = 16 * NW + 8, LDS = 24;
  static constexpr size_t stage = (size_t(3) * 64 * LDB + 64 * LDA + 64 * LDU) * 2 + KP * 4;
  static constexpr size_t staging = size_t(NW) * KP * LDS * 2;  // per warp [KP][LDS] bf16
  static constexpr size_t bytes = 2 * stage + staging;
};

template <int KP, int NW, int MODE>
__global__ void __launch_bounds__(NW * 32, 1) recur_fwd_kernel(const OpParams p) {
  using SM = RecSmem<KP, NW>;
  constexpr int LDB = SM::LDB, LDA = SM::LDA, LDU = SM::LDU, LDS = SM::LDS, NT = NW * 32;
  constexpr bool F16 = MODE == 0, OUT = MODE != 1, KEEP = MODE != 0;  // see launch_recur_fwd
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int n = blockIdx.z, h = blockIdx.y, H = p.H, K = p.K, V = p.V;
  const int eb = blockIdx.x * 16 * NW, ew = eb + 16 * warp;
  const bool active = ew < V;
  bf16* stg = reinterpret_cast<bf16*>(smem + 2 * SM::stage) + warp * KP * LDS;
  auto buf = [&](int s, bf16*& sW, bf16*& sQg, bf16*& sKd, bf16*& sA, bf16*& sU, float*& sGl) {
    sW = reinterpret_cast<bf16*>(smem + s * SM::stage);
    sQg = sW + 64 * LDB;
    sKd = sQg + 64 * LDB;
    sA = sKd + 64 * LDB;
    sU = sA + 64 * LDA;
    sGl = reinterpret_cast<float*>(sU + 64 * LDU);
  };
  auto issue = [&](int c, int s) {
    bf16 *sW, *sQg, *sKd, *sA, *sU;
    float* sGl;
    buf(s, sW, sQg, sKd, sA, sU, sGl);
    const int64_t ch = int64_t(c) * H + h;
    load_tile<64, KP, LDB, NT>(sW, p.ws.W + ch * 64 * KP, KP, 64, KP, tid);
    load_tile<64, KP, LDB, NT>(sKd, p.ws.Kd + ch * 64 * KP, KP, 64, KP, tid);
    if (OUT) {
      load_tile<64, KP, LDB, NT>(sQg, p.ws.Qg + ch * 64 * KP, KP, 64, KP, tid);
      load_tile<64, 64, LDA, NT>(sA, p.ws.Aqk + ch * 4096, 64, 64, 64, tid);
    }
    load_tile<64, 16 * NW, LDU, NT>(sU, p.ws.U + ch * 64 * KP + eb, KP, 64, 16 * NW, tid);
    load_f32<KP, NT>(sGl, p.ws.Gl + ch * KP, tid);
  };

  float st[KP / 8][4];
  const int64_t sh = int64_t(n) * H + h;
  load_state<KP>(st, p.h0 ? p.h0 + sh * K * V : nullptr, K, V, ew, lane);
  const int cs = p.seq_chunk0[n], ce = p.seq_chunk0[n + 1];
  if (cs < ce) issue(cs, 0);
  cp_commit();
  for (int c = cs; c < ce; ++c) {
    const int s = (c - cs) & 1;
    if (c + 1 < ce) issue(c + 1, s ^ 1);
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    if (active) {
      bf16 *sW, *sQg, *sKd, *sA, *sU;
      float* sGl;
      buf(s, sW, sQg, sKd, sA, sU, sGl);
      const int64_t ch = int64_t(c) * H + h;
      if (KEEP) {  // the state at the chunk start, [K][V] layout
        store_tile_t<KP, LDS>(p.ws.S0 + ch * KP * KP + ew, KP, stg, st, lane);
      }
      // Eᵀ (so far -Sᵀ Wᵀ) and Oᵀ = Sᵀ Qgᵀ over the KP keys
      float ae[8][4], ao[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int x = 0; x < 4; ++x) ae[nt][x] = ao[nt][x] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KP / 16; ++kk) {
        uint32_t a[4];
        c_to_a(a, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          ldsm4(b, sW + 16 * np * LDB + 16 * kk + bn_off(lane, LDB));
          mma_bf16(ae[2 * np], a, b[0], b[1]);
          mma_bf16(ae[2 * np + 1], a, b[2], b[3]);
          if (OUT) {
            ldsm4(b, sQg + 16 * np * LDB + 16 * kk + bn_off(lane, LDB));
            mma_bf16(ao[2 * np], a, b[0], b[1]);
            mma_bf16(ao[2 * np + 1], a, b[2], b[3]);
          }
        }
      }
      uint32_t ea[4][4];  // Eᵀ = Uᵀ - Sᵀ Wᵀ as A fragments over the chunk rows
      e_from_u<F16, LDU>(ea, ae, sU, 16 * warp, lane);
      if (KEEP) {
        store_tile_t<64, LDS>(p.ws.E + ch * 64 * KP + ew, KP, stg, ae, lane);
      }
      if (OUT) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t b[4];
            ldsm4(b, sA + 16 * np * LDA + 16 * kk + bn_off(lane, LDA));
            mma16<F16>(ao[2 * np], ea[kk], b[0], b[1]);
            mma16<F16>(ao[2 * np + 1], ea[kk], b[2], b[3]);
          }
        stage_t<8, LDS>(stg, ao, lane);
        __syncwarp();
        const ChunkInfo ci = p.chunks[c];
        const int64_t HV = int64_t(H) * V;
        for (int idx = lane; idx < 128; idx += 32) {
          const int i = idx >> 1, hv = (idx & 1) * 8, e = ew + hv;
          if (i < ci.len && e < V)
            *reinterpret_cast<uint4*>(p.o + (int64_t(ci.row0) + i) * HV + int64_t(h) * V + e) =
                *reinterpret_cast<const uint4*>(stg + i * LDS + hv);
        }
        __syncwarp();
      }
      // Sᵀ <- Sᵀ Diag(Γ_last) + Eᵀ Kd
#pragma unroll
      for (int nt = 0; nt < KP / 8; ++nt) {
        const float2 gl = *reinterpret_cast<const float2*>(sGl + 8 * nt + 2 * t);
        st[nt][0] *= gl.x, st[nt][1] *= gl.y, st[nt][2] *= gl.x, st[nt][3] *= gl.y;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < KP / 16; ++np) {
          uint32_t b[4];
          ldsm4t(b, sKd + 16 * kk * LDB + 16 * np + bt_off(lane, LDB));
          mma16<F16>(st[2 * np], ea[kk], b[0], b[1]);
          mma16<F16>(st[2 * np + 1], ea[kk], b[2], b[3]);
        }
    }
    __syncthreads();
  }
  if (OUT && p.ht && active) store_state<KP>(st, p.ht + sh * K * V, K, V, ew, lane);
}

template <int KP, int NW>
__global__ void __launch_bounds__(NW * 32, 1) recur_bwd_kernel(const OpParams p) {
  using SM = RecSmem<KP, NW>;
  constexpr int LDB = SM::LDB, LDA = SM::LDA, LDU = SM::LDU, LDS = SM::LDS, NT = NW * 32;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int n = blockIdx.z, h = blockIdx.y, H = p.H, K = p.K, V = p.V;
  const int eb = blockIdx.x * 16 * NW, ew = eb + 16 * warp;
  const bool active = ew < V;
  const int64_t HV = int64_t(H) * V;
  bf16* stg = reinterpret_cast<bf16*>(smem + 2 * SM::stage) + warp * KP * LDS;
  auto buf = [&](int s, bf16*& sW, bf16*& sQg, bf16*& sKd, bf16*& sA, bf16*& sO, float*& sGl) {
    sW = reinterpret_cast<bf16*>(smem + s * SM::stage);
    sQg = sW + 64 * LDB;
    sKd = sQg + 64 * LDB;
    sA = sKd + 64 * LDB;
    sO = sA + 64 * LDA;
    sGl = reinterpret_cast<float*>(sO + 64 * LDU);
  };
  auto issue = [&](int c, int s) {
    bf16 *sW, *sQg, *sKd, *sA, *sO;
    float* sGl;
    buf(s, sW, sQg, sKd, sA, sO, sGl);
    const int64_t ch = int64_t(c) * H + h;
    const ChunkInfo ci = p.chunks[c];
    load_tile<64, KP, LDB, NT>(sW, p.ws.W + ch * 64 * KP, KP, 64, KP, tid);
    load_tile<64, KP, LDB, NT>(sQg, p.ws.Qg + ch * 64 * KP, KP, 64, KP, tid);
    load_tile<64, KP, LDB, NT>(sKd, p.ws.Kd + ch * 64 * KP, KP, 64, KP, tid);
    load_tile<64, 64, LDA, NT>(sA, p.ws.Aqk + ch * 4096, 64, 64, 64, tid);
    load_tile<64, 16 * NW, LDU, NT>(sO, p.dout + int64_t(ci.row0) * HV + int64_t(h) * V + eb, HV, ci.len, V - eb,
                                    tid);
    load_f32<KP, NT>(sGl, p.ws.Gl + ch * KP, tid);
  };

  float st[KP / 8][4];  // dSᵀ
  const int64_t sh = int64_t(n) * H + h;
  load_state<KP>(st, p.dht ? p.dht + sh * K * V : nullptr, K, V, ew, lane);
  const int cs = p.seq_chunk0[n], ce = p.seq_chunk0[n + 1];
  if (cs < ce) issue(ce - 1, 0);
  cp_commit();
  for (int c = ce - 1; c >= cs; --c) {
    const int s = (ce - 1 - c) & 1;
    if (c - 1 >= cs) issue(c - 1, s ^ 1);
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    if (active) {
      bf16 *sW, *sQg, *sKd, *sA, *sO;
      float* sGl;
      buf(s, sW, sQg, sKd, sA, sO, sGl);
      const int64_t ch = int64_t(c) * H + h;
      store_tile_t<KP, LDS>(p.ws.dS + ch * KP * KP + ew, KP, stg, st, lane);  // dS at the chunk end, [K][V]
      float acc[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KP / 16; ++kk) {  // dSᵀ Kdᵀ
        uint32_t a[4];
        c_to_a(a, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          ldsm4(b, sKd + 16 * np * LDB + 16 * kk + bn_off(lane, LDB));
          mma_bf16(acc[2 * np], a, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
      }
      uint32_t oa[4][4];  // dOᵀ as A fragments over the chunk rows
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) ldsm4t(oa[kk], sO + 16 * kk * LDU + 16 * warp + at_off(lane, LDU));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // + dOᵀ A_qk
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          ldsm4t(b, sA + 16 * kk * LDA + 16 * np + bt_off(lane, LDA));
          mma_bf16(acc[2 * np], oa[kk], b[0], b[1]);
          mma_bf16(acc[2 * np + 1], oa[kk], b[2], b[3]);
        }
      uint32_t na[4][4];  // -dEᵀ
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) c_to_a(na[kk], acc[2 * kk], acc[2 * kk + 1], -1.f);
      store_tile_t<64, LDS>(p.ws.dE + ch * 64 * KP + ew, KP, stg, acc, lane);
#pragma unroll
      for (int nt = 0; nt < KP / 8; ++nt) {
        const float2 gl = *reinterpret_cast<const float2*>(sGl + 8 * nt + 2 * t);
        st[nt][0] *= gl.x, st[nt][1] *= gl.y, st[nt][2] *= gl.x, st[nt][3] *= gl.y;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < KP / 16; ++np) {
          uint32_t b[4];
          ldsm4t(b, sQg + 16 * kk * LDB + 16 * np + bt_off(lane, LDB));
          mma_bf16(st[2 * np], oa[kk], b[0], b[1]);
          mma_bf16(st[2 * np + 1], oa[kk], b[2], b[3]);
          ldsm4t(b, sW + 16 * kk * LDB + 16 * np + bt_off(lane, LDB));
          mma_bf16(st[2 * np], na[kk], b[0], b[1]);
          mma_bf16(st[2 * np + 1], na[kk], b[2], b[3]);
        }
    }
    __syncthreads();
  }
  if (p.dh0 && active) store_state<KP>(st, p.dh0 + sh * K * V, K, V, ew, lane);
}

template <typename F>
void set_smem(F* f, size_t bytes) {
  cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <int KP, int NW, int MODE>
void fwd_mode(const OpParams& p, dim3 grid, size_t smem, cudaStream_t s) {
  static bool a = false;
  if (!a) set_smem(recur_fwd_kernel<KP, NW, MODE>, smem), a = true;
  launch_recurrence(recur_fwd_kernel<KP, NW, MODE>, grid, NW * 32, smem, s, p);
}
template <int KP, int NW>
void fwd_t(const OpParams& p, int N, int mode, cudaStream_t s) {
  const size_t smem = RecSmem<KP, NW>::bytes;
  const int TW = (p.V + 15) / 16;
  const dim3 grid((TW + NW - 1) / NW, p.H, N);
  if (mode == 0) fwd_mode<KP, NW, 0>(p, grid, smem, s);
  else if (mode == 1) fwd_mode<KP, NW, 1>(p, grid, smem, s);
  else fwd_mode<KP, NW, 2>(p, grid, smem, s);
}
template <int KP, int NW>
void bwd_t(const OpParams& p, int N, cudaStream_t s) {
  const size_t smem = RecSmem<KP, NW>::bytes;
  const int TW = (p.V + 15) / 16;
  static bool a = false;
  if (!a) set_smem(recur_bwd_kernel<KP, NW>, smem), a = true;
  launch_recurrence(recur_bwd_kernel<KP, NW>, dim3((TW + NW - 1) / NW, p.H, N), NW * 32, smem, s, p);
}

}  // namespace

void launch_recur_fwd(const OpParams& p, int KP, int NW, int N, int mode, cudaStream_t s) {
  if (N == 0) return;
  if (launch_recur_fwd_wgmma(p, NW, N, mode, s)) return;
  if (KP == 64) {
    switch (NW) {
      case 1: fwd_t<64, 1>(p, N, mode, s); break;
      case 2: fwd_t<64, 2>(p, N, mode, s); break;
      default: fwd_t<64, 4>(p, N, mode, s); break;
    }
  } else {
    switch (NW) {
      case 1: fwd_t<128, 1>(p, N, mode, s); break;
      case 2: fwd_t<128, 2>(p, N, mode, s); break;
      case 4: fwd_t<128, 4>(p, N, mode, s); break;
      default: fwd_t<128, 8>(p, N, mode, s); break;
    }
  }
}

void launch_recur_bwd(const OpParams& p, int KP, int NW, int N, cudaStream_t s) {
  if (N == 0) return;
  if (launch_recur_bwd_wgmma(p, NW, N, s)) return;
  if (KP == 64) {
    switch (NW) {
      case 1: bwd_t<64, 1>(p, N, s); break;
      case 2: bwd_t<64, 2>(p, N, s); break;
      default: bwd_t<64, 4>(p, N, s); break;
    }
  } else {
    switch (NW) {
      case 1: bwd_t<128, 1>(p, N, s); break;
      case 2: bwd_t<128, 2>(p, N, s); break;
      case 4: bwd_t<128, 4>(p, N, s); break;
      default: bwd_t<128, 8>(p, N, s); break;
    }
  }
}

}  // namespace lm::kda::cuda::detail

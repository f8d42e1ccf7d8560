// The chunk recurrences of KDA (SPEC §2.1, §2.2; recur.cu) with warpgroup MMAs, for K = V = 128.
//
// Legend: B batch, T tokens, H heads, K = V = 128, C chunk 64, NW warps per block (4 or 8: one or two
//         warpgroups of 64 value columns), e value column, d key, i, j chunk rows.
//   forward:  Eᵀ = Uᵀ - Sᵀ Wᵀ,   Oᵀ = Sᵀ Qgᵀ + Eᵀ A_qkᵀ,   Sᵀ <- Sᵀ Diag(Γ_last) + Eᵀ Kd   (as recur.cu)
//   backward: dEᵀ = dSᵀ Kdᵀ + dOᵀ A_qk,   dSᵀ <- dSᵀ Diag(Γ_last) + dOᵀ Qg - dEᵀ W
// Why: recur.cu's mma.sync form has each warp read all of W, Qg, Kd and A_qk through ldmatrix for its own 16
// value columns (8 warps: ~450 KB of shared-memory reads per chunk, the bound of that kernel). Here a
// warpgroup's four warps issue one wgmma whose B operand (W, Qg, A_qk K-major; Kd N-major) the tensor cores
// read once for 64 value columns; the A operand stays the per-warp register fragment of Sᵀ or Eᵀ, so the
// state never leaves registers. B tiles are [64][64] panels in the 128-byte swizzle (16-byte chunk c of row
// r at chunk c ^ (r % 8)), written by cp.async and handed to the async proxy by a proxy fence.
#include <cstdlib>

#include "core/cuda/wgmma.cuh"
#include "core/env.hpp"
#include "ops/kda/cuda/launch.hpp"
#include "ops/kda/cuda/recur_common.cuh"

namespace lm::kda::cuda::detail {
namespace {

// D[64 x 128] += A (registers) · B (N-major): fp16 (the forward's E · Kd) or bf16 (the flat-accumulator form the
// attention kernels use; the accumulator tiles are the same 64 floats).
template <bool F16>
__device__ __forceinline__ void wg_n128_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (F16) wg_m64n128k16_rs_tb_f16(d, a, db, 1);
  else wgmma_m64n128k16_rs_tb(reinterpret_cast<float(&)[64]>(d), a, db);
}

template <int NW, int MODE>
struct WgSmem {
  static constexpr int LDU = 16 * NW + 8, LDS = 24;
  static constexpr size_t TILE = 64 * 128 * 2;  // [64][128] as two swizzled [64][64] panels
  static constexpr size_t ATILE = 64 * 64 * 2;  // A_qk: one panel
  static constexpr size_t U = size_t(64) * LDU * 2;
  static constexpr size_t stage = (3 * TILE + ATILE + U + 128 * 4 + 1023) / 1024 * 1024;
  // per warp, 16 columns of O (64 rows) or, in modes 1 and 2, also of the chunk-start state (KP rows) and E
  static constexpr size_t staging = size_t(NW) * (MODE == 0 ? 64 : 128) * LDS * 2;
  static constexpr size_t bytes = 2 * stage + staging + 1024;   // + alignment of the dynamic base
};

// Rows of 128 (or 64) bf16, dense in global memory, into 128-byte-swizzled panels of 64 columns.
template <int COLS, int NT>
__device__ __forceinline__ void load_swz(unsigned char* s, const bf16* g, int tid) {
  constexpr int CPR = COLS / 8;  // 16-byte chunks per row
#pragma unroll 4
  for (int idx = tid; idx < 64 * CPR; idx += NT) {
    const int r = idx / CPR, c16 = idx % CPR, c = c16 & 7;
    cp_async16(s + (c16 >> 3) * 8192 + r * 128 + ((c ^ (r & 7)) << 4), g + r * COLS + c16 * 8, true);
  }
}

// MODE 0: O and ht; MODE 1 (for the backward): the state at every chunk start (S0) and E, bf16 throughout;
// MODE 2 (a forward that keeps them for the backward): both, bf16 throughout, so S0 and E are mode 1's bit for bit.
template <int NW, int MODE>
__global__ void __launch_bounds__(NW * 32, 1) recur_fwd_wgmma_kernel(const OpParams p) {
  using SM = WgSmem<NW, MODE>;
  constexpr bool F16 = MODE == 0, OUT = MODE != 1, KEEP = MODE != 0;
  constexpr int KP = 128, LDU = SM::LDU, LDS = SM::LDS, NT = NW * 32;
  constexpr size_t TILE = SM::TILE, ATILE = SM::ATILE;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int n = blockIdx.z, h = blockIdx.y, H = p.H, K = p.K, V = p.V;
  const int eb = blockIdx.x * 16 * NW, ew = eb + 16 * warp;
  bf16* stg = reinterpret_cast<bf16*>(smem + 2 * SM::stage) + warp * (MODE == 0 ? 64 : 128) * LDS;
  // stage s: W | Qg | Kd | A_qk | U (this block's columns, padded rows) | Γ_last
  auto issue = [&](int c, int s) {
    unsigned char* b = smem + s * SM::stage;
    const int64_t ch = int64_t(c) * H + h;
    load_swz<128, NT>(b, p.ws.W + ch * 64 * KP, tid);
    load_swz<128, NT>(b + 2 * TILE, p.ws.Kd + ch * 64 * KP, tid);
    if (OUT) {
      load_swz<128, NT>(b + TILE, p.ws.Qg + ch * 64 * KP, tid);
      load_swz<64, NT>(b + 3 * TILE, p.ws.Aqk + ch * 4096, tid);
    }
    load_tile<64, 16 * NW, LDU, NT>(reinterpret_cast<bf16*>(b + 3 * TILE + ATILE), p.ws.U + ch * 64 * KP + eb, KP, 64,
                                    16 * NW, tid);
    load_f32<KP, NT>(reinterpret_cast<float*>(b + 3 * TILE + ATILE + SM::U), p.ws.Gl + ch * KP, tid);
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
    fence_proxy_async();  // cp.async data -> wgmma's async proxy
    __syncthreads();
    const unsigned char* b = smem + s * SM::stage;
    const bf16* sU = reinterpret_cast<const bf16*>(b + 3 * TILE + ATILE);
    const float* sGl = reinterpret_cast<const float*>(b + 3 * TILE + ATILE + SM::U);
    const int64_t ch = int64_t(c) * H + h;
    if (KEEP) {  // the state at the chunk start, [K][V] layout
      store_tile_t<KP, LDS>(p.ws.S0 + ch * KP * KP + ew, KP, stg, st, lane);
    }

    // -Sᵀ Wᵀ and Sᵀ Qgᵀ over the 128 keys: Sᵀ as bf16 A fragments, W / Qg K-major
    uint32_t sa[KP / 16][4];
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk) c_to_a(sa[kk], st[2 * kk], st[2 * kk + 1]);
    float ae[8][4], ao[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) ae[nt][x] = ao[nt][x] = 0.f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk) {
      const size_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
      wg_m64n64k16_rs_bf16(ae, sa[kk], wg_desc(b + off), 1);
      if (OUT) wg_m64n64k16_rs_bf16(ao, sa[kk], wg_desc(b + TILE + off), 1);
    }
    wg_commit();
    wg_wait<0>();
    fence_acc(ae);
    fence_acc(ao);
    uint32_t ea[4][4];  // Eᵀ = Uᵀ - Sᵀ Wᵀ as A fragments over the chunk rows
    e_from_u<F16, LDU>(ea, ae, sU, 16 * warp, lane);
    if (KEEP) store_tile_t<64, LDS>(p.ws.E + ch * 64 * KP + ew, KP, stg, ae, lane);
    if (OUT) {
      // Oᵀ += Eᵀ A_qkᵀ (A_qk K-major, fp16 in mode 0)
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (F16) wg_m64n64k16_rs_f16(ao, ea[kk], wg_desc(b + 3 * TILE + kk * 32), 1);
        else wg_m64n64k16_rs_bf16(ao, ea[kk], wg_desc(b + 3 * TILE + kk * 32), 1);
      }
      wg_commit();
      wg_wait<0>();
      fence_acc(ao);
    }
    // Sᵀ <- Sᵀ Diag(Γ_last) + Eᵀ Kd (Kd N-major), running while O goes out
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt) {
      const float2 gl = *reinterpret_cast<const float2*>(sGl + 8 * nt + 2 * t);
      st[nt][0] *= gl.x, st[nt][1] *= gl.y, st[nt][2] *= gl.x, st[nt][3] *= gl.y;
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wg_n128_tb<F16>(st, ea[kk], wg_desc_mn(b + 2 * TILE + kk * 16 * 128, 8192));
    wg_commit();
    if (OUT) {
      stage_t<8, LDS>(stg, ao, lane);
      __syncwarp();
      const ChunkInfo ci = p.chunks[c];
      const int64_t HV = int64_t(H) * V;
      for (int idx = lane; idx < 128; idx += 32) {
        const int i = idx >> 1, hv = (idx & 1) * 8;
        if (i < ci.len)
          *reinterpret_cast<uint4*>(p.o + (int64_t(ci.row0) + i) * HV + int64_t(h) * V + ew + hv) =
              *reinterpret_cast<const uint4*>(stg + i * LDS + hv);
      }
      __syncwarp();
    }
    wg_wait<0>();
    fence_acc(st);
    __syncthreads();  // stage s is free for chunk c + 2
  }
  if (OUT && p.ht) store_state<KP>(st, p.ht + sh * K * V, K, V, ew, lane);
}

template <int NW, int MODE>
void launch_nw(const OpParams& p, int N, cudaStream_t s) {
  const size_t smem = WgSmem<NW, MODE>::bytes;
  static_assert(WgSmem<NW, MODE>::bytes <= 227 * 1024, "one block's shared memory on Hopper");
  static bool attr = false;
  if (!attr) {
    cudaFuncSetAttribute(recur_fwd_wgmma_kernel<NW, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    attr = true;
  }
  launch_recurrence(recur_fwd_wgmma_kernel<NW, MODE>, dim3(128 / (16 * NW), p.H, N), NW * 32, smem, s, p);
}

template <int NW>
void launch_mode(const OpParams& p, int N, int mode, cudaStream_t s) {
  if (mode == 0) launch_nw<NW, 0>(p, N, s);
  else if (mode == 1) launch_nw<NW, 1>(p, N, s);
  else launch_nw<NW, 2>(p, N, s);
}

// The reverse recurrence (recur.cu's recur_bwd_kernel): dS at every chunk end, dE, dh0; bf16 operands.
//   dEᵀ = dSᵀ Kdᵀ + dOᵀ A_qk,   dSᵀ <- dSᵀ Diag(Γ_last) + dOᵀ Qg - dEᵀ W
// Kd is read K-major here and W, Qg, A_qk N-major: the same swizzled panels serve both descriptor kinds.
template <int NW>
__global__ void __launch_bounds__(NW * 32, 1) recur_bwd_wgmma_kernel(const OpParams p) {
  using SM = WgSmem<NW, 1>;
  constexpr int KP = 128, LDU = SM::LDU, LDS = SM::LDS, NT = NW * 32;
  constexpr size_t TILE = SM::TILE, ATILE = SM::ATILE;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t = lane & 3;
  const int n = blockIdx.z, h = blockIdx.y, H = p.H, K = p.K, V = p.V;
  const int eb = blockIdx.x * 16 * NW, ew = eb + 16 * warp;
  const int64_t HV = int64_t(H) * V;
  bf16* stg = reinterpret_cast<bf16*>(smem + 2 * SM::stage) + warp * 128 * LDS;
  // stage s: W | Qg | Kd | A_qk | dO (this block's columns) | Γ_last
  auto issue = [&](int c, int s) {
    unsigned char* b = smem + s * SM::stage;
    const int64_t ch = int64_t(c) * H + h;
    const ChunkInfo ci = p.chunks[c];
    load_swz<128, NT>(b, p.ws.W + ch * 64 * KP, tid);
    load_swz<128, NT>(b + TILE, p.ws.Qg + ch * 64 * KP, tid);
    load_swz<128, NT>(b + 2 * TILE, p.ws.Kd + ch * 64 * KP, tid);
    load_swz<64, NT>(b + 3 * TILE, p.ws.Aqk + ch * 4096, tid);
    load_tile<64, 16 * NW, LDU, NT>(reinterpret_cast<bf16*>(b + 3 * TILE + ATILE),
                                    p.dout + int64_t(ci.row0) * HV + int64_t(h) * V + eb, HV, ci.len, V - eb, tid);
    load_f32<KP, NT>(reinterpret_cast<float*>(b + 3 * TILE + ATILE + SM::U), p.ws.Gl + ch * KP, tid);
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
    fence_proxy_async();
    __syncthreads();
    const unsigned char* b = smem + s * SM::stage;
    const bf16* sO = reinterpret_cast<const bf16*>(b + 3 * TILE + ATILE);
    const float* sGl = reinterpret_cast<const float*>(b + 3 * TILE + ATILE + SM::U);
    const int64_t ch = int64_t(c) * H + h;
    store_tile_t<KP, LDS>(p.ws.dS + ch * KP * KP + ew, KP, stg, st, lane);  // dS at the chunk end, [K][V]
    uint32_t sa[KP / 16][4], oa[4][4];
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk) c_to_a(sa[kk], st[2 * kk], st[2 * kk + 1]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldsm4t(oa[kk], sO + 16 * kk * LDU + 16 * warp + at_off(lane, LDU));
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KP / 16; ++kk)  // dSᵀ Kdᵀ
      wg_m64n64k16_rs_bf16(acc, sa[kk], wg_desc(b + 2 * TILE + (kk >> 2) * 8192 + (kk & 3) * 32), 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // + dOᵀ A_qk
      wg_m64n64k16_rs_tb_bf16(acc, oa[kk], wg_desc_mn(b + 3 * TILE + kk * 16 * 128, 8192), 1);
    wg_commit();
    wg_wait<0>();
    fence_acc(acc);
    uint32_t na[4][4];  // -dEᵀ
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) c_to_a(na[kk], acc[2 * kk], acc[2 * kk + 1], -1.f);
#pragma unroll
    for (int nt = 0; nt < KP / 8; ++nt) {
      const float2 gl = *reinterpret_cast<const float2*>(sGl + 8 * nt + 2 * t);
      st[nt][0] *= gl.x, st[nt][1] *= gl.y, st[nt][2] *= gl.x, st[nt][3] *= gl.y;
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wg_n128_tb<false>(st, oa[kk], wg_desc_mn(b + TILE + kk * 16 * 128, 8192));
      wg_n128_tb<false>(st, na[kk], wg_desc_mn(b + kk * 16 * 128, 8192));
    }
    wg_commit();
    store_tile_t<64, LDS>(p.ws.dE + ch * 64 * KP + ew, KP, stg, acc, lane);  // dE goes out while the state update runs
    wg_wait<0>();
    fence_acc(st);
    __syncthreads();  // stage s is free for chunk c - 2
  }
  if (p.dh0) store_state<KP>(st, p.dh0 + sh * K * V, K, V, ew, lane);
}

template <int NW>
void launch_bwd_nw(const OpParams& p, int N, cudaStream_t s) {
  const size_t smem = WgSmem<NW, 1>::bytes;
  static bool attr = false;
  if (!attr) {
    cudaFuncSetAttribute(recur_bwd_wgmma_kernel<NW>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    attr = true;
  }
  launch_recurrence(recur_bwd_wgmma_kernel<NW>, dim3(128 / (16 * NW), p.H, N), NW * 32, smem, s, p);
}

bool use_wgmma(const OpParams& p, int NW) {
  return wgmma_recurrences(p.K, p.V) && (NW == 4 || NW == 8);
}

}  // namespace

bool wgmma_recurrences(int K, int V) {
  static const bool off = env::kda_recur_mma();  // keep the mma.sync recurrences (comparisons)
  return !off && K == 128 && V == 128;
}

bool launch_recur_bwd_wgmma(const OpParams& p, int NW, int N, cudaStream_t s) {
  if (!use_wgmma(p, NW)) return false;
  if (NW == 8) launch_bwd_nw<8>(p, N, s);
  else launch_bwd_nw<4>(p, N, s);
  return true;
}

bool launch_recur_fwd_wgmma(const OpParams& p, int NW, int N, int mode, cudaStream_t s) {
  if (!use_wgmma(p, NW)) return false;
  if (NW == 8) launch_mode<8>(p, N, mode, s);
  else launch_mode<4>(p, N, mode, s);
  return true;
}

}  // namespace lm::kda::cuda::detail

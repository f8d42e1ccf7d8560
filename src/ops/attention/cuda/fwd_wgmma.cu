// Causal flash attention forward on Hopper warpgroup MMAs (FlashAttention-3 structure): TMA loads, wgmma
// bf16 → fp32, online softmax in registers, intra-warpgroup overlap and a two-warpgroup ping-pong.
//
// Legend: T tokens of a sequence (len), H query heads, G = H / Hkv, Dk q/k head dim (128 | 192), Dv = 128,
//         Bq = 128 query rows per block (2 consumer warpgroups × 64 rows), Bk = 128 keys per step.
// Warp roles (384 threads): warpgroup 0 produces (one thread issues TMA: Q once, then K_j and V_j into a
// two-stage ring; K and V each have "full" and "empty" mbarriers, so K_{j+2} loads as soon as S_j is done while
// V_j is still being read); warpgroups 1 and 2 each own 64 query rows: S = Q·K_jᵀ (wgmma, both operands K-major
// in shared memory), mask and online softmax on the accumulators, then O += P·V_j with P straight from
// registers (the accumulator layout of S is the A-fragment layout of the next wgmma) and V read N-major
// (transposed) from shared memory.
// Schedule: S_j is issued together with O += P_{j-1}·V_{j-1}, and the softmax of S_j runs under that product
// (P stays as 32 bf16x2 registers, so S, O and P fit in 240 registers for Dk = 192 too). The warpgroups take
// turns issuing (named barriers): one's softmax runs under the other's products. Either alone was slower than
// neither on the H200 (one run: 192/128 512 / 488 / 493 TFLOP/s serial / overlap / ping-pong, both 618).
// Tiles in shared memory are [rows][64] bf16 boxes with the 128-byte swizzle (Dk/64 boxes for Q and K, 2
// for V). The TMA maps view q, k, v as 3-D tensors [rows][heads][D], so one map serves every head; rows past
// the sequence (the next sequence's, or zero fill past the end) are masked as keys and never stored as rows.
// Key tiles run from the diagonal down (the masked tile first).
// Block mode (p.tiles == null; attention_forward_block): one chunk of q_len query rows against k_len keys whose
// positions are offset by delta = q_pos0 − k_pos0 (query row r sees key j iff j ≤ r + delta); grid tile b is
// query tile ntiles − 1 − b (work grows with the tile index, so that is heaviest first). A tile that sees no key
// writes o = 0, lse = −inf and exits; a row that sees none gets the same through m = −inf, l = 0. Keys past
// k_len are the map's zero fill, masked. It is a separate instance (BLOCK, default schedule only), so the
// sequence path compiles to the code it had before.
#include <cuda.h>

#include <cstdlib>

#include "core/cuda/tensor_map.hpp"
#include "core/cuda/wgmma.cuh"  // mbarrier, TMA and wgmma helpers (shared with the grouped GEMM)
#include "core/env.hpp"
#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"

namespace lm::ops::cuda::detail {

namespace {

constexpr int kBq = 128, kBk = 128, kDv = 128, kThreads = 384;

template <int DK>
struct WgSmem {
  static constexpr int Q = DK * kBq * 2, K = DK * kBk * 2, V = kDv * kBk * 2;
  static constexpr int oQ = 0, oK = Q, oV = oK + 2 * K, oBar = oV + 2 * V, bytes = oBar + 16 * 8 + 1024;
};

template <int DK, bool OVERLAP, bool PINGPONG, bool BLOCK>
__global__ void __launch_bounds__(kThreads, 1)
    attn_fwd_wgmma_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                          const __grid_constant__ CUtensorMap tmV, const FwdParams p) {
  using L = WgSmem<DK>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem + L::oQ;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + L::oBar);
  uint64_t *fullQ = bar, *fullK = bar + 1, *fullV = bar + 3, *emptyK = bar + 5, *emptyV = bar + 7;

  const int ntiles = gridDim.x / p.H;
  const int2 ht = head_and_tile(blockIdx.x, p.H, ntiles, p.head_group);
  const int h = ht.x, hk = h / p.G;
  // This tile: rows [q0, q0 + 128) of the sequence at row s0 (len query rows, klen keys, key rows also from s0),
  // query row r at key position r + delta.
  // (BLOCK is a template parameter so that the sequence path compiles to exactly the code it had before.)
  int s0, len, klen, delta, q0, nkt;
  if constexpr (!BLOCK) {
    const int2 tl = p.tiles[ht.y];
    s0 = p.seq_start[tl.x], len = p.seq_start[tl.x + 1] - s0, klen = len, delta = 0, q0 = tl.y * kBq;
    nkt = (min(q0 + kBq, len) + kBk - 1) / kBk;
  } else {
    s0 = 0, len = p.q_len, klen = p.k_len, delta = p.delta, q0 = (ntiles - 1 - ht.y) * kBq;
    const int kend = min(q0 + kBq + delta, klen);  // keys [0, kend) are visible to some row of the tile
    nkt = kend > 0 ? (kend + kBk - 1) / kBk : 0;
  }
  const int tid = threadIdx.x, wg = tid / 128;
  if (BLOCK && nkt == 0) {  // no row of the tile sees a key (uniform over the block, before any barrier)
    bf16* Og = static_cast<bf16*>(p.o) + int64_t(h) * kDv;
    const int nr = min(kBq, len - q0);
    for (int i = tid; i < nr * (kDv / 8); i += kThreads)
      *reinterpret_cast<uint4*>(Og + int64_t(q0 + i / (kDv / 8)) * p.so + 8 * (i % (kDv / 8))) = make_uint4(0, 0, 0, 0);
    if (p.lse)
      for (int i = tid; i < nr; i += kThreads) p.lse[int64_t(q0 + i) * p.H + h] = -INFINITY;
    return;
  }

  if (tid == 0) {
    mbar_init(fullQ, 1);
    for (int s = 0; s < 2; ++s)
      mbar_init(&fullK[s], 1), mbar_init(&fullV[s], 1), mbar_init(&emptyK[s], 256), mbar_init(&emptyV[s], 256);
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      mbar_expect_tx(fullQ, L::Q);
      for (int a = 0; a < DK / 64; ++a) tma_load_3d(sQ + a * kBq * 128, &tmQ, fullQ, 64 * a, h, s0 + q0);
      for (int it = 0; it < nkt; ++it) {
        const int j = nkt - 1 - it, s = it & 1;
        unsigned char* sK = smem + L::oK + s * L::K;
        unsigned char* sV = smem + L::oV + s * L::V;
        mbar_wait(&emptyK[s], ((it >> 1) & 1) ^ 1);
        mbar_expect_tx(&fullK[s], L::K);
        for (int a = 0; a < DK / 64; ++a) tma_load_3d(sK + a * kBk * 128, &tmK, &fullK[s], 64 * a, hk, s0 + j * kBk);
        mbar_wait(&emptyV[s], ((it >> 1) & 1) ^ 1);
        mbar_expect_tx(&fullV[s], L::V);
        for (int a = 0; a < kDv / 64; ++a) tma_load_3d(sV + a * kBk * 128, &tmV, &fullV[s], 64 * a, hk, s0 + j * kBk);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int c = wg - 1, ltid = tid - 128 * wg, warp = ltid >> 5, lane = ltid & 31, g = lane >> 2, t = lane & 3;
  const int wq0 = q0 + 64 * c;  // first row of this warpgroup inside the sequence
  const int wp0 = wq0 + delta;  // its key position (the last key its first row sees)
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  mbar_wait(fullQ, 0);

  // S_it = Q·K_jᵀ into acc (asynchronous: committed, not waited for).
  auto issue_s = [&](float (&acc)[64], int it) {
    const int s = it & 1;
    const unsigned char* sK = smem + L::oK + s * L::K;
    mbar_wait(&fullK[s], (it >> 1) & 1);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk)
      wgmma_m64n128k16_ss(acc, wg_desc(sQ + (kk >> 2) * kBq * 128 + c * 64 * 128 + (kk & 3) * 32),
                          wg_desc(sK + (kk >> 2) * kBk * 128 + (kk & 3) * 32), kk > 0 ? 1 : 0);
    wg_commit();
  };
  // Mask, online softmax in place (sc becomes P in fp32), running max and sum; alpha rescales O.
  auto softmax = [&](float (&sc)[64], int it, float (&alpha)[2]) {
    const int k0 = (nkt - 1 - it) * kBk;
    const bool need_mask = (k0 + kBk - 1 > wp0) || (k0 + kBk > klen);
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[4 * n + e] * p.scale_log2;
        if (need_mask) {
          const int key = k0 + 8 * n + 2 * t + (e & 1), pos = wp0 + 16 * warp + g + 8 * (e >> 1);
          if (key > pos || key >= klen) x = -INFINITY;
        }
        sc[4 * n + e] = x;
      }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 16; ++n) mx = fmaxf(mx, fmaxf(sc[4 * n + 2 * hr], sc[4 * n + 2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hr], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
      alpha[hr] = fast_exp2(m_run[hr] - m_use);
      m_run[hr] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const float p0 = fast_exp2(sc[4 * n + 2 * hr] - m_use), p1 = fast_exp2(sc[4 * n + 2 * hr + 1] - m_use);
        sc[4 * n + 2 * hr] = p0, sc[4 * n + 2 * hr + 1] = p1;
        sum += p0 + p1;
      }
      l_run[hr] = l_run[hr] * alpha[hr] + sum;
    }
  };
  // O = alpha·O + P·V_j: rescale, P (fp32 in sc) to bf16 A fragments, then the MMA (committed, not waited for;
  // the fragments stay live until it completes).
  uint32_t pa[8][4];
  auto prep_p = [&](const float (&sc)[64], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) o[4 * n + 2 * hr] *= alpha[hr], o[4 * n + 2 * hr + 1] *= alpha[hr];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pack_bf16(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
  };
  auto issue_pv = [&](int it) {
    const int s = it & 1;
    const unsigned char* sV = smem + L::oV + s * L::V;
    mbar_wait(&fullV[s], (it >> 1) & 1);
    wg_fence_regs(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma_m64n128k16_rs_tb(o, pa[kk], wg_desc_mn(sV + kk * 16 * 128, kBk * 128));
    wg_commit();
  };

  // Ping-pong (hopper.cuh): one warpgroup's softmax runs under the other's products.
  auto turn_begin = [&] {
    if constexpr (PINGPONG) pingpong_wait_turn(c);
  };
  auto turn_end = [&] {
    if constexpr (PINGPONG) pingpong_pass_turn(c);
  };
  if constexpr (PINGPONG) pingpong_open(c);
  float sc[64], alpha[2];
  if constexpr (OVERLAP) {
    // S_it is issued before O += P_{it-1}·V_{it-1}; the softmax of S_it runs under that product.
    turn_begin();
    issue_s(sc, 0);
    turn_end();
    wg_wait<0>();
    wg_fence_regs(sc);
    mbar_arrive(&emptyK[0]);
    softmax(sc, 0, alpha);
    prep_p(sc, alpha);
    for (int it = 1; it < nkt; ++it) {
      turn_begin();
      issue_s(sc, it);
      issue_pv(it - 1);
      turn_end();
      wg_wait<1>();
      wg_fence_regs(sc);
      mbar_arrive(&emptyK[it & 1]);
      softmax(sc, it, alpha);
      wg_wait<0>();
      wg_fence_regs(o);
      mbar_arrive(&emptyV[(it - 1) & 1]);
      prep_p(sc, alpha);
    }
    turn_begin();
    issue_pv(nkt - 1);
    turn_end();
    wg_wait<0>();
    wg_fence_regs(o);
    mbar_arrive(&emptyV[(nkt - 1) & 1]);
  } else {
    for (int it = 0; it < nkt; ++it) {
      turn_begin();
      issue_s(sc, it);
      turn_end();
      wg_wait<0>();
      wg_fence_regs(sc);
      mbar_arrive(&emptyK[it & 1]);
      softmax(sc, it, alpha);
      prep_p(sc, alpha);
      turn_begin();
      issue_pv(it);
      turn_end();
      wg_wait<0>();
      wg_fence_regs(o);
      mbar_arrive(&emptyV[it & 1]);
    }
  }

  if constexpr (PINGPONG) pingpong_close(c);

  bf16* Og = static_cast<bf16*>(p.o) + int64_t(s0) * p.so + int64_t(h) * kDv;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = l_run[hr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = wq0 + 16 * warp + g + 8 * hr;
    if (row < len) {
      bf16* orow = Og + int64_t(row) * p.so;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * t) = pack_bf16(o[4 * n + 2 * hr] * inv, o[4 * n + 2 * hr + 1] * inv);
      if (p.lse && t == 0) p.lse[(int64_t(s0) + row) * p.H + h] = (m_run[hr] + __log2f(l)) * 0.69314718055994531f;
    }
  }
}

// q, k, v viewed as [rows][heads][D] (dims innermost first), boxes of 64 × 1 × box_rows.
CUtensorMap qkv_map(const void* base, int64_t rows, int64_t heads, int64_t D, int box_rows) {
  const uint64_t dims[3] = {uint64_t(D), uint64_t(heads), uint64_t(rows)};
  const uint64_t strides[2] = {uint64_t(D) * 2, uint64_t(heads * D) * 2};
  const uint32_t box[3] = {64u, 1u, uint32_t(box_rows)};
  return bf16_tensor_map(base, 3, dims, strides, box);
}

template <int DK, bool OVERLAP, bool PINGPONG, bool BLOCK = false>
void launch_t(const FwdParams& p, int64_t q_rows, int64_t k_rows, int Hkv, int ntiles, cudaStream_t s) {
  constexpr int bytes = WgSmem<DK>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(attn_fwd_wgmma_kernel<DK, OVERLAP, PINGPONG, BLOCK>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
  }();
  (void)attr;
  const CUtensorMap tq = qkv_map(p.q, q_rows, p.H, DK, kBq), tk = qkv_map(p.k, k_rows, Hkv, DK, kBk),
                    tv = qkv_map(p.v, k_rows, Hkv, kDv, kBk);
  attn_fwd_wgmma_kernel<DK, OVERLAP, PINGPONG, BLOCK><<<ntiles * p.H, kThreads, bytes, s>>>(tq, tk, tv, p);
}

// LONGMOE_ATTN_FWD_MODE (A/B runs): bit 0 intra-warpgroup overlap, bit 1 ping-pong.
int fwd_mode() {
  static const int v = env::attn_fwd_mode();
  return v;
}
template <int DK>
void launch_mode(const FwdParams& p, int64_t q_rows, int64_t k_rows, int Hkv, int ntiles, cudaStream_t s) {
  // Block mode: the default schedule only (overlap and ping-pong; LONGMOE_ATTN_FWD_MODE does not apply).
  if (!p.tiles) return launch_t<DK, true, true, true>(p, q_rows, k_rows, Hkv, ntiles, s);
  switch (fwd_mode()) {
    case 0: return launch_t<DK, false, false>(p, q_rows, k_rows, Hkv, ntiles, s);
    case 1: return launch_t<DK, true, false>(p, q_rows, k_rows, Hkv, ntiles, s);
    case 2: return launch_t<DK, false, true>(p, q_rows, k_rows, Hkv, ntiles, s);
    default: return launch_t<DK, true, true>(p, q_rows, k_rows, Hkv, ntiles, s);
  }
}

}  // namespace

void launch_fwd_wgmma(const FwdParams& p, int Dk, int64_t q_rows, int64_t k_rows, int Hkv, int ntiles, cudaStream_t s) {
  if (Dk == 192) return launch_mode<192>(p, q_rows, k_rows, Hkv, ntiles, s);
  launch_mode<128>(p, q_rows, k_rows, Hkv, ntiles, s);
}

}  // namespace lm::ops::cuda::detail

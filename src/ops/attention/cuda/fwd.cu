// Causal flash attention forward (FlashAttention-2 structure) on mma.sync bf16 tensor cores.
//
// Legend: T tokens of a sequence (len), H query heads, G = H / Hkv, Dk q/k head dim, Dv v head dim,
//         Bq = 128 query rows per block (4 warps × 32 rows), Bk = 64 keys per step.
// One block per (query tile, head), heavy tiles first. Q stays in shared memory; K and V have one buffer
// each and their loads alternate with the two products (V_j streams in during S = Q·K_jᵀ, K_{j-1} during
// O += P·V_j), which keeps the block at ~94 KB so two blocks share an SM. Key tiles run from the diagonal
// down, so the masked tiles come first; a warp skips a tile whose keys all lie above its rows.
// Softmax in the log2 domain (scores · scale · log2 e), running max and sum in fp32.
#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"

namespace lm::ops::cuda::detail {

namespace {

constexpr int kBq = 128, kBk = 64, kThreads = 128;

template <int DK, int DV>
struct FwdSmem {
  static constexpr int LDQ = DK + 8, LDV = DV + 8;  // +16 bytes per row: conflict-free ldmatrix
  static constexpr int bytes = (kBq * LDQ + kBk * LDQ + kBk * LDV) * 2;
};

template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 2) attn_fwd_kernel(const FwdParams p) {
  using S = FwdSmem<DK, DV>;
  constexpr int LDQ = S::LDQ, LDV = S::LDV, NV = DV / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + kBq * LDQ;
  bf16* sV = sK + kBk * LDQ;

  const int2 ht = head_and_tile(blockIdx.x, p.H, gridDim.x / p.H, p.head_group);
  const int h = ht.x;
  const int2 tl = p.tiles[ht.y];
  const int s0 = p.seq_start[tl.x], len = p.seq_start[tl.x + 1] - s0;
  const int q0 = tl.y * kBq, hk = h / p.G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bf16* Qg = static_cast<const bf16*>(p.q) + (int64_t(s0) + q0) * p.sq + int64_t(h) * DK;
  const bf16* Kg = static_cast<const bf16*>(p.k) + int64_t(s0) * p.sk + int64_t(hk) * DK;
  const bf16* Vg = static_cast<const bf16*>(p.v) + int64_t(s0) * p.sv + int64_t(hk) * DV;

  const int kend = min(q0 + kBq, len);  // keys [0, kend) are visible to some row of the tile
  int j = (kend - 1) / kBk;
  load_rows<kBq, DK, LDQ, kThreads>(sQ, Qg, p.sq, min(kBq, len - q0), tid);
  load_rows<kBk, DK, LDQ, kThreads>(sK, Kg + int64_t(j) * kBk * p.sk, p.sk, min(kBk, len - j * kBk), tid);
  cp_commit();

  float acc[2][NV][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < NV; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
  float m_run[2][2], l_run[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;
  const int wrow0 = q0 + warp * 32;  // first row of this warp inside the sequence

  for (; j >= 0; --j) {
    const int k0 = j * kBk;
    cp_wait<0>();
    __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j+1}
    load_rows<kBk, DV, LDV, kThreads>(sV, Vg + int64_t(k0) * p.sv, p.sv, min(kBk, len - k0), tid);
    cp_commit();
    const bool active = k0 <= wrow0 + 31;
    float s[2][8][4];
    if (active) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll 2
      for (int kk = 0; kk < DK / 16; ++kk) {
        uint32_t a0[4], a1[4];
        ldsm4(a0, sQ + (warp * 32) * LDQ + kk * 16 + a_off(lane, LDQ));
        ldsm4(a1, sQ + (warp * 32 + 16) * LDQ + kk * 16 + a_off(lane, LDQ));
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          ldsm4(b, sK + (np * 16) * LDQ + kk * 16 + bn_off(lane, LDQ));
          mma_bf16(s[0][2 * np], a0, b[0], b[1]);
          mma_bf16(s[0][2 * np + 1], a0, b[2], b[3]);
          mma_bf16(s[1][2 * np], a1, b[0], b[1]);
          mma_bf16(s[1][2 * np + 1], a1, b[2], b[3]);
        }
      }
      // Mask keys above the diagonal and beyond the sequence; only tiles that reach them pay for it.
      const bool need_mask = (k0 + kBk - 1 > wrow0) || (k0 + kBk > len);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[mt][n][e] * p.scale_log2;
            if (need_mask) {
              const int key = k0 + n * 8 + 2 * t + (e & 1), row = wrow0 + mt * 16 + g + (e >> 1) * 8;
              if (key > row || key >= len) x = -INFINITY;
            }
            s[mt][n][e] = x;
          }
      // Online softmax: rows g and g + 8 of each m tile; the 4 lanes of a quad share a row.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * hr], s[mt][n][2 * hr + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][hr], mx);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
          const float alpha = fast_exp2(m_run[mt][hr] - m_use);
          m_run[mt][hr] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            const float p0 = fast_exp2(s[mt][n][2 * hr] - m_use), p1 = fast_exp2(s[mt][n][2 * hr + 1] - m_use);
            s[mt][n][2 * hr] = p0, s[mt][n][2 * hr + 1] = p1;
            sum += p0 + p1;
          }
          l_run[mt][hr] = l_run[mt][hr] * alpha + sum;
#pragma unroll
          for (int n = 0; n < NV; ++n) acc[mt][n][2 * hr] *= alpha, acc[mt][n][2 * hr + 1] *= alpha;
        }
    }
    cp_wait<0>();
    __syncthreads();  // V_j landed; every warp is done with K_j
    if (j > 0) {
      load_rows<kBk, DK, LDQ, kThreads>(sK, Kg + int64_t(k0 - kBk) * p.sk, p.sk, kBk, tid);
      cp_commit();
    }
    if (active) {
#pragma unroll
      for (int kk = 0; kk < kBk / 16; ++kk) {
        uint32_t a0[4], a1[4];
        c_to_a(a0, s[0][2 * kk], s[0][2 * kk + 1]);
        c_to_a(a1, s[1][2 * kk], s[1][2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < DV / 16; ++np) {
          uint32_t b[4];
          ldsm4t(b, sV + (kk * 16) * LDV + np * 16 + bt_off(lane, LDV));
          mma_bf16(acc[0][2 * np], a0, b[0], b[1]);
          mma_bf16(acc[0][2 * np + 1], a0, b[2], b[3]);
          mma_bf16(acc[1][2 * np], a1, b[0], b[1]);
          mma_bf16(acc[1][2 * np + 1], a1, b[2], b[3]);
        }
      }
    }
  }

  bf16* Og = static_cast<bf16*>(p.o) + int64_t(s0) * p.so + int64_t(h) * DV;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = l_run[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = wrow0 + mt * 16 + g + hr * 8;
      if (row < len) {
        bf16* orow = Og + int64_t(row) * p.so;
#pragma unroll
        for (int n = 0; n < NV; ++n)
          *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t) =
              pack_bf16(acc[mt][n][2 * hr] * inv, acc[mt][n][2 * hr + 1] * inv);
        if (p.lse && t == 0) p.lse[(int64_t(s0) + row) * p.H + h] = (m_run[mt][hr] + __log2f(l)) * 0.69314718055994531f;
      }
    }
}

template <int DK, int DV>
void launch_fwd_t(const FwdParams& p, int ntiles, cudaStream_t s) {
  constexpr int bytes = FwdSmem<DK, DV>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(attn_fwd_kernel<DK, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
           cudaSuccess;
  }();
  (void)attr;
  attn_fwd_kernel<DK, DV><<<ntiles * p.H, kThreads, bytes, s>>>(p);
}

}  // namespace

void launch_fwd(const FwdParams& p, int Dk, int Dv, int ntiles, cudaStream_t s) {
  if (Dk == 192 && Dv == 128) return launch_fwd_t<192, 128>(p, ntiles, s);
  launch_fwd_t<128, 128>(p, ntiles, s);
}

}  // namespace lm::ops::cuda::detail

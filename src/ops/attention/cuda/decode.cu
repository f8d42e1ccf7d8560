// Absorbed MLA decode over the latent cache (SPEC §3) on mma.sync bf16 tensor cores, split-K over positions.
//
// Legend: S sequences, H heads, Tc cached positions (per sequence), R = 512 latent (kv_lora_rank), Dr = 64 rope
//         dims, D = R + Dr = 576, MH = 16·MT heads per block, Bt = 64 positions per step (= one block of a paged
//         cache), splits = position ranges (split-K). Grid (splits, head groups, S).
// The cache of sequence s is dense (rows cache + s·seq_stride) or paged: its tile j is block table[s][j] of the
// pool [blocks, Bt, ldc]. Tc is p.Tc, or lens[s] + len_add read on the device (a CUDA graph replays one launch
// while the caches grow), when each sequence splits its own tiles evenly over the grid's splits.
// Every head reads the same cache rows, so the heads form the M side of two products per step:
//   S [MH, Bt] = [q_lat | q_rope] · cacheᵀ (K = 576; warp w takes positions 16w..16w+15),
//   O [MH, R] += P · c (K = Bt; warp w takes latent columns 128w..128w+127),
// with an online softmax (fp32, log2 domain) between them through shared memory. The cache streams through
// a double-buffered cp.async pipeline. Each block writes its unnormalised partial O with (max, sum); a combine
// kernel merges the splits by log-sum-exp.
#include <cmath>

#include "ops/attention/cuda/kernels.hpp"
#include "ops/attention/cuda/tc.cuh"

namespace lm::ops::cuda::detail {

int decode_heads_per_block(int64_t H) { return H >= 32 ? 32 : 16; }

namespace {

constexpr int kR = 512, kDr = 64, kD = kR + kDr, kLDC = kD + 8, kBt = 64, kLDS = kBt + 4, kLDP = kBt + 8;
constexpr int kThreads = 128;

template <int MT>
struct DecSmem {
  static constexpr int MH = 16 * MT;
  static constexpr int oQ = 0, oC = oQ + MH * kLDC * 2, oS = oC + 2 * kBt * kLDC * 2, oP = oS + MH * kLDS * 4,
                       oA = oP + MH * kLDP * 2, oM = oA + MH * 4, oL = oM + MH * 4, bytes = oL + MH * 4;
};

template <int MT>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const DecParams p) {
  using L = DecSmem<MT>;
  constexpr int MH = L::MH;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::oQ);
  bf16* sC = reinterpret_cast<bf16*>(smem + L::oC);
  float* sS = reinterpret_cast<float*>(smem + L::oS);
  bf16* sP = reinterpret_cast<bf16*>(smem + L::oP);
  float* sA = reinterpret_cast<float*>(smem + L::oA);
  float* sM = reinterpret_cast<float*>(smem + L::oM);
  float* sL = reinterpret_cast<float*>(smem + L::oL);

  const int split = blockIdx.x, h0 = blockIdx.y * MH, nh = min(MH, p.H - h0), seq = blockIdx.z;
  const int Tc = p.lens ? p.lens[seq] + p.len_add : p.Tc;
  const int ntiles = (Tc + kBt - 1) / kBt;
  const int tps = p.lens ? (ntiles + p.splits - 1) / p.splits : p.tiles_per_split;
  const int tb = split * tps, te = min(tb + tps, ntiles);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bf16* cache = static_cast<const bf16*>(p.cache);
  const int* table = p.table ? p.table + int64_t(seq) * p.table_ld : nullptr;
  if (!table) cache += int64_t(seq) * p.seq_stride;
  const int64_t qo = int64_t(seq) * p.H;  // this sequence's head rows of q_lat, q_rope, o_lat
  float* part_o = p.part_o + int64_t(seq) * p.splits * p.H * kR;
  float* part_ml = p.part_ml + int64_t(seq) * p.splits * 2 * p.H;

  // [q_lat | q_rope] rows of this head group; rows >= nh zero.
  for (int idx = tid; idx < MH * (kD / 8); idx += kThreads) {
    const int r = idx / (kD / 8), c = (idx % (kD / 8)) * 8;
    const bool ok = r < nh;
    const bf16* src = c < kR ? static_cast<const bf16*>(p.q_lat) + (qo + h0 + (ok ? r : 0)) * kR + c
                             : static_cast<const bf16*>(p.q_rope) + (qo + h0 + (ok ? r : 0)) * p.ldqr + (c - kR);
    cp_async16(sQ + r * kLDC + c, src, ok);
  }
  auto load_tile = [&](int tile, int buf) {
    const int p0 = tile * kBt;
    const bf16* rows = table ? cache + int64_t(table[tile]) * kBt * p.ldc : cache + int64_t(p0) * p.ldc;
    load_rows<kBt, kD, kLDC, kThreads>(sC + buf * kBt * kLDC, rows, p.ldc, min(kBt, Tc - p0), tid);
  };
  if (tb < te) load_tile(tb, 0);
  cp_commit();
  if (tid < MH) sM[tid] = -INFINITY, sL[tid] = 0.f;

  float acc[MT][16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < 16; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;

  for (int it = tb; it < te; ++it) {
    const int buf = (it - tb) & 1;
    const bf16* cC = sC + buf * kBt * kLDC;
    cp_wait<0>();
    __syncthreads();
    if (it + 1 < te) load_tile(it + 1, buf ^ 1);
    cp_commit();

    // S: warp w, positions 16w..16w+15 (two n8 tiles). Even and odd k steps go to two accumulators: with one warp
    // per scheduler, a single chain of 36 dependent mma's would leave the tensor cores waiting on their latency.
    float s[MT][2][4], s_odd[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = s_odd[mt][n][e] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < kD / 16; kk += 2) {
      uint32_t b[4], b_odd[4];
      ldsm4(b, cC + (warp * 16) * kLDC + kk * 16 + bn_off(lane, kLDC));
      ldsm4(b_odd, cC + (warp * 16) * kLDC + (kk + 1) * 16 + bn_off(lane, kLDC));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4], a_odd[4];
        ldsm4(a, sQ + (mt * 16) * kLDC + kk * 16 + a_off(lane, kLDC));
        ldsm4(a_odd, sQ + (mt * 16) * kLDC + (kk + 1) * 16 + a_off(lane, kLDC));
        mma_bf16(s[mt][0], a, b[0], b[1]);
        mma_bf16(s[mt][1], a, b[2], b[3]);
        mma_bf16(s_odd[mt][0], a_odd, b_odd[0], b_odd[1]);
        mma_bf16(s_odd[mt][1], a_odd, b_odd[2], b_odd[3]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = mt * 16 + g + (e >> 1) * 8, c = warp * 16 + n * 8 + 2 * t + (e & 1);
          sS[r * kLDS + c] = it * kBt + c < Tc ? (s[mt][n][e] + s_odd[mt][n][e]) * p.scale_log2 : -INFINITY;
        }
    __syncthreads();

    // Online softmax: 4 threads per head row, 16 positions each.
    if (tid < 4 * MH) {
      const int r = tid >> 2, c0 = (tid & 3) * 16;
      float x[16], mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = sS[r * kLDS + c0 + i], mx = fmaxf(mx, x[i]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_old = sM[r], m_new = fmaxf(m_old, mx), m_use = m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 16; i += 2) {
        const float p0 = fast_exp2(x[i] - m_use), p1 = fast_exp2(x[i + 1] - m_use);
        sum += p0 + p1;
        *reinterpret_cast<uint32_t*>(sP + r * kLDP + c0 + i) = pack_bf16(p0, p1);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if ((tid & 3) == 0) {
        const float alpha = fast_exp2(m_old - m_use);
        sA[r] = alpha;
        sM[r] = m_new;
        sL[r] = sL[r] * alpha + sum;
      }
    }
    __syncthreads();

    // O += P·c: warp w, latent columns 128w..128w+127.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float a0 = sA[mt * 16 + g], a1 = sA[mt * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < 16; ++n) acc[mt][n][0] *= a0, acc[mt][n][1] *= a0, acc[mt][n][2] *= a1, acc[mt][n][3] *= a1;
    }
#pragma unroll
    for (int kk = 0; kk < kBt / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm4(a[mt], sP + (mt * 16) * kLDP + kk * 16 + a_off(lane, kLDP));
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        ldsm4t(b, cC + (kk * 16) * kLDC + warp * 128 + np * 16 + bt_off(lane, kLDC));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
          mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  __syncthreads();

  // Unnormalised partial output and (max, sum) of this split.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = mt * 16 + g + hr * 8;
      if (r < nh) {
        float* out = part_o + (int64_t(split) * p.H + h0 + r) * kR + warp * 128;
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<float2*>(out + n * 8 + 2 * t) = make_float2(acc[mt][n][2 * hr], acc[mt][n][2 * hr + 1]);
      }
    }
  if (tid < nh) {
    part_ml[(int64_t(split) * 2) * p.H + h0 + tid] = sM[tid];
    part_ml[(int64_t(split) * 2 + 1) * p.H + h0 + tid] = sL[tid];
  }
}

// One block per (head, sequence): o_lat = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s. The splits' partials are
// read by kCombGroups groups of 128 threads (every kCombGroups-th split each, 4 columns a thread), so that a hundred
// splits are a few rounds of independent loads rather than a hundred dependent ones.
constexpr int kCombThreads = 512, kCombGroups = kCombThreads / (kR / 4);

template <bool Max>
__device__ float block_reduce(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = Max ? fmaxf(v, w) : v + w;
  }
  __syncthreads();  // red is reused by the next call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < kCombThreads / 32; ++w) v = Max ? fmaxf(v, red[w]) : v + red[w];
  return v;
}

__global__ void __launch_bounds__(kCombThreads) mla_decode_combine_kernel(const DecParams p, bf16* o_lat, float* lse) {
  extern __shared__ float sW[];  // [splits]: 2^(m_s − M)
  __shared__ float red[kCombThreads / 32];
  __shared__ float4 sO[kCombGroups - 1][kR / 4];
  const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x, grp = tid / (kR / 4), c = (tid % (kR / 4)) * 4;
  const float* part_o = p.part_o + int64_t(seq) * p.splits * p.H * kR;
  const float* part_ml = p.part_ml + int64_t(seq) * p.splits * 2 * p.H;
  float M = -INFINITY;
  for (int s = tid; s < p.splits; s += kCombThreads) M = fmaxf(M, part_ml[int64_t(s) * 2 * p.H + h]);
  M = block_reduce<true>(M, red);
  float Lsum = 0.f;
  for (int s = tid; s < p.splits; s += kCombThreads) {
    const float w = M == -INFINITY ? 0.f : exp2f(part_ml[int64_t(s) * 2 * p.H + h] - M);  // empty splits: w = 0
    sW[s] = w;
    Lsum += w * part_ml[(int64_t(s) * 2 + 1) * p.H + h];
  }
  Lsum = block_reduce<false>(Lsum, red);  // (its barriers also publish sW)
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = grp; s < p.splits; s += kCombGroups) {
    const float w = sW[s];
    const float4 a = *reinterpret_cast<const float4*>(part_o + (int64_t(s) * p.H + h) * kR + c);
    o.x += w * a.x, o.y += w * a.y, o.z += w * a.z, o.w += w * a.w;
  }
  if (grp > 0) sO[grp - 1][c / 4] = o;
  __syncthreads();
  if (grp > 0) return;
#pragma unroll
  for (int g = 0; g < kCombGroups - 1; ++g) {
    const float4 a = sO[g][c / 4];
    o.x += a.x, o.y += a.y, o.z += a.z, o.w += a.w;
  }
  const float inv = Lsum > 0.f ? 1.f / Lsum : 0.f;
  uint2 out;
  out.x = pack_bf16(o.x * inv, o.y * inv);
  out.y = pack_bf16(o.z * inv, o.w * inv);
  *reinterpret_cast<uint2*>(o_lat + (int64_t(seq) * p.H + h) * kR + c) = out;
  if (lse && tid == 0) lse[int64_t(seq) * p.H + h] = (M + log2f(Lsum)) * 0.69314718055994531f;
}

template <int MT>
void launch_t(const DecParams& p, cudaStream_t s) {
  constexpr int bytes = DecSmem<MT>::bytes;
  static bool attr = [] {
    return cudaFuncSetAttribute(mla_decode_kernel<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
           cudaSuccess;
  }();
  (void)attr;
  const dim3 grid(p.splits, (p.H + 16 * MT - 1) / (16 * MT), p.S);
  mla_decode_kernel<MT><<<grid, kThreads, bytes, s>>>(p);
}

}  // namespace

void launch_decode(const DecParams& p, cudaStream_t s) {
  if (decode_heads_per_block(p.H) == 32) return launch_t<2>(p, s);
  launch_t<1>(p, s);
}

void launch_decode_combine(const DecParams& p, void* o_lat, float* lse, cudaStream_t s) {
  mla_decode_combine_kernel<<<dim3(p.H, p.S), kCombThreads, p.splits * sizeof(float), s>>>(
      p, static_cast<bf16*>(o_lat), lse);
}

}  // namespace lm::ops::cuda::detail

// Full (non-causal) varlen attention on the GPU, forward and backward (math and layouts in
// ops/full_attention/full_attention.hpp and full_attention_cuda.hpp): the host API and the flash-style fp32
// CUDA-core kernels. The mma.sync tensor-core kernels (full_attention_tc.cu, same tiling and media table) run
// instead whenever the strides and pointers allow their 16-byte loads, unless FullAttnShape::cuda_cores.
//
// Legend: N media, T_n rows of media n, H heads, Dh head dim (multiple of 8, <= 128), B = 64 rows per tile
//         (queries and keys alike), SD = Dh + 1 the shared-memory row stride of a [B, Dh] tile (odd: a warp reading
//         16 rows at one column hits 16 banks), PS = B + 1 the stride of a [B, B] score tile.
// Threads: 256 per block as a 16×16 grid (ty, tx); a thread owns the tile rows ty + 16i (i < 4) and either the
//         key columns tx + 16j (j < 4, in score tiles) or the head-dim columns tx + 16j (j < NJ = ⌈Dh/16⌉, in
//         [B, Dh] accumulators).
// Kernels, each one launch for all media (grid.x = tiles of every media, grid.y = heads; the block finds its
// media by binary search in a table passed as a kernel argument, 480 media per launch):
//   forward:  block per (query tile, head): K/V tiles through shared memory, online softmax (running max m and
//             denominator l per row), o = acc / l, lse = m + log l.
//   backward: Δ = rowsum(do ⊙ o) (one warp per (row, head)) into stream-ordered scratch; block per (key tile,
//             head) sums dk, dv over the media's query tiles in order; block per (query tile, head) sums dq over
//             the key tiles in order; P recomputed from lse. Fixed orders, no atomics: deterministic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/reduce.cuh"
#include "core/cuda/stream.hpp"
#include "ops/full_attention/cuda/full_attention_cuda.hpp"
#include "ops/full_attention/cuda/media.cuh"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"full attention cuda"};

using fa::kB;
using fa::kMaxMedia;
using fa::MediaTable;
using fa::tile_of;
using fa::TileOf;
constexpr int kPS = kB + 1;    // score tile row stride
constexpr int kThreads = 256;  // 16 × 16

// tile [kB, SD] fp32 <- rows [r, r + m) of a bf16 matrix (row stride ld, columns col .. col + Dh); rows >= m zero.
__device__ __forceinline__ void load_tile(float* tile, const bf16* src, int64_t ld, int64_t r, int m, int Dh,
                                          int SD) {
  for (int idx = threadIdx.x; idx < kB * Dh; idx += kThreads) {
    const int row = idx / Dh, d = idx - row * Dh;
    tile[row * SD + d] = row < m ? __bfloat162float(src[(r + row) * ld + d]) : 0.f;
  }
}

using cu::warp_max;
using cu::warp_sum;

// Scores of the thread's 4×4 cells: s[i][j] = Σ_d A[ty + 16i][d] · Bm[tx + 16j][d] over two [kB, SD] tiles.
__device__ __forceinline__ void tile_dots(const float* A, const float* Bm, int Dh, int SD, int ty, int tx,
                                          float (&s)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
  for (int d = 0; d < Dh; ++d) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = A[(ty + 16 * i) * SD + d];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = Bm[(tx + 16 * j) * SD + d];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = fmaf(a[i], b[j], s[i][j]);
  }
}

// ---- forward ------------------------------------------------------------------------------------------------

template <int NJ>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                       const bf16* k, const bf16* v, bf16* o, float* lse, int H,
                                                       int Dh, int64_t ld, int64_t ldo, float scale) {
  extern __shared__ float smem[];
  const int SD = Dh + 1;
  float* Qs = smem;
  float* Ks = Qs + kB * SD;
  float* Vs = Ks + kB * SD;
  float* Ps = Vs + kB * SD;  // [kB, kPS]: scaled scores, then probabilities
  float* row_m = Ps + kB * kPS;
  float* row_l = row_m + kB;
  float* row_a = row_l + kB;  // the rescale of the running sums at this key tile

  const int h = blockIdx.y, tid = threadIdx.x, ty = tid / 16, tx = tid % 16, warp = tid / 32, lane = tid % 32;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mq = min(kB, T - tl.r0);
  const int64_t q0 = tl.start + tl.r0, col = int64_t(h) * Dh;

  load_tile(Qs, q + col, ld, q0, mq, Dh, SD);
  if (tid < kB) row_m[tid] = -INFINITY, row_l[tid] = 0.f;
  float acc[4][NJ];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[i][j] = 0.f;

  for (int k0 = 0; k0 < T; k0 += kB) {
    const int mk = min(kB, T - k0);
    __syncthreads();  // the previous tile's Ks, Vs, Ps are no longer read
    load_tile(Ks, k + col, ld, tl.start + k0, mk, Dh, SD);
    load_tile(Vs, v + col, ld, tl.start + k0, mk, Dh, SD);
    __syncthreads();
    float s[4][4];
    tile_dots(Qs, Ks, Dh, SD, ty, tx, s);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tx + 16 * j;
        Ps[(ty + 16 * i) * kPS + c] = c < mk ? scale * s[i][j] : -INFINITY;
      }
    __syncthreads();
    // Online softmax, one warp per 8 rows, two keys per lane. Key 0 of every tile is real, so m_new is finite.
    for (int r = warp * 8; r < warp * 8 + 8; ++r) {
      float* pr = Ps + r * kPS;
      const float v0 = pr[lane], v1 = pr[lane + 32];
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(v0, v1)));
      const float p0 = expf(v0 - m_new), p1 = expf(v1 - m_new);
      pr[lane] = p0, pr[lane + 32] = p1;
      const float sum = warp_sum(p0 + p1);
      __syncwarp();
      if (lane == 0) {
        const float alpha = expf(m_old - m_new);  // 0 at the first tile (m_old = −∞)
        row_a[r] = alpha;
        row_l[r] = row_l[r] * alpha + sum;
        row_m[r] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float alpha = row_a[ty + 16 * i];
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[i][j] *= alpha;
    }
    for (int kk = 0; kk < mk; ++kk) {
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = Ps[(ty + 16 * i) * kPS + kk];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = tx + 16 * j;
        const float vv = d < Dh ? Vs[kk * SD + d] : 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][j] = fmaf(p[i], vv, acc[i][j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= mq) continue;
    const float inv = 1.f / row_l[r];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = tx + 16 * j;
      if (d < Dh) o[(q0 + r) * ldo + col + d] = __float2bfloat16_rn(acc[i][j] * inv);
    }
  }
  if (tid < mq) lse[(q0 + tid) * H + h] = row_m[tid] + logf(row_l[tid]);
}

// ---- backward -----------------------------------------------------------------------------------------------

// delta [rows, H] = Σ_d do ⊙ o per (row, head): one warp per item, grid-stride over warps.
__global__ void delta_kernel(const bf16* o, const bf16* dout, float* delta, int64_t rows, int H, int Dh,
                             int64_t ldo) {
  const int lane = threadIdx.x % 32;
  const int64_t items = rows * H, warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t it = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; it < items; it += warps) {
    const int64_t r = it / H, off = r * ldo + (it - r * H) * Dh;
    float acc = 0.f;
    for (int d = lane; d < Dh; d += 32) acc = fmaf(__bfloat162float(o[off + d]), __bfloat162float(dout[off + d]), acc);
    acc = warp_sum(acc);
    if (lane == 0) delta[it] = acc;
  }
}

// P and dS of the thread's cells for a (query tile, key tile) pair: p = exp(scale·q·k − lse), ds = p (do·v − Δ);
// zero outside the mq × mk real cells. Qs, dOs, Ks, Vs [kB, SD]; ls, dl [kB] the query rows' lse and Δ.
__device__ __forceinline__ void p_ds(const float* Qs, const float* dOs, const float* Ks, const float* Vs,
                                     const float* ls, const float* dl, int mq, int mk, int Dh, int SD, float scale,
                                     int ty, int tx, float (&p)[4][4], float (&ds)[4][4]) {
  float dp[4][4];
  tile_dots(Qs, Ks, Dh, SD, ty, tx, p);
  tile_dots(dOs, Vs, Dh, SD, ty, tx, dp);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = tx + 16 * j;
      const bool real = r < mq && c < mk;
      const float pv = real ? expf(scale * p[i][j] - ls[r]) : 0.f;
      p[i][j] = pv;
      ds[i][j] = real ? pv * (dp[i][j] - dl[r]) : 0.f;
    }
  }
}

// lse and Δ of rows [r, r + m) of head h into ls, dl (rows >= m zero).
__device__ __forceinline__ void load_rows(float* ls, float* dl, const float* lse, const float* delta, int64_t r,
                                          int m, int H, int h) {
  if (threadIdx.x < kB) {
    const int i = threadIdx.x;
    ls[i] = i < m ? lse[(r + i) * H + h] : 0.f;
    dl[i] = i < m ? delta[(r + i) * H + h] : 0.f;
  }
}

template <int NJ>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                        const bf16* k, const bf16* v, const bf16* dout,
                                                        const float* lse, const float* delta, bf16* dk, bf16* dv,
                                                        int H, int Dh, int64_t ld, int64_t ldo, float scale) {
  extern __shared__ float smem[];
  const int SD = Dh + 1;
  float* Ks = smem;
  float* Vs = Ks + kB * SD;
  float* Qs = Vs + kB * SD;
  float* dOs = Qs + kB * SD;
  float* Ps = dOs + kB * SD;  // [kB query, kPS]
  float* dSs = Ps + kB * kPS;
  float* ls = dSs + kB * kPS;
  float* dl = ls + kB;

  const int h = blockIdx.y, tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mk = min(kB, T - tl.r0);
  const int64_t k0 = tl.start + tl.r0, col = int64_t(h) * Dh;

  load_tile(Ks, k + col, ld, k0, mk, Dh, SD);
  load_tile(Vs, v + col, ld, k0, mk, Dh, SD);
  float adk[4][NJ], adv[4][NJ];  // rows: keys ty + 16i
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) adk[i][j] = 0.f, adv[i][j] = 0.f;

  for (int r0 = 0; r0 < T; r0 += kB) {
    const int mq = min(kB, T - r0);
    const int64_t qa = tl.start + r0;
    __syncthreads();  // the previous query tile is no longer read
    load_tile(Qs, q + col, ld, qa, mq, Dh, SD);
    load_tile(dOs, dout + col, ldo, qa, mq, Dh, SD);
    load_rows(ls, dl, lse, delta, qa, mq, H, h);
    __syncthreads();
    float p[4][4], ds[4][4];
    p_ds(Qs, dOs, Ks, Vs, ls, dl, mq, mk, Dh, SD, scale, ty, tx, p, ds);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        Ps[(ty + 16 * i) * kPS + tx + 16 * j] = p[i][j];
        dSs[(ty + 16 * i) * kPS + tx + 16 * j] = ds[i][j];
      }
    __syncthreads();
    // dv[key] += Σ_q P[q][key] do[q];  dk[key] += Σ_q dS[q][key] q[q]  (scale applied at the end)
    for (int qq = 0; qq < mq; ++qq) {
      float pv[4], dsv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[i] = Ps[qq * kPS + ty + 16 * i], dsv[i] = dSs[qq * kPS + ty + 16 * i];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = tx + 16 * j;
        const float dov = d < Dh ? dOs[qq * SD + d] : 0.f, qv = d < Dh ? Qs[qq * SD + d] : 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          adv[i][j] = fmaf(pv[i], dov, adv[i][j]);
          adk[i][j] = fmaf(dsv[i], qv, adk[i][j]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= mk) continue;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = tx + 16 * j;
      if (d >= Dh) continue;
      dk[(k0 + r) * ld + col + d] = __float2bfloat16_rn(scale * adk[i][j]);
      dv[(k0 + r) * ld + col + d] = __float2bfloat16_rn(adv[i][j]);
    }
  }
}

template <int NJ>
__global__ void __launch_bounds__(kThreads) dq_kernel(const __grid_constant__ MediaTable mt, const bf16* q,
                                                      const bf16* k, const bf16* v, const bf16* dout,
                                                      const float* lse, const float* delta, bf16* dq, int H, int Dh,
                                                      int64_t ld, int64_t ldo, float scale) {
  extern __shared__ float smem[];
  const int SD = Dh + 1;
  float* Qs = smem;
  float* dOs = Qs + kB * SD;
  float* Ks = dOs + kB * SD;
  float* Vs = Ks + kB * SD;
  float* dSs = Vs + kB * SD;  // [kB query, kPS]
  float* ls = dSs + kB * kPS;
  float* dl = ls + kB;

  const int h = blockIdx.y, tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const TileOf tl = tile_of(mt, int32_t(blockIdx.x));
  const int T = tl.T, mq = min(kB, T - tl.r0);
  const int64_t qa = tl.start + tl.r0, col = int64_t(h) * Dh;

  load_tile(Qs, q + col, ld, qa, mq, Dh, SD);
  load_tile(dOs, dout + col, ldo, qa, mq, Dh, SD);
  load_rows(ls, dl, lse, delta, qa, mq, H, h);
  float adq[4][NJ];  // rows: queries ty + 16i
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j) adq[i][j] = 0.f;

  for (int k0 = 0; k0 < T; k0 += kB) {
    const int mk = min(kB, T - k0);
    __syncthreads();  // the previous key tile is no longer read
    load_tile(Ks, k + col, ld, tl.start + k0, mk, Dh, SD);
    load_tile(Vs, v + col, ld, tl.start + k0, mk, Dh, SD);
    __syncthreads();
    float p[4][4], ds[4][4];
    p_ds(Qs, dOs, Ks, Vs, ls, dl, mq, mk, Dh, SD, scale, ty, tx, p, ds);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) dSs[(ty + 16 * i) * kPS + tx + 16 * j] = ds[i][j];
    __syncthreads();
    // dq[query] += Σ_key dS[query][key] k[key]  (scale applied at the end)
    for (int kk = 0; kk < mk; ++kk) {
      float dsv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) dsv[i] = dSs[(ty + 16 * i) * kPS + kk];
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int d = tx + 16 * j;
        const float kv = d < Dh ? Ks[kk * SD + d] : 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) adq[i][j] = fmaf(dsv[i], kv, adq[i][j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= mq) continue;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int d = tx + 16 * j;
      if (d < Dh) dq[(qa + r) * ld + col + d] = __float2bfloat16_rn(scale * adq[i][j]);
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------------

size_t fwd_smem(int Dh) { return sizeof(float) * (size_t(3) * kB * (Dh + 1) + size_t(kB) * kPS + 3 * kB); }
size_t dkdv_smem(int Dh) { return sizeof(float) * (size_t(4) * kB * (Dh + 1) + size_t(2) * kB * kPS + 2 * kB); }
size_t dq_smem(int Dh) { return sizeof(float) * (size_t(4) * kB * (Dh + 1) + size_t(kB) * kPS + 2 * kB); }

struct Checked {
  int H, Dh;
  int64_t ld, ldo, rows;
  float scale;
};

Checked check_shape(const char* who, const FullAttnShape& s) {
  const std::string w(who);
  if (s.H < 1 || s.H > 65535) check.fail(w + ": need 1 <= H <= 65535, got H=" + std::to_string(s.H));
  if (s.Dh < 8 || s.Dh > 128 || s.Dh % 8 != 0)
    check.fail(w + ": head dim Dh=" + std::to_string(s.Dh) + " unsupported (a multiple of 8 up to 128)");
  if (!s.cu_seqlens || s.N < 1) check.fail(w + ": cu_seqlens with N >= 1 media is required");
  if (s.cu_seqlens[0] != 0) check.fail(w + ": cu_seqlens must start at 0");
  for (int64_t n = 0; n < s.N; ++n)
    if (s.cu_seqlens[n + 1] < s.cu_seqlens[n])
      check.fail(w + ": cu_seqlens must not decrease (entry " + std::to_string(n + 1) + ")");
  const int64_t rows = s.cu_seqlens[s.N];
  if (rows > std::numeric_limits<int32_t>::max() - kB)
    check.fail(w + ": " + std::to_string(rows) + " rows exceed the kernels' 32-bit row offsets");
  const int64_t HD = s.H * s.Dh, ld = s.ld_qkv ? s.ld_qkv : HD, ldo = s.ld_o ? s.ld_o : HD;
  if (ld < HD || ldo < HD)
    check.fail(w + ": row strides " + std::to_string(ld) + " / " + std::to_string(ldo) + " < H·Dh = " +
               std::to_string(HD));
  if (!(s.scale >= 0.f) || !std::isfinite(s.scale)) check.fail(w + ": scale must be finite and >= 0 (0: Dh^-1/2)");
  const float scale = s.scale > 0.f ? s.scale : float(1.0 / std::sqrt(double(s.Dh)));
  return Checked{int(s.H), int(s.Dh), ld, ldo, rows, scale};
}

// The tables of media [n0, n0 + kMaxMedia): fills t, returns its tile count.
int32_t table_of(const FullAttnShape& s, int64_t n0, MediaTable& t) {
  const int64_t n1 = std::min<int64_t>(s.N, n0 + kMaxMedia);
  t.n = int32_t(n1 - n0);
  int32_t tiles = 0;
  for (int64_t n = n0; n <= n1; ++n) {
    const int64_t i = n - n0;
    t.row0[i] = int32_t(s.cu_seqlens[n]);
    t.tile0[i] = tiles;
    if (n < n1) tiles += int32_t((s.cu_seqlens[n + 1] - s.cu_seqlens[n] + kB - 1) / kB);
  }
  return tiles;
}

// Run f(table, tiles) for each launch's media (one launch unless more than kMaxMedia media).
template <class Fn>
void for_each_launch(const FullAttnShape& s, Fn&& f) {
  MediaTable t;
  for (int64_t n0 = 0; n0 < s.N; n0 += kMaxMedia) {
    const int32_t tiles = table_of(s, n0, t);
    if (tiles > 0) f(t, tiles);
  }
}

template <class K>
void allow_smem(K kernel, size_t bytes, const char* what) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), what);
}

template <int NJ>
void forward_nj(const Checked& c, const FullAttnShape& s, const bf16* q, const bf16* k, const bf16* v, bf16* o,
                float* lse, cudaStream_t st) {
  const size_t sm = fwd_smem(c.Dh);
  allow_smem(fwd_kernel<NJ>, sm, "full_attention_forward smem");
  for_each_launch(s, [&](const MediaTable& t, int32_t tiles) {
    fwd_kernel<NJ><<<dim3(unsigned(tiles), unsigned(c.H)), kThreads, sm, st>>>(t, q, k, v, o, lse, c.H, c.Dh, c.ld,
                                                                              c.ldo, c.scale);
    check(cudaGetLastError(), "full_attention_forward launch");
  });
}

template <int NJ>
void backward_nj(const Checked& c, const FullAttnShape& s, const bf16* q, const bf16* k, const bf16* v,
                 const bf16* dout, const float* lse, const float* delta, bf16* dq, bf16* dk, bf16* dv,
                 cudaStream_t st) {
  const size_t smkv = dkdv_smem(c.Dh), smq = dq_smem(c.Dh);
  allow_smem(dkdv_kernel<NJ>, smkv, "full_attention_backward dk/dv smem");
  allow_smem(dq_kernel<NJ>, smq, "full_attention_backward dq smem");
  for_each_launch(s, [&](const MediaTable& t, int32_t tiles) {
    const dim3 grid(unsigned(tiles), unsigned(c.H));
    dkdv_kernel<NJ><<<grid, kThreads, smkv, st>>>(t, q, k, v, dout, lse, delta, dk, dv, c.H, c.Dh, c.ld, c.ldo,
                                                  c.scale);
    check(cudaGetLastError(), "full_attention_backward dk/dv launch");
    dq_kernel<NJ><<<grid, kThreads, smq, st>>>(t, q, k, v, dout, lse, delta, dq, c.H, c.Dh, c.ld, c.ldo, c.scale);
    check(cudaGetLastError(), "full_attention_backward dq launch");
  });
}

// The tensor-core kernels load rows with 16-byte cp.async: strides in multiples of 8 elements, aligned pointers.
bool tc_ok(const Checked& c) { return c.ld % 8 == 0 && c.ldo % 8 == 0; }
bool aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

#define LM_NJ_SWITCH(nj, CALL)                                  \
  switch (nj) {                                                 \
    case 1: CALL(1); break;                                     \
    case 2: CALL(2); break;                                     \
    case 3: CALL(3); break;                                     \
    case 4: CALL(4); break;                                     \
    case 5: CALL(5); break;                                     \
    case 6: CALL(6); break;                                     \
    case 7: CALL(7); break;                                     \
    default: CALL(8); break;                                    \
  }

}  // namespace

void full_attention_forward(const FullAttnShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                            void* stream) {
  const Checked c = check_shape("full_attention_forward", s);
  if (c.rows == 0) return;
  if (!q || !k || !v || !o || !lse) check.fail("full_attention_forward: null argument");
  const auto st = lm::cu::stream(stream);
  const auto* Q = static_cast<const bf16*>(q);
  const auto* K = static_cast<const bf16*>(k);
  const auto* V = static_cast<const bf16*>(v);
  auto* O = static_cast<bf16*>(o);
  if (!s.cuda_cores && tc_ok(c) && aligned16({q, k, v, o})) {
    const fa::TcArgs a{c.H, c.Dh, c.ld, c.ldo, c.scale};
    for_each_launch(s, [&](const MediaTable& t, int32_t tiles) { fa::tc_forward(t, tiles, a, Q, K, V, O, lse, st); });
    return;
  }
#define LM_FWD(NJ) forward_nj<NJ>(c, s, Q, K, V, O, lse, st)
  LM_NJ_SWITCH((c.Dh + 15) / 16, LM_FWD)
#undef LM_FWD
}

void full_attention_backward(const FullAttnShape& s, const void* q, const void* k, const void* v, const void* o,
                             const float* lse, const void* do_, void* dq, void* dk, void* dv, void* stream) {
  const Checked c = check_shape("full_attention_backward", s);
  if (c.rows == 0) return;
  if (!q || !k || !v || !o || !lse || !do_ || !dq || !dk || !dv) check.fail("full_attention_backward: null argument");
  const auto st = lm::cu::stream(stream);
  const auto* O = static_cast<const bf16*>(o);
  const auto* dO = static_cast<const bf16*>(do_);
  float* delta = nullptr;
  check(cu::malloc_async(&delta, size_t(c.rows) * c.H * sizeof(float), st), "delta alloc");
  const int64_t items = c.rows * c.H;
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>((items + 7) / 8, 132 * 32)));  // 8 warps a block
  delta_kernel<<<grid, kThreads, 0, st>>>(O, dO, delta, c.rows, c.H, c.Dh, c.ldo);
  check(cudaGetLastError(), "full_attention_backward delta launch");
  const auto* Q = static_cast<const bf16*>(q);
  const auto* K = static_cast<const bf16*>(k);
  const auto* V = static_cast<const bf16*>(v);
  auto* dQ = static_cast<bf16*>(dq);
  auto* dK = static_cast<bf16*>(dk);
  auto* dV = static_cast<bf16*>(dv);
  if (!s.cuda_cores && tc_ok(c) && aligned16({q, k, v, do_, dq, dk, dv})) {
    const fa::TcArgs a{c.H, c.Dh, c.ld, c.ldo, c.scale};
    for_each_launch(s, [&](const MediaTable& t, int32_t tiles) {
      fa::tc_backward(t, tiles, a, Q, K, V, dO, lse, delta, dQ, dK, dV, st);
    });
  } else {
#define LM_BWD(NJ) backward_nj<NJ>(c, s, Q, K, V, dO, lse, delta, dQ, dK, dV, st)
    LM_NJ_SWITCH((c.Dh + 15) / 16, LM_BWD)
#undef LM_BWD
  }
  check(cudaFreeAsync(delta, st), "delta free");
}

}  // namespace lm::ops::cuda

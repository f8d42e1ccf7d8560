// Depthwise causal short convolution + SiLU of the KDA mixer on the GPU (kda::short_conv_* on the CPU).
//
// Legend: rows = B·T packed tokens, C channels, W taps (<= 8), N sequences (B, or varlen cu_seqlens),
//         TT tokens per thread, VEC channels per thread (4 when C % 4 == 0, else 1).
//         x, dx bf16 [rows, C] with row stride ldx (>= C: a column block of a wider matrix), y, dy bf16 [rows, C];
//         w fp32 [C, W]; dw fp32 [C, W] (+=); partial fp32 [P, C, W] scratch; cache fp32 [C, W−1] (inference:
//         the W−1 inputs before the chunk, oldest first).
//   pre[t, c] = Σ_k w[c, k] · x[t − (W−1) + k, c] (zero before the sequence start), y = silu(pre)
//   dpre = dy · silu'(pre);  dx[τ] = Σ_k w[k] · dpre[τ + (W−1) − k] (same sequence);  dw[k] = Σ_t dpre[t] · x[t − (W−1) + k]
// Each thread walks TT consecutive tokens of VEC channels with the last W inputs in a register ring, so every
// x is read ~once; inside one sequence it issues the loads of kU (backward kUB) tokens at once.
// Backward: the thread recomputes dpre for W−1 tokens past its range (dx needs the future
// taps) and scatters w[k]·dpre[t] into a ring of pending dx rows; a row is final once the stream has moved
// W−1 past it. dw: per-thread sums, reduced over the block's threads in a fixed order into one partial per
// grid row P, then the P partials summed in order per (c, k): deterministic, no atomics.
// Sequences: a thread finds its sequence by binary search over cu_seqlens (copied to the device) and
// re-searches when it crosses a boundary, zeroing the input ring (the new sequence starts from zeros).
// Chunked prefill (short_conv_forward_cached): the forward kernel over one sequence, the ring of its first
// thread seeded from the cache instead of zeros; short_conv_cache_append then moves the cache on (a second
// launch: the forward's first thread must read the old cache before anything overwrites it).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/stream.hpp"
#include "ops/kda/cuda/short_conv_cuda.hpp"

namespace lm::kda::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"short conv cuda"};

constexpr int kTT = 32;     // tokens per thread
constexpr int kBX = 32;     // threads along channels
constexpr int kBY = 8;      // threads along time: a block covers kBX·VEC channels × kBY·kTT tokens
constexpr int kMaxW = 8;
constexpr int kU = 8;       // tokens whose loads are issued together (latency, not bandwidth, bounded these kernels)
constexpr int kUB = 4;      // the same in the backward (two inputs per token, and its rings: registers)

struct Seg {
  int64_t begin, end;
};

// The sequence holding row t (t < rows). Varlen: the last n with cu[n] <= t, so empty sequences are skipped.
__device__ __forceinline__ Seg seg_of(int64_t t, int64_t T, const int64_t* cu, int N) {
  if (!cu) {
    const int64_t b = t - t % T;
    return {b, b + T};
  }
  int lo = 0, hi = N;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  return {cu[lo], cu[lo + 1]};
}

template <int VEC>
__device__ __forceinline__ void load_vec(const bf16* p, float* f) {
  if constexpr (VEC == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else {
    f[0] = __bfloat162float(p[0]);
  }
}
template <int VEC>
__device__ __forceinline__ void store_vec(bf16* p, const float* f) {
  if constexpr (VEC == 4) {
    uint2 u;
    *reinterpret_cast<__nv_bfloat162*>(&u.x) = __floats2bfloat162_rn(f[0], f[1]);
    *reinterpret_cast<__nv_bfloat162*>(&u.y) = __floats2bfloat162_rn(f[2], f[3]);
    *reinterpret_cast<uint2*>(p) = u;
  } else {
    p[0] = __float2bfloat16_rn(f[0]);
  }
}

__device__ __forceinline__ float sigmoidf_(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }  // MUFU reciprocal

// Ring xr[k] = inputs at t − (W−1) + k; fills slots 0..W−2 for a walk starting at t0 in sequence sg.
// Positions before the sequence start read cache [C, W−1] (the W−1 inputs before it, oldest first: position
// sg.begin − (W−1) + j is slot j), or are zeros without one (null).
template <int W, int VEC>
__device__ __forceinline__ void preload(const bf16* x, int64_t ldx, int c0, int64_t t0, const Seg& sg,
                                        float (&xr)[W][VEC], const float* cache = nullptr) {
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int64_t p = t0 - (W - 1) + k;
    if (p >= sg.begin) {
      load_vec<VEC>(x + p * ldx + c0, xr[k]);
    } else if (cache) {
      const int64_t j = (W - 1) + (p - sg.begin);  // in [0, W−1): p >= t0 − (W−1) >= sg.begin − (W−1)
#pragma unroll
      for (int v = 0; v < VEC; ++v) xr[k][v] = cache[int64_t(c0 + v) * (W - 1) + j];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) xr[k][v] = 0.f;
    }
  }
}

// cache (nullable; only with one sequence, rows == T): [C, W−1], the inputs before row 0.
template <int W, int VEC>
__global__ void __launch_bounds__(kBX* kBY) conv_fwd_kernel(const bf16* x, const float* w, bf16* y, int64_t rows,
                                                              int C, int64_t ldx, int64_t T, const int64_t* cu, int N,
                                                              int silu, const float* cache) {
  const int c0 = (blockIdx.x * kBX + threadIdx.x) * VEC;
  if (c0 >= C) return;
  float wr[VEC][W];
#pragma unroll
  for (int v = 0; v < VEC; ++v)
#pragma unroll
    for (int k = 0; k < W; ++k) wr[v][k] = w[int64_t(c0 + v) * W + k];
  const int64_t nby = (rows + kBY * kTT - 1) / (kBY * kTT);
  for (int64_t by = blockIdx.y; by < nby; by += gridDim.y) {
    const int64_t t0 = (by * kBY + threadIdx.y) * kTT;
    if (t0 >= rows) continue;
    const int64_t t1 = min(t0 + kTT, rows);
    Seg sg = seg_of(t0, T, cu, N);
    float xr[W][VEC];
    preload<W, VEC>(x, ldx, c0, t0, sg, xr, cache);
    // One token with its input in xr[W-1]: output, then the ring moves on.
    auto step = [&](int64_t t) {
      float out[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        float pre = 0.f;
#pragma unroll
        for (int k = 0; k < W; ++k) pre = fmaf(wr[v][k], xr[k][v], pre);
        out[v] = silu ? pre * sigmoidf_(pre) : pre;
      }
      store_vec<VEC>(y + t * C + c0, out);
#pragma unroll
      for (int k = 0; k < W - 1; ++k)
#pragma unroll
        for (int v = 0; v < VEC; ++v) xr[k][v] = xr[k + 1][v];
    };
    for (int64_t t = t0; t < t1;) {
      if (t + kU <= t1 && t + kU <= sg.end) {  // kU tokens of one sequence: their loads in flight together
        float xn[kU][VEC];
#pragma unroll
        for (int u = 0; u < kU; ++u) load_vec<VEC>(x + (t + u) * ldx + c0, xn[u]);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) xr[W - 1][v] = xn[u][v];
          step(t + u);
        }
        t += kU;
        continue;
      }
      if (t >= sg.end) {  // a new sequence starts at t: everything in the ring is from earlier ones
        sg = seg_of(t, T, cu, N);
        preload<W, VEC>(x, ldx, c0, t, sg, xr);  // zeros (the ring's rows are before the sequence)
      }
      load_vec<VEC>(x + t * ldx + c0, xr[W - 1]);
      step(t);
      ++t;
    }
  }
}

// partial [gridDim.y, C, W]: this block row's dw sums (fixed order: per thread, then threadIdx.y ascending).
template <int W, int VEC>
__global__ void __launch_bounds__(kBX* kBY)
    conv_bwd_kernel(const bf16* x, const float* w, const bf16* dy, bf16* dx, float* partial, int64_t rows, int C,
                    int64_t ldx, int64_t T, const int64_t* cu, int N, int silu) {
  const int c0 = (blockIdx.x * kBX + threadIdx.x) * VEC;
  const bool active = c0 < C;
  float wr[VEC][W];
  float dwp[VEC][W];
#pragma unroll
  for (int v = 0; v < VEC; ++v)
#pragma unroll
    for (int k = 0; k < W; ++k) {
      wr[v][k] = active ? w[int64_t(c0 + v) * W + k] : 0.f;
      dwp[v][k] = 0.f;
    }
  const int64_t nby = (rows + kBY * kTT - 1) / (kBY * kTT);
  for (int64_t by = blockIdx.y; by < nby && active; by += gridDim.y) {
    const int64_t t0 = (by * kBY + threadIdx.y) * kTT;
    if (t0 >= rows) continue;
    const int64_t t1 = min(t0 + kTT, rows);           // rows whose dx this thread writes
    const int64_t tend = min(t1 + (W - 1), rows);      // dpre needed up to here
    Seg sg = seg_of(t0, T, cu, N);
    float xr[W][VEC], acc[W][VEC];  // acc[j]: pending dx of row t − (W−1) + j
    preload<W, VEC>(x, ldx, c0, t0, sg, xr);
#pragma unroll
    for (int k = 0; k < W; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[k][v] = 0.f;
    // One token with its input in xr[W-1] and dy in g.
    auto step = [&](int64_t t, float (&g)[VEC]) {
      if (silu) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          float pre = 0.f;
#pragma unroll
          for (int k = 0; k < W; ++k) pre = fmaf(wr[v][k], xr[k][v], pre);
          const float s = sigmoidf_(pre);
          g[v] *= s * (1.f + pre * (1.f - s));
        }
      }
      if (t < t1) {
#pragma unroll
        for (int v = 0; v < VEC; ++v)
#pragma unroll
          for (int k = 0; k < W; ++k) dwp[v][k] = fmaf(g[v], xr[k][v], dwp[v][k]);
      }
      // Row t − (W−1) + k receives w[k]·dpre[t] when it lies in t's sequence.
#pragma unroll
      for (int k = 0; k < W; ++k)
        if (t - (W - 1) + k >= sg.begin)
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[k][v] = fmaf(wr[v][k], g[v], acc[k][v]);
      if (t - (W - 1) >= t0) store_vec<VEC>(dx + (t - (W - 1)) * ldx + c0, acc[0]);
#pragma unroll
      for (int k = 0; k < W - 1; ++k)
#pragma unroll
        for (int v = 0; v < VEC; ++v) xr[k][v] = xr[k + 1][v], acc[k][v] = acc[k + 1][v];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[W - 1][v] = 0.f;
    };
    for (int64_t t = t0; t < tend;) {
      if (t + kUB <= tend && t + kUB <= sg.end) {  // kUB tokens of one sequence: their loads in flight together
        float xn[kUB][VEC], gn[kUB][VEC];
#pragma unroll
        for (int u = 0; u < kUB; ++u) {
          load_vec<VEC>(x + (t + u) * ldx + c0, xn[u]);
          load_vec<VEC>(dy + (t + u) * C + c0, gn[u]);
        }
#pragma unroll
        for (int u = 0; u < kUB; ++u) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) xr[W - 1][v] = xn[u][v];
          step(t + u, gn[u]);
        }
        t += kUB;
        continue;
      }
      if (t >= sg.end) {
        sg = seg_of(t, T, cu, N);
        preload<W, VEC>(x, ldx, c0, t, sg, xr);  // zeros, as in the forward
      }
      load_vec<VEC>(x + t * ldx + c0, xr[W - 1]);
      float g[VEC];
      load_vec<VEC>(dy + t * C + c0, g);
      step(t, g);
      ++t;
    }
    // The stream stopped at the last row (tend == rows): its final W−1 rows get no more contributions.
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
      const int64_t tau = tend - (W - 1) + j;
      if (tau >= t0 && tau < t1) store_vec<VEC>(dx + tau * ldx + c0, acc[j]);
    }
  }
  if (!partial) return;  // block-uniform: no dw wanted
  __shared__ float red[kBY][kBX][VEC * W + 1];  // +1: odd stride, no bank conflicts
#pragma unroll
  for (int v = 0; v < VEC; ++v)
#pragma unroll
    for (int k = 0; k < W; ++k) red[threadIdx.y][threadIdx.x][v * W + k] = dwp[v][k];
  __syncthreads();
  // Threads of row y == 0 sum the kBY rows in order and write the block's partial.
  if (threadIdx.y == 0 && active) {
    float* out = partial + (int64_t(blockIdx.y) * C + c0) * W;
    for (int e = 0; e < VEC * W; ++e) {
      float s = 0.f;
      for (int r = 0; r < kBY; ++r) s += red[r][threadIdx.x][e];
      out[e] = s;
    }
  }
}

// dw[e] += Σ_p partial[p, e] in p order (double), e over C·W.
__global__ void dw_reduce_kernel(const float* partial, float* dw, int P, int64_t CW) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < CW; e += int64_t(gridDim.x) * blockDim.x) {
    double s = 0;
    for (int p = 0; p < P; ++p) s += partial[int64_t(p) * CW + e];
    dw[e] += float(s);
  }
}

int64_t check_shape(const ConvShape& s, const char* who) {
  const std::string w(who);
  if (s.W < 1 || s.W > kMaxW) check.fail(w + ": W must be in [1, 8], got " + std::to_string(s.W));
  if (s.B < 1 || s.T < 0 || s.C < 1) check.fail(w + ": need B >= 1, T >= 0, C >= 1");
  if (s.C > (int64_t(1) << 30)) check.fail(w + ": C too large");
  if (s.ldx != 0 && s.ldx < s.C) check.fail(w + ": ldx must be 0 or >= C");
  if (s.cu_seqlens) {
    const int64_t* cu = s.cu_seqlens;
    if (s.B != 1) check.fail(w + ": varlen (cu_seqlens) needs B == 1");
    if (s.N < 1 || s.N > (int64_t(1) << 30)) check.fail(w + ": varlen needs N >= 1 sequences");
    if (cu[0] != 0) check.fail(w + ": cu_seqlens must start at 0");
    for (int64_t n = 0; n < s.N; ++n)
      if (cu[n + 1] < cu[n]) check.fail(w + ": cu_seqlens must be non-decreasing");
    if (cu[s.N] != s.T) check.fail(w + ": cu_seqlens must end at T");
  }
  return s.B * s.T;
}

bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }
int64_t ldx_of(const ConvShape& s) { return s.ldx ? s.ldx : s.C; }

// Device copy of the host cu_seqlens (null without varlen), freed by the caller with cudaFreeAsync.
int64_t* upload_cu(const ConvShape& s, cudaStream_t st) {
  if (!s.cu_seqlens) return nullptr;
  void* p = nullptr;
  const size_t bytes = size_t(s.N + 1) * sizeof(int64_t);
  check(cu::malloc_async(&p, bytes, st), "cu_seqlens alloc");
  // Pageable source: the call returns once the host array has been consumed.
  check(cudaMemcpyAsync(p, s.cu_seqlens, bytes, cudaMemcpyHostToDevice, st), "cu_seqlens copy");
  return static_cast<int64_t*>(p);
}

dim3 grid_of(int64_t rows, int64_t C, int vec) {
  const int64_t gx = (C / vec + kBX - 1) / kBX;
  const int64_t gy = std::min<int64_t>((rows + kBY * kTT - 1) / (kBY * kTT), 65535);
  return dim3(unsigned(gx), unsigned(gy));
}

template <int W, int VEC>
void launch_fwd(const bf16* x, const float* w, bf16* y, int64_t rows, const ConvShape& s, const int64_t* cu, bool silu,
                const float* cache, cudaStream_t st) {
  conv_fwd_kernel<W, VEC><<<grid_of(rows, s.C, VEC), dim3(kBX, kBY), 0, st>>>(x, w, y, rows, int(s.C), ldx_of(s),
                                                                              s.T, cu, int(s.N), silu, cache);
}

template <int W, int VEC>
void launch_bwd(const bf16* x, const float* w, const bf16* dy, bf16* dx, float* partial, int64_t rows,
                const ConvShape& s, const int64_t* cu, bool silu, cudaStream_t st) {
  conv_bwd_kernel<W, VEC><<<grid_of(rows, s.C, VEC), dim3(kBX, kBY), 0, st>>>(x, w, dy, dx, partial, rows, int(s.C),
                                                                              ldx_of(s), s.T, cu, int(s.N), silu);
}

// Calls FN<W, VEC>(args...) for the runtime W (1..8) and VEC (1 or 4).
#define LM_CONV_DISPATCH(FN, W_, VEC_, ...)                          \
  do {                                                               \
    switch (W_ * 16 + VEC_) {                                        \
      case 1 * 16 + 1: FN<1, 1>(__VA_ARGS__); break;                 \
      case 2 * 16 + 1: FN<2, 1>(__VA_ARGS__); break;                 \
      case 3 * 16 + 1: FN<3, 1>(__VA_ARGS__); break;                 \
      case 4 * 16 + 1: FN<4, 1>(__VA_ARGS__); break;                 \
      case 5 * 16 + 1: FN<5, 1>(__VA_ARGS__); break;                 \
      case 6 * 16 + 1: FN<6, 1>(__VA_ARGS__); break;                 \
      case 7 * 16 + 1: FN<7, 1>(__VA_ARGS__); break;                 \
      case 8 * 16 + 1: FN<8, 1>(__VA_ARGS__); break;                 \
      case 1 * 16 + 4: FN<1, 4>(__VA_ARGS__); break;                 \
      case 2 * 16 + 4: FN<2, 4>(__VA_ARGS__); break;                 \
      case 3 * 16 + 4: FN<3, 4>(__VA_ARGS__); break;                 \
      case 4 * 16 + 4: FN<4, 4>(__VA_ARGS__); break;                 \
      case 5 * 16 + 4: FN<5, 4>(__VA_ARGS__); break;                 \
      case 6 * 16 + 4: FN<6, 4>(__VA_ARGS__); break;                 \
      case 7 * 16 + 4: FN<7, 4>(__VA_ARGS__); break;                 \
      case 8 * 16 + 4: FN<8, 4>(__VA_ARGS__); break;                 \
      default: check.fail("unsupported W");                                \
    }                                                                \
  } while (0)

// Inference: one thread per (sequence, channel); the W−1 cached inputs and the new one, oldest first. The
// channels may form up to three segments of C (q, k, v of a KDA layer: one launch), segment j with its own
// weights w[j] and output y[j]; x's columns and the cache run on across the segments.
struct StepSegs {
  const float* w[3];
  bf16* y[3];
};
__global__ void conv_step_kernel(const bf16* x, int64_t ldx, const StepSegs g, int nseg, float* cache,
                                 int64_t cache_ld, int64_t S, int C, int W, int silu) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, CC = int64_t(nseg) * C;
  if (i >= S * CC) return;
  const int64_t s = i / CC;
  const int cc = int(i % CC), j = cc / C, c = cc % C;
  const float* w = g.w[j];
  float* h = cache + s * cache_ld + int64_t(cc) * (W - 1);
  const float xn = __bfloat162float(x[s * ldx + cc]);
  float pre = 0.f;
  for (int k = 0; k < W - 1; ++k) pre = fmaf(w[int64_t(c) * W + k], h[k], pre);
  pre = fmaf(w[int64_t(c) * W + W - 1], xn, pre);
  g.y[j][s * C + c] = __float2bfloat16(silu ? pre * sigmoidf_(pre) : pre);
  for (int k = 0; k + 1 < W - 1; ++k) h[k] = h[k + 1];
  if (W > 1) h[W - 2] = xn;
}
// One thread per channel, slots in increasing order: slot k reads the old slot k + n (> k, not yet written).
__global__ void conv_cache_append_kernel(const bf16* x, int64_t ldx, int64_t n, float* cache, int C, int W) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float* h = cache + c * (W - 1);
  for (int k = 0; k < W - 1; ++k) {
    const int64_t t = n - (W - 1) + k;  // chunk position of the input slot k holds afterwards
    h[k] = t >= 0 ? __bfloat162float(x[t * ldx + c]) : h[k + n];  // t < 0: k + n < W − 1
  }
}
__global__ void conv_cache_kernel(const bf16* x, int64_t ldx, int64_t n, float* cache, int C, int W) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(C) * (W - 1)) return;
  const int c = int(i / (W - 1)), k = int(i % (W - 1));
  const int64_t t = n - (W - 1) + k;
  cache[i] = t >= 0 ? __bfloat162float(x[t * ldx + c]) : 0.f;
}

}  // namespace

namespace {
void conv_step(const void* x, int64_t ldx, const StepSegs& g, int nseg, float* cache, int64_t cache_ld, int64_t S,
               int64_t C, int64_t W, bool silu, void* stream) {
  if (S == 0) return;
  if (!x || !cache) check.fail("short_conv_step: null argument");
  for (int j = 0; j < nseg; ++j)
    if (!g.w[j] || !g.y[j]) check.fail("short_conv_step: null argument");
  if (C < 1 || W < 1 || W > kMaxW || ldx < nseg * C || cache_ld < nseg * C * (W - 1))
    check.fail("short_conv_step: bad shape");
  const int64_t n = S * nseg * C;
  conv_step_kernel<<<unsigned((n + 255) / 256), 256, 0, lm::cu::stream(stream)>>>(
      static_cast<const bf16*>(x), ldx, g, nseg, cache, cache_ld, S, int(C), int(W), silu);
  check(cudaGetLastError(), "short_conv_step launch");
}
}  // namespace

void short_conv_step(const void* x, int64_t ldx, const float* w, float* cache, int64_t cache_ld, void* y, int64_t S,
                     int64_t C, int64_t W, bool silu, void* stream) {
  conv_step(x, ldx, StepSegs{{w}, {static_cast<bf16*>(y)}}, 1, cache, cache_ld, S, C, W, silu, stream);
}

void short_conv_step3(const void* x, int64_t ldx, const float* const w[3], float* cache, int64_t cache_ld,
                      void* const y[3], int64_t S, int64_t C, int64_t W, bool silu, void* stream) {
  const StepSegs g{{w[0], w[1], w[2]}, {static_cast<bf16*>(y[0]), static_cast<bf16*>(y[1]), static_cast<bf16*>(y[2])}};
  conv_step(x, ldx, g, 3, cache, cache_ld, S, C, W, silu, stream);
}

void short_conv_cache(const void* x, int64_t ldx, int64_t n, float* cache, int64_t C, int64_t W, void* stream) {
  if (W < 2) return;
  if (!x || !cache) check.fail("short_conv_cache: null argument");
  if (C < 1 || W > kMaxW || ldx < C || n < 0) check.fail("short_conv_cache: bad shape");
  const int64_t m = C * (W - 1);
  conv_cache_kernel<<<unsigned((m + 255) / 256), 256, 0, lm::cu::stream(stream)>>>(
      static_cast<const bf16*>(x), ldx, n, cache, int(C), int(W));
  check(cudaGetLastError(), "short_conv_cache launch");
}

void short_conv_cache_append(const void* x, int64_t ldx, int64_t n, float* cache, int64_t C, int64_t W,
                             void* stream) {
  if (n < 0 || C < 1 || W < 1 || W > kMaxW || ldx < C || C > (int64_t(1) << 30))
    check.fail("short_conv_cache_append: bad shape");
  if (W < 2 || n == 0) return;  // no cache, or nothing new
  if (!x || !cache) check.fail("short_conv_cache_append: null argument");
  conv_cache_append_kernel<<<unsigned((C + 255) / 256), 256, 0, lm::cu::stream(stream)>>>(
      static_cast<const bf16*>(x), ldx, n, cache, int(C), int(W));
  check(cudaGetLastError(), "short_conv_cache_append launch");
}

void short_conv_forward(const void* x, const float* w, void* y, const ConvShape& s, bool silu, void* stream) {
  const int64_t rows = check_shape(s, "short_conv_forward");
  if (rows == 0) return;
  if (!x || !w || !y) check.fail("short_conv_forward: null argument");
  if (x == y) check.fail("short_conv_forward: y must not alias x");
  const auto st = lm::cu::stream(stream);
  const int vec = (s.C % 4 == 0 && ldx_of(s) % 4 == 0 && aligned8(x) && aligned8(y)) ? 4 : 1;
  int64_t* cu = upload_cu(s, st);
  const int W = int(s.W);
  LM_CONV_DISPATCH(launch_fwd, W, vec, static_cast<const bf16*>(x), w, static_cast<bf16*>(y), rows, s, cu, silu,
                   nullptr, st);
  check(cudaGetLastError(), "short_conv_forward launch");
  if (cu) check(cudaFreeAsync(cu, st), "cu_seqlens free");
}

void short_conv_forward_cached(const void* x, int64_t ldx, const float* w, const float* cache, void* y, int64_t n,
                               int64_t C, int64_t W, bool silu, void* stream) {
  if (n < 0 || C < 1 || W < 1 || W > kMaxW || ldx < C || C > (int64_t(1) << 30))
    check.fail("short_conv_forward_cached: bad shape");
  if (n == 0) return;
  if (!x || !w || !y) check.fail("short_conv_forward_cached: null argument");
  if (x == y) check.fail("short_conv_forward_cached: y must not alias x");
  ConvShape s;  // one sequence of n tokens: the same kernel as short_conv_forward, its ring seeded from the cache
  s.B = 1, s.T = n, s.C = C, s.W = W, s.ldx = ldx;
  const auto st = lm::cu::stream(stream);
  const int vec = (C % 4 == 0 && ldx % 4 == 0 && aligned8(x) && aligned8(y)) ? 4 : 1;
  const int Wi = int(W);
  LM_CONV_DISPATCH(launch_fwd, Wi, vec, static_cast<const bf16*>(x), w, static_cast<bf16*>(y), n, s, nullptr, silu,
                   W > 1 ? cache : nullptr, st);
  check(cudaGetLastError(), "short_conv_forward_cached launch");
}

void short_conv_backward(const void* x, const float* w, const void* dy, void* dx, float* dw, const ConvShape& s,
                         bool silu, void* stream) {
  const int64_t rows = check_shape(s, "short_conv_backward");
  if (rows == 0) return;
  if (!x || !w || !dy || !dx) check.fail("short_conv_backward: null argument");
  if (dx == x) check.fail("short_conv_backward: dx must not alias x (it is re-read)");
  const auto st = lm::cu::stream(stream);
  const int vec = (s.C % 4 == 0 && ldx_of(s) % 4 == 0 && aligned8(x) && aligned8(dy) && aligned8(dx)) ? 4 : 1;
  const dim3 grid = grid_of(rows, s.C, vec);
  const int64_t CW = s.C * s.W;
  int64_t* cu = upload_cu(s, st);
  float* partial = nullptr;
  if (dw) check(cu::malloc_async(&partial, size_t(grid.y) * CW * sizeof(float), st),
                "dw partial alloc");
  const int W = int(s.W);
  LM_CONV_DISPATCH(launch_bwd, W, vec, static_cast<const bf16*>(x), w, static_cast<const bf16*>(dy),
                   static_cast<bf16*>(dx), partial, rows, s, cu, silu, st);
  check(cudaGetLastError(), "short_conv_backward launch");
  if (dw) {
    const int threads = 256;
    const int blocks = int(std::min<int64_t>((CW + threads - 1) / threads, 4096));
    dw_reduce_kernel<<<blocks, threads, 0, st>>>(partial, dw, int(grid.y), CW);
    check(cudaGetLastError(), "short_conv dw reduce launch");
    check(cudaFreeAsync(partial, st), "dw partial free");
  }
  if (cu) check(cudaFreeAsync(cu, st), "cu_seqlens free");
}

}  // namespace lm::kda::cuda

// LM head + cross-entropy on the GPU, one token block at a time (ops/cross_entropy/cross_entropy.hpp is the
// CPU definition; this is its Blas-mode schedule with the whole vocabulary as one chunk).
//
// Legend: T tokens, d hidden, V vocabulary, Bt token block, nt rows of the current block, ld = V rounded up
//         to 8 (row stride of the scratch blocks: 16-byte aligned rows for the row kernel and cuBLAS).
//         h bf16 [T, d]; W bf16 [V, d]; targets int32 [T] (device; < 0 ignored); dh fp32 [T, d];
//         dW fp32 [V, d] (+=); scratch: logits fp32 [Bt, ld], G bf16 [Bt, ld], loss fp32 [T].
// Per block: logits = h_b Wᵀ (cuBLAS, fp32 out); one CTA per row finds max and Σ exp in one online pass
//   (running max, sum rescaled when it grows), lse = max + log Σ, loss = lse − logit[target], and writes
//   G = grad_scale · (softmax − onehot) in bf16 (zero rows for ignored tokens); then dh_b = G W (fp32, β 0)
//   and dW += Gᵀ h_b (fp32, β 1).  FLOPs 6 T V d.
// The per-token losses are summed at the end by one CTA in double in a fixed order (deterministic), and the
// result is the only host synchronisation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/stream.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"cross entropy cuda"};

constexpr int kRowThreads = 512;
constexpr int kSumThreads = 1024;
constexpr int64_t kLogitsBytes = int64_t(256) << 20;  // target size of the fp32 logits block

// (max, Σ exp(x − max)) pairs, merged exactly: the smaller max's sum is rescaled.
struct MS {
  float m, s;
};
__device__ __forceinline__ MS merge(MS a, MS b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}
// Fold x0..x3 into the running pair: rescale once when their max exceeds the running max.
__device__ __forceinline__ void fold4(MS& a, float x0, float x1, float x2, float x3) {
  const float mx = fmaxf(fmaxf(x0, x1), fmaxf(x2, x3));
  if (mx > a.m) {
    a.s *= __expf(a.m - mx);  // a.m = −inf at the start: a.s = 0 · 0
    a.m = mx;
  }
  a.s += __expf(x0 - a.m) + __expf(x1 - a.m) + __expf(x2 - a.m) + __expf(x3 - a.m);
}
__device__ __forceinline__ void fold1(MS& a, float x) {
  if (x > a.m) {
    a.s *= __expf(a.m - x);
    a.m = x;
  }
  a.s += __expf(x - a.m);
}

// Block-wide merge in a fixed tree (shuffles, then warp 0 over the warp results); every thread gets it.
__device__ MS block_merge(MS v) {
  __shared__ MS warp_res[kRowThreads / 32];
  __shared__ MS total;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const MS o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
    v = merge(v, o);
  }
  if (lane == 0) warp_res[wid] = v;
  __syncthreads();
  if (wid == 0) {
    constexpr int nw = kRowThreads / 32;
    MS w = lane < nw ? warp_res[lane] : MS{-INFINITY, 0.f};
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const MS o{__shfl_xor_sync(0xffffffffu, w.m, off), __shfl_xor_sync(0xffffffffu, w.s, off)};
      w = merge(w, o);
    }
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

// One CTA per row of the block. loss[row] = lse − logit[target] (0 when ignored, NaN for a target >= V,
// which the caller rules out). GRAD: G row = scale · (softmax − onehot), zeros when ignored, with scale =
// grad_scale, times row_scale[row] when given.
template <bool GRAD>
__global__ void __launch_bounds__(kRowThreads)
    ce_row_kernel(const float* logits, bf16* G, int64_t ld, int V, const int* targets, float grad_scale,
                  const float* row_scale, float* loss) {
  const int64_t row = blockIdx.x;
  const int target = targets[row];
  const float scale = row_scale ? grad_scale * row_scale[row] : grad_scale;
  const float* L = logits + row * ld;
  const int V4 = V & ~3;
  if (target < 0) {  // ignored: no loss, zero gradient row (block-uniform branch)
    if (GRAD) {
      bf16* g = G + row * ld;
      for (int c = threadIdx.x * 4; c < V4; c += kRowThreads * 4) *reinterpret_cast<uint2*>(g + c) = make_uint2(0u, 0u);
      for (int c = V4 + threadIdx.x; c < V; c += kRowThreads) g[c] = __float2bfloat16_rn(0.f);
    }
    if (threadIdx.x == 0) loss[row] = 0.f;
    return;
  }
  MS a{-INFINITY, 0.f};
  for (int c = threadIdx.x * 4; c < V4; c += kRowThreads * 4) {
    const float4 x = *reinterpret_cast<const float4*>(L + c);
    fold4(a, x.x, x.y, x.z, x.w);
  }
  for (int c = V4 + threadIdx.x; c < V; c += kRowThreads) fold1(a, L[c]);
  const MS tot = block_merge(a);
  const float lse = tot.m + logf(tot.s);
  if (threadIdx.x == 0) loss[row] = target < V ? lse - L[target] : NAN;
  if (!GRAD) return;
  bf16* g = G + row * ld;
  for (int c = threadIdx.x * 4; c < V4; c += kRowThreads * 4) {
    const float4 x = *reinterpret_cast<const float4*>(L + c);
    float v[4] = {scale * __expf(x.x - lse), scale * __expf(x.y - lse), scale * __expf(x.z - lse),
                  scale * __expf(x.w - lse)};
    if (target >= c && target < c + 4) v[target - c] -= scale;
    uint2 u;
    *reinterpret_cast<__nv_bfloat162*>(&u.x) = __floats2bfloat162_rn(v[0], v[1]);
    *reinterpret_cast<__nv_bfloat162*>(&u.y) = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(g + c) = u;
  }
  for (int c = V4 + threadIdx.x; c < V; c += kRowThreads) {
    float v = scale * __expf(L[c] - lse);
    if (c == target) v -= scale;
    g[c] = __float2bfloat16_rn(v);
  }
}

struct Sums {
  double loss;
  long long valid;
};

// out = (Σ_t loss[t], #{t: target >= 0}) by one CTA: strided per-thread sums, then a fixed shared-memory tree.
__global__ void __launch_bounds__(kSumThreads) ce_sum_kernel(const float* loss, const int* targets, int64_t T, Sums* out) {
  __shared__ double sl[kSumThreads];
  __shared__ long long sv[kSumThreads];
  double l = 0;
  long long v = 0;
  for (int64_t t = threadIdx.x; t < T; t += kSumThreads) {
    l += double(loss[t]);
    v += targets[t] >= 0;
  }
  sl[threadIdx.x] = l;
  sv[threadIdx.x] = v;
  __syncthreads();
  for (int w = kSumThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) {
      sl[threadIdx.x] += sl[threadIdx.x + w];
      sv[threadIdx.x] += sv[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = Sums{sl[0], sv[0]};
}

CeResult run(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d, int64_t V, float grad_scale,
             const float* row_scale, float* dh, float* dW, float* row_loss, int64_t token_block, void* stream,
             bool grad) {
  const char* who = grad ? "forward_backward" : "forward";
  if (T < 0 || d <= 0 || V <= 0) check.fail(std::string(who) + ": need T >= 0, d > 0, V > 0");
  if (V > INT32_MAX || d > INT32_MAX) check.fail(std::string(who) + ": V and d must fit int32");
  if (token_block < 0) check.fail(std::string(who) + ": token_block must be >= 0");
  if (T == 0) return CeResult{};
  if (!h || !W || !targets || (grad && !dh)) check.fail(std::string(who) + ": null argument");
  const auto s = lm::cu::stream(stream);
  const int64_t ld = (V + 7) / 8 * 8;
  int64_t Bt = token_block;
  if (Bt == 0) {
    Bt = std::max<int64_t>(1, kLogitsBytes / (ld * 4));
    if (Bt >= 64) Bt = Bt / 64 * 64;  // whole GEMM tiles
  }
  Bt = std::min(Bt, T);
  if (Bt > INT32_MAX) check.fail(std::string(who) + ": token block too large");

  // One allocation: logits [Bt, ld] fp32 | G [Bt, ld] bf16 | loss [T] fp32 | Sums.
  const size_t logits_b = size_t(Bt * ld) * 4, g_b = grad ? size_t(Bt * ld) * 2 : 0;
  const size_t loss_off = logits_b + (g_b + 255) / 256 * 256;
  const size_t sums_off = loss_off + (size_t(T) * 4 + 255) / 256 * 256;
  void* base = nullptr;
  check(cu::malloc_async(&base, sums_off + sizeof(Sums), s), "scratch alloc");
  char* b = static_cast<char*>(base);
  auto* logits = reinterpret_cast<float*>(b);
  auto* G = reinterpret_cast<bf16*>(b + logits_b);
  auto* loss = reinterpret_cast<float*>(b + loss_off);
  auto* sums = reinterpret_cast<Sums*>(b + sums_off);

  const auto* hb = static_cast<const bf16*>(h);
  try {
    for (int64_t ts = 0; ts < T; ts += Bt) {
      const int64_t nt = std::min(Bt, T - ts);
      gemm_bf16(false, true, nt, V, d, 1.f, hb + ts * d, d, W, d, 0.f, logits, ld, DType::F32, stream);
      if (grad) {
        ce_row_kernel<true><<<unsigned(nt), kRowThreads, 0, s>>>(logits, G, ld, int(V), targets + ts, grad_scale,
                                                                  row_scale ? row_scale + ts : nullptr, loss + ts);
        check(cudaGetLastError(), "row kernel launch");
        gemm_bf16(false, false, nt, d, V, 1.f, G, ld, W, d, 0.f, dh + ts * d, d, DType::F32, stream);
        if (dW) gemm_bf16(true, false, V, d, nt, 1.f, G, ld, hb + ts * d, d, 1.f, dW, d, DType::F32, stream);
      } else {
        ce_row_kernel<false><<<unsigned(nt), kRowThreads, 0, s>>>(logits, nullptr, ld, int(V), targets + ts, 0.f,
                                                                   nullptr, loss + ts);
        check(cudaGetLastError(), "row kernel launch");
      }
    }
    ce_sum_kernel<<<1, kSumThreads, 0, s>>>(loss, targets, T, sums);
    check(cudaGetLastError(), "loss sum launch");
  } catch (...) {
    cudaFreeAsync(base, s);
    throw;
  }
  Sums host{};
  check(cudaMemcpyAsync(&host, sums, sizeof(Sums), cudaMemcpyDeviceToHost, s), "result copy");
  if (row_loss) check(cudaMemcpyAsync(row_loss, loss, size_t(T) * 4, cudaMemcpyDeviceToHost, s), "row losses");
  check(cudaFreeAsync(base, s), "scratch free");
  check(cudaStreamSynchronize(s), "synchronize");
  return CeResult{host.loss, int64_t(host.valid)};
}

}  // namespace

CeResult cross_entropy_forward_backward(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d,
                                        int64_t V, float grad_scale, float* dh, float* dW, int64_t token_block,
                                        void* stream) {
  return run(h, W, targets, T, d, V, grad_scale, nullptr, dh, dW, nullptr, token_block, stream, true);
}

CeResult cross_entropy_forward(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                               int64_t token_block, void* stream) {
  return run(h, W, targets, T, d, V, 0.f, nullptr, nullptr, nullptr, nullptr, token_block, stream, false);
}

CeResult cross_entropy_rows(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                            float* row_loss, int64_t token_block, void* stream) {
  if (!row_loss && T > 0) check.fail("cross_entropy_rows: null row_loss");
  return run(h, W, targets, T, d, V, 0.f, nullptr, nullptr, nullptr, row_loss, token_block, stream, false);
}

CeResult cross_entropy_backward_rows(const void* h, const void* W, const int32_t* targets, int64_t T, int64_t d,
                                     int64_t V, const float* row_scale, float* dh, float* dW, int64_t token_block,
                                     void* stream) {
  if (!row_scale && T > 0) check.fail("cross_entropy_backward_rows: null row_scale");
  return run(h, W, targets, T, d, V, 1.f, row_scale, dh, dW, nullptr, token_block, stream, true);
}

}  // namespace lm::ops::cuda

// Elementwise glue kernels of the GPU model (glue_cuda.hpp): casts, adds, MLA k/v assembly, the sigmoid
// output gate, the fused AdamW update, and Quantile Balancing's per-expert quantile.
//
// Legend: n elements, rows tokens, H heads, Dn/Dr/Dv head dims, R kv_lora_rank, m tokens and E experts (QB).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <string>

#include "model/cuda/glue_cuda.hpp"
#include "ops/kda/cuda/cuda_error.hpp"

namespace lm::model::cuda {

namespace {

using bf16 = __nv_bfloat16;

[[noreturn]] void fail(const std::string& m) { throw Error("model cuda: " + m); }
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}
cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
unsigned blocks_for(int64_t n, int per = 256) {
  const int64_t b = (n + per - 1) / per;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}
__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + __expf(-x)); }

__global__ void cast_kernel(const float* x, bf16* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

// One block per row; threads walk the H·(Dq + Dv) outputs.
__global__ void split_kv_kernel(const bf16* kv, const float* ckr, bf16* k, bf16* v, int H, int Dn, int Dr, int Dv,
                                int R) {
  const int64_t r = blockIdx.x;
  const int Dq = Dn + Dr, Dkv = Dn + Dv;
  const bf16* kvr = kv + r * H * Dkv;
  const float* kr = ckr + r * (R + Dr) + R;
  for (int i = threadIdx.x; i < H * Dq; i += blockDim.x) {
    const int h = i / Dq, j = i % Dq;
    k[r * H * Dq + i] = j < Dn ? kvr[h * Dkv + j] : __float2bfloat16(kr[j - Dn]);
  }
  for (int i = threadIdx.x; i < H * Dv; i += blockDim.x) {
    const int h = i / Dv, j = i % Dv;
    v[r * H * Dv + i] = kvr[h * Dkv + Dn + j];
  }
}
__global__ void merge_dkv_kernel(const bf16* dk, const bf16* dv, bf16* dkv, bf16* dckr, int H, int Dn, int Dr, int Dv,
                                 int R) {
  const int64_t r = blockIdx.x;
  const int Dq = Dn + Dr, Dkv = Dn + Dv;
  for (int i = threadIdx.x; i < H * Dkv; i += blockDim.x) {
    const int h = i / Dkv, j = i % Dkv;
    dkv[r * H * Dkv + i] = j < Dn ? dk[(r * H + h) * Dq + j] : dv[(r * H + h) * Dv + (j - Dn)];
  }
  for (int j = threadIdx.x; j < Dr; j += blockDim.x) {
    float s = 0.f;
    for (int h = 0; h < H; ++h) s += __bfloat162float(dk[(r * H + h) * Dq + Dn + j]);
    dckr[r * (R + Dr) + R + j] = __float2bfloat16(s);
  }
}

__global__ void gate_fwd_kernel(const bf16* o, const bf16* g, bf16* og, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    og[i] = __float2bfloat16(__bfloat162float(o[i]) * sigm(__bfloat162float(g[i])));
}
__global__ void gate_bwd_kernel(const bf16* o, const bf16* g, const float* dog, bf16* d_o, bf16* d_g, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = sigm(__bfloat162float(g[i])), d = dog[i];
    d_o[i] = __float2bfloat16(d * s);
    d_g[i] = __float2bfloat16(d * __bfloat162float(o[i]) * s * (1.f - s));
  }
}

// 32 x 32 tiles through shared memory (padded against bank conflicts), blockIdx.z = batch.
__global__ void transpose_kernel(const bf16* src, bf16* dst, int rows, int cols) {
  __shared__ bf16 tile[32][33];
  const int64_t base = int64_t(blockIdx.z) * rows * cols;
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int r = r0 + j, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[j][threadIdx.x] = src[base + int64_t(r) * cols + c];
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += blockDim.y) {
    const int c = c0 + j, r = r0 + threadIdx.x;
    if (r < rows && c < cols) dst[base + int64_t(c) * rows + r] = tile[threadIdx.x][j];
  }
}

__global__ void adamw_kernel(float* w, const float* g, float* m, float* v, bf16* wb, int64_t n, AdamW a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = g[i] * a.gscale;
    const float mi = a.b1 * m[i] + (1.f - a.b1) * gi;
    const float vi = a.b2 * v[i] + (1.f - a.b2) * gi * gi;
    m[i] = mi, v[i] = vi;
    float wi = w[i];
    wi -= a.lr * ((mi / a.bc1) / (sqrtf(vi / a.bc2) + a.eps) + a.wd * wi);
    w[i] = wi;
    wb[i] = __float2bfloat16(wi);
  }
}

// QB: r [E, m] = s[i, j] − alpha[i] laid out by expert (segments for the sort).
__global__ void qb_residual_kernel(const float* s, const float* alpha, float* r, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / n, j = idx % n;  // read s row-major (coalesced), write transposed
    r[j * m + i] = s[idx] - alpha[i];
  }
}
// One block: β_j from the descending-sorted segments, b_new = −β + mean(β).
__global__ void qb_beta_kernel(const float* sorted, float* b_new, int64_t m, int n, int64_t Q, double f) {
  extern __shared__ float beta[];
  __shared__ double total;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float* col = sorted + int64_t(j) * m;
    const int64_t i1 = Q < m ? Q : m - 1, i2 = Q + 1 < m ? Q + 1 : m - 1;  // 0-based ranks Q+1, Q+2
    const double r1 = col[i1], r2 = col[i2];
    beta[j] = f == 0.0 ? static_cast<float>(r1) : static_cast<float>((1.0 - f) * r1 + f * r2);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += beta[j];
    total = sum / n;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) b_new[j] = static_cast<float>(-beta[j] + total);
}

__global__ void seg_offsets_kernel(int* off, int n, int m) {
  for (int j = threadIdx.x; j <= n; j += blockDim.x) off[j] = j * m;
}

// 1024 blocks of partial sums in double, then one block adds them in order.
__global__ void sumsq_kernel(const float* x, int64_t n, double* part) {
  __shared__ double sh[256];
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc += double(x[i]) * x[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}
__global__ void sum_parts_kernel(double* part, int n) {
  if (threadIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < n; ++i) s += part[i];
    part[n] = s;
  }
}

void launched(const char* what) { check(cudaGetLastError(), what); }

}  // namespace

void cast_f32_bf16(const float* x, void* y, int64_t n, void* s) {
  if (n <= 0) return;
  cast_kernel<<<blocks_for(n), 256, 0, st(s)>>>(x, static_cast<bf16*>(y), n);
  launched("cast_f32_bf16");
}
void add_f32(float* y, const float* x, int64_t n, void* s) {
  if (n <= 0) return;
  add_kernel<<<blocks_for(n), 256, 0, st(s)>>>(y, x, n);
  launched("add_f32");
}
void mla_split_kv(const void* kv, const float* ckr, void* k, void* v, int64_t rows, int64_t H, int64_t Dn, int64_t Dr,
                  int64_t Dv, int64_t R, void* s) {
  if (rows <= 0) return;
  split_kv_kernel<<<static_cast<unsigned>(rows), 256, 0, st(s)>>>(static_cast<const bf16*>(kv), ckr,
                                                                   static_cast<bf16*>(k), static_cast<bf16*>(v), int(H),
                                                                   int(Dn), int(Dr), int(Dv), int(R));
  launched("mla_split_kv");
}
void mla_merge_dkv(const void* dk, const void* dv, void* dkv, void* dckr, int64_t rows, int64_t H, int64_t Dn,
                   int64_t Dr, int64_t Dv, int64_t R, void* s) {
  if (rows <= 0) return;
  merge_dkv_kernel<<<static_cast<unsigned>(rows), 256, 0, st(s)>>>(
      static_cast<const bf16*>(dk), static_cast<const bf16*>(dv), static_cast<bf16*>(dkv), static_cast<bf16*>(dckr),
      int(H), int(Dn), int(Dr), int(Dv), int(R));
  launched("mla_merge_dkv");
}
void sigmoid_gate_forward(const void* o, const void* g, void* og, int64_t n, void* s) {
  if (n <= 0) return;
  gate_fwd_kernel<<<blocks_for(n), 256, 0, st(s)>>>(static_cast<const bf16*>(o), static_cast<const bf16*>(g),
                                                     static_cast<bf16*>(og), n);
  launched("sigmoid_gate_forward");
}
void sigmoid_gate_backward(const void* o, const void* g, const float* d_og, void* d_o, void* d_g, int64_t n, void* s) {
  if (n <= 0) return;
  gate_bwd_kernel<<<blocks_for(n), 256, 0, st(s)>>>(static_cast<const bf16*>(o), static_cast<const bf16*>(g), d_og,
                                                     static_cast<bf16*>(d_o), static_cast<bf16*>(d_g), n);
  launched("sigmoid_gate_backward");
}
void transpose_bf16(const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols, void* s) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  if (batch > 65535) fail("transpose_bf16: batch too large");
  dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32), static_cast<unsigned>(batch));
  transpose_kernel<<<grid, dim3(32, 8), 0, st(s)>>>(static_cast<const bf16*>(src), static_cast<bf16*>(dst), int(rows),
                                                    int(cols));
  launched("transpose_bf16");
}
void adamw_update(float* w, const float* g, float* m, float* v, void* wb, int64_t n, const AdamW& a, void* s) {
  if (n <= 0) return;
  adamw_kernel<<<blocks_for(n), 256, 0, st(s)>>>(w, g, m, v, static_cast<bf16*>(wb), n, a);
  launched("adamw_update");
}

double sum_squares(const float* x, int64_t n, void* stream) {
  if (n <= 0) return 0;
  cudaStream_t t = st(stream);
  constexpr int kBlocks = 1024;
  double* part = nullptr;
  check(cudaMallocAsync(&part, sizeof(double) * (kBlocks + 1), t), "sum_squares alloc");
  sumsq_kernel<<<kBlocks, 256, 0, t>>>(x, n, part);
  sum_parts_kernel<<<1, 32, 0, t>>>(part, kBlocks);
  launched("sum_squares");
  double r = 0;
  check(cudaMemcpyAsync(&r, part + kBlocks, sizeof(double), cudaMemcpyDeviceToHost, t), "sum_squares copy");
  check(cudaStreamSynchronize(t), "sum_squares");
  cudaFreeAsync(part, t);
  return r;
}

void qb_update(const float* s, const float* alpha, float* b_new, int64_t m, int64_t n, int64_t k, void* stream) {
  if (m <= 0 || n <= 0 || k <= 0 || k >= n) fail("qb_update: needs m > 0 and 0 < k < n");
  if (m * n > (int64_t(1) << 31)) fail("qb_update: m·n too large");
  cudaStream_t t = st(stream);
  float *r = nullptr, *sorted = nullptr;
  int* off = nullptr;
  void* tmp = nullptr;
  size_t tmp_bytes = 0;
  check(cudaMallocAsync(&r, sizeof(float) * m * n, t), "qb alloc");
  check(cudaMallocAsync(&sorted, sizeof(float) * m * n, t), "qb alloc");
  check(cudaMallocAsync(&off, sizeof(int) * (n + 1), t), "qb alloc");
  qb_residual_kernel<<<blocks_for(m * n), 256, 0, t>>>(s, alpha, r, m, n);
  seg_offsets_kernel<<<1, 256, 0, t>>>(off, int(n), int(m));
  launched("qb_update");
  cub::DeviceSegmentedRadixSort::SortKeysDescending(nullptr, tmp_bytes, r, sorted, int(m * n), int(n), off, off + 1, 0,
                                                    32, t);
  check(cudaMallocAsync(&tmp, tmp_bytes, t), "qb alloc");
  check(cub::DeviceSegmentedRadixSort::SortKeysDescending(tmp, tmp_bytes, r, sorted, int(m * n), int(n), off, off + 1,
                                                          0, 32, t),
        "qb sort");
  // q = Q + f with Q = floor(m·k/n), f = ((m·k) mod n)/n, exactly as the CPU estimator.
  const int64_t Q = (m * k) / n;
  const double f = static_cast<double>((m * k) % n) / static_cast<double>(n);
  qb_beta_kernel<<<1, 256, sizeof(float) * n, t>>>(sorted, b_new, m, int(n), Q, f);
  launched("qb_update");
  cudaFreeAsync(tmp, t), cudaFreeAsync(r, t), cudaFreeAsync(sorted, t), cudaFreeAsync(off, t);
}

}  // namespace lm::model::cuda

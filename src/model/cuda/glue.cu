// Elementwise glue kernels of the GPU model (glue_cuda.hpp): casts, adds, MLA k/v assembly, the sigmoid
// output gate, the expert weights' transpose and the gradient norm's sum of squares.
//
// Legend: n elements, rows tokens, H heads, Dn/Dr/Dv head dims, Dq = Dn + Dr, Dkv = Dn + Dv, R kv_lora_rank,
//         nv 16-byte vectors (then a scalar tail), kRows rows per thread (MLA).
//
// Every kernel moves 16-byte vectors where the pointers and sizes allow it (checked on the host) and otherwise runs
// the former scalar code; the arithmetic per element is the same expression on both paths, so the bits are too.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "model/cuda/glue_cuda.hpp"
#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/pdl.cuh"
#include "core/cuda/stream.hpp"

namespace lm::model::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"model cuda"};
[[noreturn]] void fail(const std::string& m) { check.fail(m); }
cudaStream_t st(void* s) { return lm::cu::stream(s); }
unsigned blocks_for(int64_t n, int per = 256) {
  const int64_t b = (n + per - 1) / per;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}
__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + __expf(-x)); }

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// 16-byte vectors: 8 bf16 as four words (element 2w in the low half of word w), or 4 fp32. The per-element math
// of each kernel is one inline function shared by the vector body and the scalar tail / fallback, so both paths
// compile the same expression (same contraction, same intrinsics) and give the same bits.
struct V8 {
  uint32_t w[4];
};
__device__ __forceinline__ V8 ld8(const bf16* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  return {{u.x, u.y, u.z, u.w}};
}
__device__ __forceinline__ void st8(bf16* p, const V8& v) {
  *reinterpret_cast<uint4*>(p) = make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]);
}
__device__ __forceinline__ float at(const V8& v, int e) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(v.w[e / 2] >> (e % 2 * 16))));
}
__device__ __forceinline__ V8 pack8(const bf16 (&b)[8]) {
  V8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v.w[i] = uint32_t(__bfloat16_as_ushort(b[2 * i])) | uint32_t(__bfloat16_as_ushort(b[2 * i + 1])) << 16;
  return v;
}
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
// 8 fp32 (two float4) rounded to bf16.
__device__ __forceinline__ V8 cvt8(float4 a, float4 b) {
  const bf16 o[8] = {__float2bfloat16(a.x), __float2bfloat16(a.y), __float2bfloat16(a.z), __float2bfloat16(a.w),
                     __float2bfloat16(b.x), __float2bfloat16(b.y), __float2bfloat16(b.z), __float2bfloat16(b.w)};
  return pack8(o);
}
__device__ __forceinline__ void st4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }

// Elementwise kernels: nv vectors first (0 when a pointer is misaligned), then the scalar tail [nv·width, n).
__global__ void cast_kernel(const float* x, bf16* y, int64_t n, int64_t nv) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < nv; i += step) {
    st8(y + 8 * i, cvt8(ld4(x + 8 * i), ld4(x + 8 * i + 4)));
  }
  for (int64_t i = 8 * nv + t; i < n; i += step) y[i] = __float2bfloat16(x[i]);
}
__global__ void add_bf16_kernel(float* y, const float* base, const bf16* x, int64_t n) {
  lm::cu::pdl_launch_dependents();  // the next projection may start streaming its weights (core/cuda/pdl.cuh)
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < n; i += step) y[i] = base[i] + __bfloat162float(x[i]);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__global__ void normal_bf16_kernel(bf16* w, int64_t n, float sd, uint64_t seed) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < n; i += step) {
    const uint64_t h = mix64(seed ^ mix64(uint64_t(i) + 0x9e3779b97f4a7c15ull));
    const float u1 = (float((h >> 40) & 0xffffff) + 0.5f) * (1.f / 16777216.f), u2 = float(h & 0xffffff) * (1.f / 16777216.f);
    w[i] = __float2bfloat16(sd * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));  // Box-Muller
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n, int64_t nv) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < nv; i += step) {
    float4 a = ld4(y + 4 * i);
    const float4 b = ld4(x + 4 * i);
    a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
    st4(y + 4 * i, a);
  }
  for (int64_t i = 4 * nv + t; i < n; i += step) y[i] += x[i];
}

// MLA k/v assembly in 16-byte chunks (8 values), the chunk and head from the thread and block indices, so no
// index is divided per element. Each thread moves its chunk for kRows rows, all loads first (4 in flight).
constexpr int kRows = 4;
constexpr int kMergeThreads = 512;  // at most, so that 3 blocks fit an SM's registers

// Block (chunks c of one head, row groups), grid (row groups, H). Chunk c of [k | v] of head h: c·8 < Dn from
// kv's nope part, < Dq the rope part rounded from fp32 ckr (the same for all heads, read through L2), else v from
// kv's value part.
__global__ void split_kv_kernel(const bf16* kv, const float* ckr, bf16* k, bf16* v, int64_t rows, int H, int Dn, int Dr,
                                int Dv, int R) {
  const int j = 8 * int(threadIdx.x), h = blockIdx.y;
  const int Dq = Dn + Dr, Dkv = Dn + Dv;
  const int64_t r0 = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * kRows;
  const int64_t nr = rows - r0 < kRows ? rows - r0 : kRows;
  V8 x[kRows];
  if (j < Dn || j >= Dq) {
    const int js = j < Dn ? j : j - Dr;  // column in kv's [nope | value] head
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (u < nr) x[u] = ld8(kv + ((r0 + u) * H + h) * Dkv + js);
  } else {
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (u < nr) {
        const float* p = ckr + (r0 + u) * (R + Dr) + R + (j - Dn);
        x[u] = cvt8(ld4(p), ld4(p + 4));
      }
  }
#pragma unroll
  for (int u = 0; u < kRows; ++u)
    if (u < nr) st8(j < Dq ? k + ((r0 + u) * H + h) * Dq + j : v + ((r0 + u) * H + h) * Dv + (j - Dq), x[u]);
}
// One block per kRows rows, threads (chunk c of [dk | dv] of a head, heads h = y, y + blockDim.y, ..): nope and
// value chunks go to dkv, rope chunks to shared memory [kRows, H, Dr]; then one thread per (row, 8 rope columns)
// sums them over h = 0..H−1 in order, in fp32, as the scalar kernel does.
__global__ void __launch_bounds__(kMergeThreads, 3)
    merge_dkv_kernel(const bf16* dk, const bf16* dv, bf16* dkv, bf16* dckr, int64_t rows, int H, int Dn, int Dr, int Dv,
                     int R) {
  extern __shared__ uint4 rope_sm[];  // [kRows, H, Dr / 8] chunks
  const int j = 8 * int(threadIdx.x), Dq = Dn + Dr, Dkv = Dn + Dv, nr = Dr / 8;
  const int64_t r0 = int64_t(blockIdx.x) * kRows;
  const int64_t n = rows - r0 < kRows ? rows - r0 : kRows;
  for (int h = threadIdx.y; h < H; h += blockDim.y) {
    V8 x[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (u < n) x[u] = j < Dq ? ld8(dk + ((r0 + u) * H + h) * Dq + j) : ld8(dv + ((r0 + u) * H + h) * Dv + (j - Dq));
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (u < n) {
        if (j < Dn || j >= Dq)
          st8(dkv + ((r0 + u) * H + h) * Dkv + (j < Dn ? j : j - Dr), x[u]);
        else
          rope_sm[(u * H + h) * nr + (j - Dn) / 8] = make_uint4(x[u].w[0], x[u].w[1], x[u].w[2], x[u].w[3]);
      }
  }
  __syncthreads();
  for (int t = threadIdx.y * blockDim.x + threadIdx.x; t < kRows * nr; t += blockDim.x * blockDim.y) {
    const int u = t / nr, q = t % nr;  // consecutive threads read consecutive chunks: no bank conflicts
    if (u >= n) continue;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int h = 0; h < H; ++h) {
      const uint4 c = rope_sm[(u * H + h) * nr + q];
      const V8 x = {{c.x, c.y, c.z, c.w}};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += at(x, e);
    }
    bf16 o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16(acc[e]);
    st8(dckr + (r0 + u) * (R + Dr) + R + 8 * q, pack8(o));
  }
}

// The former one-block-per-row versions, for shapes or pointers the chunked ones cannot take.
__global__ void split_kv_scalar_kernel(const bf16* kv, const float* ckr, bf16* k, bf16* v, int H, int Dn, int Dr,
                                       int Dv, int R) {
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
__global__ void merge_dkv_scalar_kernel(const bf16* dk, const bf16* dv, bf16* dkv, bf16* dckr, int H, int Dn, int Dr,
                                        int Dv, int R) {
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

__device__ __forceinline__ bf16 gate_fwd1(float o, float g) { return __float2bfloat16(o * sigm(g)); }
__device__ __forceinline__ void gate_bwd1(float o, float g, float d, bf16& d_o, bf16& d_g) {
  const float s = sigm(g);
  d_o = __float2bfloat16(d * s);
  d_g = __float2bfloat16(d * o * s * (1.f - s));
}
__global__ void gate_fwd_kernel(const bf16* o, const bf16* g, bf16* og, int64_t n, int64_t nv) {
  lm::cu::pdl_launch_dependents();  // the next projection may start streaming its weights (core/cuda/pdl.cuh)
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < nv; i += step) {
    const V8 a = ld8(o + 8 * i), b = ld8(g + 8 * i);
    bf16 y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = gate_fwd1(at(a, e), at(b, e));
    st8(og + 8 * i, pack8(y));
  }
  for (int64_t i = 8 * nv + t; i < n; i += step) og[i] = gate_fwd1(__bfloat162float(o[i]), __bfloat162float(g[i]));
}
__global__ void gate_bwd_kernel(const bf16* o, const bf16* g, const float* dog, bf16* d_o, bf16* d_g, int64_t n,
                                int64_t nv) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = t; i < nv; i += step) {
    const V8 a = ld8(o + 8 * i), b = ld8(g + 8 * i);
    const float4 d0 = ld4(dog + 8 * i), d1 = ld4(dog + 8 * i + 4);
    const float d[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
    bf16 yo[8], yg[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) gate_bwd1(at(a, e), at(b, e), d[e], yo[e], yg[e]);
    st8(d_o + 8 * i, pack8(yo));
    st8(d_g + 8 * i, pack8(yg));
  }
  for (int64_t i = 8 * nv + t; i < n; i += step)
    gate_bwd1(__bfloat162float(o[i]), __bfloat162float(g[i]), dog[i], d_o[i], d_g[i]);
}

// Each thread transposes an 8 x 8 block in registers (16-byte row loads, byte permutes, 16-byte column stores): no
// shared memory, 8 loads in flight. A warp's lanes are 4 row blocks x 8 column blocks, so its loads are 4 runs of
// 128 bytes and its stores 8 runs of 64; a block of (32, by) threads covers 32·by rows x 64 columns, blockIdx.z =
// batch. Needs rows, cols multiples of 8.
__global__ void transpose_kernel(const bf16* src, bf16* dst, int64_t rows, int64_t cols) {
  const int64_t base = int64_t(blockIdx.z) * rows * cols;
  const int64_t r0 = (int64_t(blockIdx.y) * blockDim.y * 4 + threadIdx.y * 4 + (threadIdx.x & 3)) * 8;
  const int64_t c0 = (int64_t(blockIdx.x) * 8 + (threadIdx.x >> 2)) * 8;
  if (r0 >= rows || c0 >= cols) return;
  V8 a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = ld8(src + base + (r0 + i) * cols + c0);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    V8 b;  // column j: word k = (row 2k, row 2k + 1)
#pragma unroll
    for (int k = 0; k < 4; ++k) b.w[k] = __byte_perm(a[2 * k].w[j / 2], a[2 * k + 1].w[j / 2], j % 2 ? 0x7632 : 0x5410);
    st8(dst + base + (c0 + j) * rows + r0, b);
  }
}
// 32 x 32 tiles through shared memory (padded against bank conflicts), blockIdx.z = batch: any rows, cols.
__global__ void transpose_scalar_kernel(const bf16* src, bf16* dst, int rows, int cols) {
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

__global__ void latent_rows_kernel(const bf16* cn, const float* ckr, bf16* pool, const int32_t* table, int64_t table_ld,
                                   const int32_t* lens, int64_t pos0, int64_t rows, int R, int Dr) {
  const int RD = R + Dr;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * RD) return;
  const int64_t r = i / RD;
  const int j = int(i % RD);
  const int64_t seq = lens ? r : 0, p = lens ? lens[r] : pos0 + r;
  bf16* row = pool + (int64_t(table[seq * table_ld + p / 64]) * 64 + p % 64) * RD;
  row[j] = j < R ? cn[r * R + j] : __float2bfloat16(ckr[r * RD + j]);
}

__global__ void latent_gather_kernel(const bf16* pool, const int32_t* table, int64_t pos0, int64_t rows, int R, int Dr,
                                     bf16* cn, float* ckr) {
  const int RD = R + Dr;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * RD) return;
  const int64_t r = i / RD, p = pos0 + r;
  const int j = int(i % RD);
  const bf16 x = pool[(int64_t(table[p / 64]) * 64 + p % 64) * RD + j];
  if (j < R) cn[r * R + j] = x;
  else ckr[r * RD + j] = __bfloat162float(x);
}

void launched(const char* what) { check(cudaGetLastError(), what); }

}  // namespace

void cast_f32_bf16(const float* x, void* y, int64_t n, void* s) {
  if (n <= 0) return;
  const int64_t nv = aligned(x, 16) && aligned(y, 16) ? n / 8 : 0;
  cast_kernel<<<blocks_for(nv ? nv : n), 256, 0, st(s)>>>(x, static_cast<bf16*>(y), n, nv);
  launched("cast_f32_bf16");
}
void add_f32(float* y, const float* x, int64_t n, void* s) {
  if (n <= 0) return;
  const int64_t nv = aligned(y, 16) && aligned(x, 16) ? n / 4 : 0;
  add_kernel<<<blocks_for(nv ? nv : n), 256, 0, st(s)>>>(y, x, n, nv);
  launched("add_f32");
}
void add_bf16(float* y, const float* base, const void* x, int64_t n, void* s) {
  if (n <= 0) return;
  add_bf16_kernel<<<blocks_for(n), 256, 0, st(s)>>>(y, base, static_cast<const bf16*>(x), n);
  launched("add_bf16");
}
void fill_normal_bf16(void* w, int64_t n, float sd, uint64_t seed, void* s) {
  if (n <= 0) return;
  normal_bf16_kernel<<<blocks_for(n), 256, 0, st(s)>>>(static_cast<bf16*>(w), n, sd, seed);
  launched("fill_normal_bf16");
}
void mla_split_kv(const void* kv, const float* ckr, void* k, void* v, int64_t rows, int64_t H, int64_t Dn, int64_t Dr,
                  int64_t Dv, int64_t R, void* s) {
  if (rows <= 0) return;
  const int64_t nc = (Dn + Dr + Dv) / 8;  // 16-byte chunks per head of [k | v]
  if (Dn % 8 == 0 && Dr % 8 == 0 && Dv % 8 == 0 && R % 4 == 0 && nc >= 1 && nc <= 1024 && H <= 65535 &&
      aligned(kv, 16) && aligned(ckr, 16) && aligned(k, 16) && aligned(v, 16)) {
    const int64_t ny = nc < 256 ? 256 / nc : 1, per = ny * kRows;
    split_kv_kernel<<<dim3(static_cast<unsigned>((rows + per - 1) / per), static_cast<unsigned>(H)),
                      dim3(static_cast<unsigned>(nc), static_cast<unsigned>(ny)), 0, st(s)>>>(
        static_cast<const bf16*>(kv), ckr, static_cast<bf16*>(k), static_cast<bf16*>(v), rows, int(H), int(Dn), int(Dr),
        int(Dv), int(R));
  } else {
    split_kv_scalar_kernel<<<static_cast<unsigned>(rows), 256, 0, st(s)>>>(static_cast<const bf16*>(kv), ckr,
                                                                           static_cast<bf16*>(k), static_cast<bf16*>(v),
                                                                           int(H), int(Dn), int(Dr), int(Dv), int(R));
  }
  launched("mla_split_kv");
}
void mla_merge_dkv(const void* dk, const void* dv, void* dkv, void* dckr, int64_t rows, int64_t H, int64_t Dn,
                   int64_t Dr, int64_t Dv, int64_t R, void* s) {
  if (rows <= 0) return;
  const int64_t nc = (Dn + Dr + Dv) / 8;                                         // 16-byte chunks per head of [dk | dv]
  const int64_t hy = nc > 0 && H * nc > kMergeThreads ? kMergeThreads / nc : H;  // heads side by side in a block
  const size_t smem = sizeof(uint16_t) * kRows * (H > 0 ? H : 0) * (Dr > 0 ? Dr : 0);
  if (Dn % 8 == 0 && Dr % 8 == 0 && Dv % 8 == 0 && R % 8 == 0 && H >= 1 && nc >= 1 && nc <= kMergeThreads &&
      smem <= 48 * 1024 && aligned(dk, 16) && aligned(dv, 16) && aligned(dkv, 16) && aligned(dckr, 16)) {
    merge_dkv_kernel<<<static_cast<unsigned>((rows + kRows - 1) / kRows),
                       dim3(static_cast<unsigned>(nc), static_cast<unsigned>(hy)), smem, st(s)>>>(
        static_cast<const bf16*>(dk), static_cast<const bf16*>(dv), static_cast<bf16*>(dkv), static_cast<bf16*>(dckr),
        rows, int(H), int(Dn), int(Dr), int(Dv), int(R));
  } else {
    merge_dkv_scalar_kernel<<<static_cast<unsigned>(rows), 256, 0, st(s)>>>(
        static_cast<const bf16*>(dk), static_cast<const bf16*>(dv), static_cast<bf16*>(dkv), static_cast<bf16*>(dckr),
        int(H), int(Dn), int(Dr), int(Dv), int(R));
  }
  launched("mla_merge_dkv");
}
void mla_latent_rows(const void* cn, const float* ckr, void* pool, const int32_t* table, int64_t table_ld,
                     const int32_t* lens, int64_t pos0, int64_t rows, int64_t R, int64_t Dr, void* s) {
  if (rows == 0) return;
  const int64_t n = rows * (R + Dr);
  latent_rows_kernel<<<unsigned((n + 255) / 256), 256, 0, st(s)>>>(
      static_cast<const bf16*>(cn), ckr, static_cast<bf16*>(pool), table, table_ld, lens, pos0, rows, int(R), int(Dr));
  launched("mla_latent_rows");
}
void mla_latent_gather(const void* pool, const int32_t* table, int64_t pos0, int64_t rows, int64_t R, int64_t Dr,
                       void* cn, float* ckr, void* s) {
  if (rows == 0) return;
  const int64_t n = rows * (R + Dr);
  latent_gather_kernel<<<unsigned((n + 255) / 256), 256, 0, st(s)>>>(
      static_cast<const bf16*>(pool), table, pos0, rows, int(R), int(Dr), static_cast<bf16*>(cn), ckr);
  launched("mla_latent_gather");
}
void sigmoid_gate_forward(const void* o, const void* g, void* og, int64_t n, void* s) {
  if (n <= 0) return;
  const int64_t nv = aligned(o, 16) && aligned(g, 16) && aligned(og, 16) ? n / 8 : 0;
  gate_fwd_kernel<<<blocks_for(nv ? nv : n), 256, 0, st(s)>>>(static_cast<const bf16*>(o), static_cast<const bf16*>(g),
                                                              static_cast<bf16*>(og), n, nv);
  launched("sigmoid_gate_forward");
}
void sigmoid_gate_backward(const void* o, const void* g, const float* d_og, void* d_o, void* d_g, int64_t n, void* s) {
  if (n <= 0) return;
  const int64_t nv =
      aligned(o, 16) && aligned(g, 16) && aligned(d_og, 16) && aligned(d_o, 16) && aligned(d_g, 16) ? n / 8 : 0;
  gate_bwd_kernel<<<blocks_for(nv ? nv : n), 256, 0, st(s)>>>(static_cast<const bf16*>(o), static_cast<const bf16*>(g),
                                                              d_og, static_cast<bf16*>(d_o), static_cast<bf16*>(d_g), n,
                                                              nv);
  launched("sigmoid_gate_backward");
}
void transpose_bf16(const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols, void* s) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  if (batch > 65535) fail("transpose_bf16: batch too large");
  constexpr int kBy = 4;  // warps per block: 128 rows x 64 columns
  if (rows % 8 == 0 && cols % 8 == 0 && (rows + 32 * kBy - 1) / (32 * kBy) <= 65535 && aligned(src, 16) &&
      aligned(dst, 16)) {
    dim3 grid(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>((rows + 32 * kBy - 1) / (32 * kBy)),
              static_cast<unsigned>(batch));
    transpose_kernel<<<grid, dim3(32, kBy), 0, st(s)>>>(static_cast<const bf16*>(src), static_cast<bf16*>(dst), rows,
                                                        cols);
  } else {
    dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32),
              static_cast<unsigned>(batch));
    transpose_scalar_kernel<<<grid, dim3(32, 8), 0, st(s)>>>(static_cast<const bf16*>(src), static_cast<bf16*>(dst),
                                                             int(rows), int(cols));
  }
  launched("transpose_bf16");
}
double sum_squares(const float* x, int64_t n, void* stream) {
  if (n <= 0) return 0;
  cudaStream_t t = st(stream);
  constexpr int kBlocks = 1024;
  double* part = nullptr;
  check(cu::malloc_async(&part, sizeof(double) * (kBlocks + 1), t), "sum_squares alloc");
  sumsq_kernel<<<kBlocks, 256, 0, t>>>(x, n, part);
  sum_parts_kernel<<<1, 32, 0, t>>>(part, kBlocks);
  launched("sum_squares");
  double r = 0;
  check(cudaMemcpyAsync(&r, part + kBlocks, sizeof(double), cudaMemcpyDeviceToHost, t), "sum_squares copy");
  check(cudaStreamSynchronize(t), "sum_squares");
  cudaFreeAsync(part, t);
  return r;
}

}  // namespace lm::model::cuda

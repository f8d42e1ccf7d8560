// Token embedding on the GPU (ops/embedding/cuda/embedding_cuda.hpp): gather of bf16 table rows into the fp32
// residual stream, and the deterministic scatter-add backward.
//
// Legend: T tokens, vocab table rows, d hidden, S distinct ids among the T tokens (segments), V elements per
//         vector access (forward 8 bf16 = 16 bytes, backward 4 floats; 1 when d or alignment forbids).
// Backward: the host stable-sorts the token positions by id (the ids are on the host anyway), so each id's
// tokens form one segment in token order; positions, segment starts and segment ids go up in one scratch
// buffer. One block per segment sums its dout rows in order and adds the sum to dtable once: no atomics,
// same bits on every run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/stream.hpp"
#include "ops/embedding/cuda/embedding_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"embedding cuda"};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// out[t, c..c+V) = float(table[ids[t], c..c+V)), grid-stride over T · d / V items.
template <int V>
__global__ void fwd_kernel(const int32_t* ids, int64_t T, const bf16* table, int d, float* out) {
  const int nv = d / V;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * nv; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / nv;
    const int c = int(i % nv) * V;
    const bf16* src = table + int64_t(ids[t]) * d + c;
    float* dst = out + t * d + c;
    if constexpr (V == 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(src);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      const float2 e = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.z));
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.w));
      reinterpret_cast<float4*>(dst)[0] = make_float4(a.x, a.y, b.x, b.y);
      reinterpret_cast<float4*>(dst)[1] = make_float4(e.x, e.y, f.x, f.y);
    } else {
      *dst = __bfloat162float(*src);
    }
  }
}

// Block s: dtable[seg_id[s]] += Σ_{k in [seg[s], seg[s+1])} dout[pos[k]], the sum taken in k (token) order.
template <int V>
__global__ void bwd_kernel(const int32_t* pos, const int32_t* seg, const int32_t* seg_id, const float* dout, int d,
                           float* dtable) {
  const int s = blockIdx.x;
  const int k0 = seg[s], k1 = seg[s + 1];
  float* dst = dtable + int64_t(seg_id[s]) * d;
  for (int c = threadIdx.x * V; c < d; c += blockDim.x * V) {
    float acc[V];
#pragma unroll
    for (int q = 0; q < V; ++q) acc[q] = 0.f;
    for (int k = k0; k < k1; ++k) {
      const float* src = dout + int64_t(pos[k]) * d + c;
      if constexpr (V == 4) {
        const float4 f = *reinterpret_cast<const float4*>(src);
        acc[0] += f.x, acc[1] += f.y, acc[2] += f.z, acc[3] += f.w;
      } else {
        acc[0] += *src;
      }
    }
    if constexpr (V == 4) {
      float4 o = *reinterpret_cast<const float4*>(dst + c);
      o.x += acc[0], o.y += acc[1], o.z += acc[2], o.w += acc[3];
      *reinterpret_cast<float4*>(dst + c) = o;
    } else {
      dst[c] += acc[0];
    }
  }
}

}  // namespace

void embedding_forward(const int32_t* ids, int64_t T, const void* table, int64_t d, float* out, void* stream) {
  if (T < 0 || d <= 0 || d > (int64_t(1) << 30))
    check.fail("forward: need T >= 0 and 0 < d < 2^30, got T=" + std::to_string(T) + " d=" + std::to_string(d));
  if (T == 0) return;
  if (!ids || !table || !out) check.fail("forward: ids, table and out are required");
  auto s = lm::cu::stream(stream);
  const bool vec = d % 8 == 0 && aligned16(table) && aligned16(out);
  const int64_t items = T * (vec ? d / 8 : d);
  const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, 132 * 32)));
  if (vec)
    fwd_kernel<8><<<grid, 256, 0, s>>>(ids, T, static_cast<const bf16*>(table), int(d), out);
  else
    fwd_kernel<1><<<grid, 256, 0, s>>>(ids, T, static_cast<const bf16*>(table), int(d), out);
  check(cudaGetLastError(), "forward launch");
}

void embedding_backward(const int32_t* host_ids, int64_t T, const float* dout, int64_t vocab, int64_t d,
                        float* dtable, void* stream) {
  if (T < 0 || vocab <= 0 || d <= 0 || d > (int64_t(1) << 30) || T >= (int64_t(1) << 31))
    check.fail("backward: need 0 <= T < 2^31, vocab > 0, 0 < d < 2^30; got T=" + std::to_string(T) +
         " vocab=" + std::to_string(vocab) + " d=" + std::to_string(d));
  if (T == 0) return;
  if (!host_ids || !dout || !dtable) check.fail("backward: host_ids, dout and dtable are required");
  for (int64_t t = 0; t < T; ++t)
    if (host_ids[t] < 0 || host_ids[t] >= vocab)
      check.fail("backward: token id " + std::to_string(host_ids[t]) + " at position " + std::to_string(t) +
           " is out of range [0, " + std::to_string(vocab) + ")");
  // Host buffer [pos T | seg S+1 | seg_id S]: positions sorted by id (stable: token order within an id).
  std::vector<int32_t> buf(size_t(3 * T + 1));
  int32_t* pos = buf.data();
  std::iota(pos, pos + T, 0);
  std::stable_sort(pos, pos + T, [&](int32_t a, int32_t b) { return host_ids[a] < host_ids[b]; });
  std::vector<int32_t> seg, seg_id;
  seg.reserve(size_t(T) + 1), seg_id.reserve(size_t(T));
  for (int64_t k = 0; k < T; ++k)
    if (k == 0 || host_ids[pos[k]] != host_ids[pos[k - 1]]) seg.push_back(int32_t(k)), seg_id.push_back(host_ids[pos[k]]);
  const int64_t S = int64_t(seg_id.size());
  seg.push_back(int32_t(T));
  std::copy(seg.begin(), seg.end(), buf.begin() + T);
  std::copy(seg_id.begin(), seg_id.end(), buf.begin() + T + S + 1);
  const size_t bytes = size_t(T + 2 * S + 1) * sizeof(int32_t);

  auto s = lm::cu::stream(stream);
  int32_t* dbuf = nullptr;
  check(cu::malloc_async(&dbuf, bytes, s), "backward scratch");
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `buf` may go out of scope.
  cudaError_t err = cudaMemcpyAsync(dbuf, buf.data(), bytes, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) {
    const bool vec = d % 4 == 0 && aligned16(dout) && aligned16(dtable);
    int threads = 32;
    while (threads < 256 && int64_t(threads) * (vec ? 4 : 1) < d) threads *= 2;
    if (vec)
      bwd_kernel<4><<<unsigned(S), threads, 0, s>>>(dbuf, dbuf + T, dbuf + T + S + 1, dout, int(d), dtable);
    else
      bwd_kernel<1><<<unsigned(S), threads, 0, s>>>(dbuf, dbuf + T, dbuf + T + S + 1, dout, int(d), dtable);
    err = cudaGetLastError();
  }
  const cudaError_t e2 = cudaFreeAsync(dbuf, s);
  check(err, "backward launch");
  check(e2, "backward scratch free");
}

}  // namespace lm::ops::cuda

// The vision tower's gathers and scatters and the splice (vision_glue_cuda.hpp): one thread per output element,
// each summing its inputs in a fixed order.
//
// Legend: L patches, D tower width, M merged rows, S slots per merged row, G position-table rows, n text rows,
//         d text width, Mf feature rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "model/cuda/vision_glue_cuda.hpp"

namespace lm::model::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"vision cuda"};
cudaStream_t st(void* s) { return lm::cu::stream(s); }
unsigned blocks_for(int64_t n, int per = 256) {
  const int64_t b = (n + per - 1) / per;
  return static_cast<unsigned>(b < 65535 * 16 ? b : 65535 * 16);
}
void launched(const char* what) { check(cudaGetLastError(), what); }

// Grid-stride loops over the elements of a [rows, D] output.
#define LM_FOR_EACH(i, n)                                                                         \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, step_ = int64_t(gridDim.x) * blockDim.x; \
       i < (n); i += step_)

__global__ void add_position_kernel(float* x, const float* pos, const int32_t* pos_row, const float* time,
                                    const int32_t* frame, int64_t L, int64_t D) {
  LM_FOR_EACH(i, L * D) {
    const int64_t r = i / D, c = i % D;
    float v = x[i] + pos[int64_t(pos_row[r]) * D + c];
    if (time && frame[r] >= 0) v += time[int64_t(frame[r]) * D + c];
    x[i] = v;
  }
}
__global__ void position_grad_kernel(const float* dx, const int32_t* start, const int32_t* src, float* dpos,
                                     int64_t G, int64_t D) {
  LM_FOR_EACH(i, G * D) {
    const int64_t j = i / D, c = i % D;
    float s = 0.f;
    for (int32_t k = start[j]; k < start[j + 1]; ++k) s += dx[int64_t(src[k]) * D + c];
    dpos[i] = s;
  }
}
__global__ void merge_kernel(const bf16* y, const int32_t* first, const int32_t* frames, const int32_t* stride,
                             bf16* m, int64_t M, int64_t S, int64_t D) {
  LM_FOR_EACH(i, M * S * D) {
    const int64_t js = i / D, c = i % D, j = js / S;
    const int t = frames[j];
    float s = 0.f;
    for (int f = 0; f < t; ++f) s += __bfloat162float(y[(int64_t(first[js]) + int64_t(f) * stride[j]) * D + c]);
    m[i] = __float2bfloat16(s / float(t));
  }
}
__global__ void unmerge_kernel(const bf16* dm, const int32_t* cell, const int32_t* frames, float* dy, int64_t L,
                               int64_t D) {
  LM_FOR_EACH(i, L * D) {
    const int64_t r = i / D, c = i % D;
    dy[i] = __bfloat162float(dm[int64_t(cell[r]) * D + c]) / float(frames[r]);
  }
}
template <class T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f(bf16 v) {
  return __bfloat162float(v);
}
template <class T>
__global__ void splice_kernel(float* h, const int32_t* pos, const T* feat, int64_t Mf, int64_t d) {
  LM_FOR_EACH(i, Mf * d) h[int64_t(pos[i / d]) * d + i % d] = to_f(feat[i]);
}
__global__ void splice_backward_kernel(float* dh, const int32_t* pos, float* dfeat, int64_t Mf, int64_t d) {
  LM_FOR_EACH(i, Mf * d) {
    float* p = dh + int64_t(pos[i / d]) * d + i % d;
    dfeat[i] = *p;
    *p = 0.f;
  }
}
#undef LM_FOR_EACH

}  // namespace

void vision_add_position(float* x, const float* pos, const int32_t* pos_row, const float* time, const int32_t* frame,
                         int64_t L, int64_t D, void* s) {
  if (L * D <= 0) return;
  add_position_kernel<<<blocks_for(L * D), 256, 0, st(s)>>>(x, pos, pos_row, time, frame, L, D);
  launched("vision_add_position");
}
void vision_position_grad(const float* dx, const int32_t* start, const int32_t* src, float* dpos, int64_t G, int64_t D,
                          void* s) {
  if (G * D <= 0) return;
  position_grad_kernel<<<blocks_for(G * D), 256, 0, st(s)>>>(dx, start, src, dpos, G, D);
  launched("vision_position_grad");
}
void vision_merge(const void* y, const int32_t* first, const int32_t* frames, const int32_t* stride, void* m,
                  int64_t M, int64_t S, int64_t D, void* s) {
  if (M * S * D <= 0) return;
  merge_kernel<<<blocks_for(M * S * D), 256, 0, st(s)>>>(static_cast<const bf16*>(y), first, frames, stride,
                                                          static_cast<bf16*>(m), M, S, D);
  launched("vision_merge");
}
void vision_unmerge(const void* dm, const int32_t* cell, const int32_t* frames, float* dy, int64_t L, int64_t D,
                    void* s) {
  if (L * D <= 0) return;
  unmerge_kernel<<<blocks_for(L * D), 256, 0, st(s)>>>(static_cast<const bf16*>(dm), cell, frames, dy, L, D);
  launched("vision_unmerge");
}
void splice_rows(float* h, const int32_t* pos, const void* features, bool feat_bf16, int64_t Mf, int64_t d, void* s) {
  if (Mf * d <= 0) return;
  if (feat_bf16)
    splice_kernel<<<blocks_for(Mf * d), 256, 0, st(s)>>>(h, pos, static_cast<const bf16*>(features), Mf, d);
  else
    splice_kernel<<<blocks_for(Mf * d), 256, 0, st(s)>>>(h, pos, static_cast<const float*>(features), Mf, d);
  launched("splice_rows");
}
void splice_rows_backward(float* dh, const int32_t* pos, float* dfeat, int64_t Mf, int64_t d, void* s) {
  if (Mf * d <= 0) return;
  splice_backward_kernel<<<blocks_for(Mf * d), 256, 0, st(s)>>>(dh, pos, dfeat, Mf, d);
  launched("splice_rows_backward");
}

}  // namespace lm::model::cuda

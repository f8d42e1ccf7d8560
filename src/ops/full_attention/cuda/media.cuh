#pragma once
// Shared by the full attention kernels (full_attention.cu: CUDA-core fp32 kernels and the host API;
// full_attention_tc.cu: mma.sync tensor-core kernels): the media table that one launch covers, and the tensor-core
// launchers.
//
// Legend: B = 64 rows per query / key tile; a launch's blocks are the tiles of its media in order (grid.x), times
// the heads (grid.y); media of length 0 own no tile.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lm::ops::cuda::fa {

constexpr int kB = 64;
constexpr int kMaxMedia = 480;  // per launch: the table stays within the classic 4 KB of kernel arguments

// Media of one launch: row offsets (absolute rows, n + 1 entries) and the prefix of their tile counts.
struct MediaTable {
  int32_t n;
  int32_t row0[kMaxMedia + 1];
  int32_t tile0[kMaxMedia + 1];
};

struct TileOf {
  int64_t start;  // first row of the media
  int32_t T;      // its length
  int32_t r0;     // first row of the tile within the media
};

// The tile of block b: the media n with tile0[n] <= b < tile0[n + 1].
__device__ __forceinline__ TileOf tile_of(const MediaTable& t, int32_t b) {
  int lo = 0, hi = t.n;  // tile0[lo] <= b < tile0[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (t.tile0[mid] <= b) lo = mid;
    else hi = mid;
  }
  return TileOf{t.row0[lo], t.row0[lo + 1] - t.row0[lo], (b - t.tile0[lo]) * kB};
}

// Tensor-core kernels (full_attention_tc.cu). Preconditions (checked by the caller): 8 <= Dh <= 128, Dh % 8 == 0,
// ld and ldo multiples of 8, every pointer 16-byte aligned (cp.async rows).
struct TcArgs {
  int H, Dh;
  int64_t ld, ldo;
  float scale;
};
void tc_forward(const MediaTable& t, int32_t tiles, const TcArgs& a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                const __nv_bfloat16* v, __nv_bfloat16* o, float* lse, cudaStream_t st);
void tc_backward(const MediaTable& t, int32_t tiles, const TcArgs& a, const __nv_bfloat16* q, const __nv_bfloat16* k,
                 const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse, const float* delta,
                 __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, cudaStream_t st);

}  // namespace lm::ops::cuda::fa

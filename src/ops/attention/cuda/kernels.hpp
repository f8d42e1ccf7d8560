#pragma once
// Internal: parameter blocks and launchers of the attention kernels (one .cu each), called by api.cu.
//
// Legend: B batch, T tokens, H query heads, Hkv kv heads, G = H / Hkv, Dk/Dv head dims, rows = B·T (or the
//         packed total), Bq/Bk query/key tiles. Tile tables list (sequence, tile index) pairs, heaviest first.
#include <cuda_runtime.h>

#include <cstdint>

namespace lm::ops::cuda::detail {

// Block b of a grid of ntiles × nheads blocks → (head, tile): heads in groups of `group`, and inside a group the
// tile outer, the head inner. The blocks resident at one time then work on a few heads, whose K/V (forward) or
// Q/dO (backward) stay in L2 across that head's tiles; head-fastest order (group = nheads) has every head in
// flight at once and streams each head's tensors from HBM for every tile. Tiles stay heaviest first per group.
__device__ __forceinline__ int2 head_and_tile(int b, int nheads, int ntiles, int group) {
  const int per = group * ntiles, grp = b / per, rem = b - grp * per;
  const int gs = min(group, nheads - grp * group);
  return make_int2(grp * group + rem % gs, rem / gs);
}

struct FwdParams {
  const void *q, *k, *v;
  void* o;
  float* lse;            // [rows, H] natural log, nullable
  const int* seq_start;  // [N + 1] row offsets
  const int2* tiles;     // (sequence, query tile of 128 rows)
  int H, G;
  int head_group;          // head_and_tile's group
  int64_t sq, sk, sv, so;  // row strides in elements
  float scale_log2;        // scale · log2(e)
};
void launch_fwd(const FwdParams& p, int Dk, int Dv, int ntiles, cudaStream_t s);
// The same on warpgroup MMAs (fwd_wgmma.cu): Dv == 128, Dk 128 or 192; q, k, v dense [rows, heads, D].
void launch_fwd_wgmma(const FwdParams& p, int Dk, int64_t rows, int Hkv, int ntiles, cudaStream_t s);

struct BwdParams {
  const void *q, *k, *v, *dout;
  const float *lse2, *D;  // [H, rows]: lse · log2(e) and rowsum(do ⊙ o)
  float* dqacc;           // [H, rows + 64, Dk] fp32, zeroed, 16-byte aligned; reduced into (bulk or vector adds)
  void *dk, *dv;
  const int* seq_start;
  const int2* tiles;  // (sequence, key tile of 64 rows)
  int H, G, Hkv, rows;
  int head_group;  // head_and_tile's group (over the kv heads)
  int64_t sq, sk, sv, sdo;
  float scale, scale_log2;
};
// lse2 and D from lse, o, do (one warp per row and head).
void launch_bwd_pre(const void* o, const void* dout, const float* lse, float* lse2, float* D, int rows, int H, int Dv,
                    cudaStream_t s);
void launch_bwd(const BwdParams& p, int Dk, int Dv, int ntiles, cudaStream_t s);
// The same on warpgroup MMAs (bwd_wgmma.cu): Dv == 128, Dk 128 or 192, dense [rows, heads, D] tensors; 128-key
// blocks, two compute warpgroups, dQ by vector reductions; ntiles of 128 keys.
void launch_bwd_wgmma(const BwdParams& p, int Dk, int ntiles, cudaStream_t s);
// dq [rows, H, Dk] bf16 from the fp32 accumulator [H, rows + 64, Dk].
void launch_dq_convert(const float* dqacc, void* dq, int rows, int H, int Dk, cudaStream_t s);

struct DecParams {
  const void *q_lat, *q_rope, *cache;
  float *part_o, *part_ml;  // [splits, H, 512], [splits, 2, H]
  int H, Tc, ldc, splits, tiles_per_split;
  float scale_log2;
};
void launch_decode(const DecParams& p, cudaStream_t s);
void launch_decode_combine(const DecParams& p, void* o_lat, float* lse, cudaStream_t s);

}  // namespace lm::ops::cuda::detail

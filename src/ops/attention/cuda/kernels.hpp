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
  const int2* tiles;     // (sequence, query tile of 128 rows); null: block mode (wgmma kernel only)
  int H, G;
  int head_group;          // head_and_tile's group
  int64_t sq, sk, sv, so;  // row strides in elements
  float scale_log2;        // scale · log2(e)
  // Block mode (tiles == null): q_len query rows against k_len keys, query row r at key position r + delta
  // (key j visible iff j <= r + delta); ntiles = ceil(q_len / 128) query tiles, no seq_start.
  int q_len = 0, k_len = 0, delta = 0;
};
void launch_fwd(const FwdParams& p, int Dk, int Dv, int ntiles, cudaStream_t s);
// The same on warpgroup MMAs (fwd_wgmma.cu): Dv == 128, Dk 128 or 192; q, k, v dense [q_rows, H, D] and
// [k_rows, Hkv, D] (k_rows == q_rows but in block mode).
void launch_fwd_wgmma(const FwdParams& p, int Dk, int64_t q_rows, int64_t k_rows, int Hkv, int ntiles,
                      cudaStream_t s);
// Log-sum-exp merge of attention partials (block.cu), one warp per (row, head): o_part [n, Dv] bf16, lse_part [n];
// first: o_acc = o_part, lse_acc = lse_part; else o_acc, lse_acc [n, Dv], [n] fp32 merged in place. n = rows·H,
// Dv % 4 == 0.
void launch_attn_merge(int64_t n, int Dv, const void* o_part, const float* lse_part, float* o_acc, float* lse_acc,
                       bool first, cudaStream_t s);
// o [count] bf16 = o_acc [count] fp32, count % 4 == 0.
void launch_attn_merge_finish(int64_t count, const float* o_acc, void* o, cudaStream_t s);

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

// Absorbed decode (decode.cu) of S sequences: q_lat [S, H, 512], q_rope [S, H, 64], o_lat [S, H, 512]; each
// sequence's cache dense (cache + s·seq_stride rows of ldc) or paged (table [S, table_ld] of 64-row blocks of the
// pool `cache`); Tc = lens[s] + len_add (device lengths) or p.Tc.
struct DecParams {
  const void *q_lat, *q_rope, *cache;
  float *part_o, *part_ml;  // [S, splits, H, 512], [S, splits, 2, H]
  int H, Tc, ldc, splits, tiles_per_split;
  int ldqr = 64;  // q_rope's row stride (elements)
  float scale_log2;
  int S = 1;
  int64_t seq_stride = 0;     // dense caches: elements between sequences
  const int* table = nullptr;  // paged: block ids [S, table_ld]
  int64_t table_ld = 0;
  const int* lens = nullptr;   // device lengths [S] (null: p.Tc, p.tiles_per_split)
  int len_add = 0;
};
// Heads of one decode block (16 or 32): the cache is read once per group of that many heads.
int decode_heads_per_block(int64_t H);
void launch_decode(const DecParams& p, cudaStream_t s);
void launch_decode_combine(const DecParams& p, void* o_lat, float* lse, cudaStream_t s);

}  // namespace lm::ops::cuda::detail

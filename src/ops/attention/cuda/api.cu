// Host side of the CUDA attention: checks, tile tables (heaviest first), scratch, and the kernel sequence.
//
// Legend: B batch, T tokens, H query heads, Hkv kv heads, Dk/Dv head dims, N sequences, rows = B·T,
//         Tc cached positions (decode).
// forward:  one kernel (fwd_wgmma.cu on warpgroup MMAs; fwd.cu on mma.sync when asked for).
// backward: row statistics (lse2, D) -> per key tile dK, dV with dQ reduced into an fp32 accumulator -> dq
//           in bf16 (bwd_wgmma.cu with 128-key blocks, bwd.cu on mma.sync with 64).
// decode:   split-K partials -> log-sum-exp combine.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda/check.hpp"
#include "core/cuda/device.hpp"
#include "core/cuda/stream.hpp"
#include "core/env.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"
#include "ops/attention/cuda/kernels.hpp"

namespace lm::ops::cuda {

namespace {

constexpr cu::Checker check{"attention cuda"};

// Heads per scheduling group (kernels.hpp, head_and_tile); LONGMOE_ATTN_HEAD_GROUP overrides both for tuning.
// Measured on an H200 (bench attention, 4 MLA/128 shapes): head-fastest order (group = H) gave forward 427-511
// and forward+backward 276-384 TFLOP/s; groups of 4 heads forward 447-518, one head at a time backward
// (the backward's blocks then share Q, dO, lse and D of one head) forward+backward 367-392.
int head_group(bool backward) {
  static const int group = env::attn_head_group();
  return group > 0 ? group : backward ? 1 : 4;
}

// Sequence starts and (sequence, tile) lists on the device, cached for the last few shapes (the tables only
// depend on B, T, cu_seqlens and the tile size).
struct Tables {
  std::vector<int64_t> key;
  int* seq_start = nullptr;  // [N + 1]
  int2* tiles = nullptr;
  int ntiles = 0;
};

const Tables& tables(const AttnShape& s, int tile, bool keys_first_heavy) {
  static std::mutex mu;
  static std::vector<Tables> cache;
  std::lock_guard<std::mutex> lock(mu);
  const int64_t N = s.cu_seqlens ? s.N : s.B;
  std::vector<int64_t> key{s.B, s.T, N, tile, keys_first_heavy};
  if (s.cu_seqlens) key.insert(key.end(), s.cu_seqlens, s.cu_seqlens + N + 1);
  for (auto& t : cache)
    if (t.key == key) return t;
  Tables t;
  t.key = key;
  std::vector<int> starts(size_t(N + 1));
  for (int64_t n = 0; n <= N; ++n) starts[size_t(n)] = int(s.cu_seqlens ? s.cu_seqlens[n] : n * s.T);
  // Work of a tile: query tile i sees (i + 1) key tiles; key tile j is seen by (ntiles - j) query tiles.
  struct W {
    int64_t work;
    int seq, idx;
  };
  std::vector<W> w;
  for (int64_t n = 0; n < N; ++n) {
    const int len = starts[size_t(n + 1)] - starts[size_t(n)], nt = (len + tile - 1) / tile;
    for (int i = 0; i < nt; ++i) w.push_back({keys_first_heavy ? nt - i : i + 1, int(n), i});
  }
  std::stable_sort(w.begin(), w.end(), [](const W& a, const W& b) { return a.work > b.work; });
  std::vector<int2> tl(w.size());
  for (size_t i = 0; i < w.size(); ++i) tl[i] = make_int2(w[i].seq, w[i].idx);
  t.ntiles = int(tl.size());
  check(cudaMalloc(&t.seq_start, starts.size() * sizeof(int)), "tables");
  check(cudaMalloc(&t.tiles, std::max<size_t>(1, tl.size()) * sizeof(int2)), "tables");
  check(cudaMemcpy(t.seq_start, starts.data(), starts.size() * sizeof(int), cudaMemcpyHostToDevice), "tables");
  if (!tl.empty()) check(cudaMemcpy(t.tiles, tl.data(), tl.size() * sizeof(int2), cudaMemcpyHostToDevice), "tables");
  if (cache.size() >= 8) {
    cudaFree(cache.front().seq_start);
    cudaFree(cache.front().tiles);
    cache.erase(cache.begin());
  }
  cache.push_back(t);
  return cache.back();
}

void check_shape(const AttnShape& s) {
  const int64_t Hkv = s.Hkv > 0 ? s.Hkv : s.H;
  if (s.B < 1 || s.T < 0 || s.H < 1 || Hkv < 1 || s.H % Hkv) check.fail("bad shape");
  if (!((s.Dk == 192 && s.Dv == 128) || (s.Dk == 128 && s.Dv == 128)))
    check.fail("head dims (Dk, Dv) must be (192, 128) or (128, 128), got (" + std::to_string(s.Dk) + ", " +
         std::to_string(s.Dv) + ")");
  if (s.cu_seqlens) {
    if (s.B != 1 || s.N < 1 || s.cu_seqlens[0] != 0 || s.cu_seqlens[s.N] != s.T) check.fail("bad cu_seqlens");
    for (int64_t n = 0; n < s.N; ++n)
      if (s.cu_seqlens[n + 1] < s.cu_seqlens[n]) check.fail("cu_seqlens decreases");
  }
  if (s.B * s.T * std::max(s.H, Hkv) * s.Dk >= (int64_t(1) << 31)) check.fail("problem too large for 32-bit row indices");
}

constexpr BwdKernel kDefaultBwd = BwdKernel::Wgmma;

float scale_of(const AttnShape& s) { return s.scale > 0 ? s.scale : float(1.0 / std::sqrt(double(s.Dk))); }

}  // namespace

void attention_forward(const AttnShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                       void* stream) {
  check_shape(s);
  if (s.B * s.T == 0) return;
  cu::keep_freed_memory_in_pool();  // scratch freed below stays in the pool for the next call
  const int64_t Hkv = s.Hkv > 0 ? s.Hkv : s.H;
  const Tables& tb = tables(s, 128, false);
  detail::FwdParams p{};
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  p.seq_start = tb.seq_start, p.tiles = tb.tiles;
  p.H = int(s.H), p.G = int(s.H / Hkv);
  p.head_group = std::min(head_group(false), p.H);
  p.sq = s.H * s.Dk, p.sk = Hkv * s.Dk, p.sv = Hkv * s.Dv, p.so = s.H * s.Dv;
  p.scale_log2 = scale_of(s) * 1.4426950408889634f;
  auto st = cu::stream(stream);
  if (tb.ntiles > 0) {
    if (s.fwd_kernel == FwdKernel::Mma) detail::launch_fwd(p, int(s.Dk), int(s.Dv), tb.ntiles, st);
    else detail::launch_fwd_wgmma(p, int(s.Dk), s.B * s.T, s.B * s.T, int(Hkv), tb.ntiles, st);
  }
  check(cudaGetLastError(), "attention forward launch");
}

void attention_backward(const AttnShape& s_in, const void* q, const void* k, const void* v, const void* o,
                        const float* lse, const void* do_, void* dq, void* dk, void* dv, void* stream) {
  AttnShape s = s_in;
  if (s.bwd_kernel == BwdKernel::Auto) s.bwd_kernel = kDefaultBwd;
  check_shape(s);
  const int64_t rows = s.B * s.T;
  if (rows == 0) return;
  cu::keep_freed_memory_in_pool();  // scratch freed below stays in the pool for the next call
  const int64_t Hkv = s.Hkv > 0 ? s.Hkv : s.H;
  auto st = cu::stream(stream);
  const bool wide = s.bwd_kernel == BwdKernel::Wgmma;  // 128-key blocks (the mma.sync kernel takes 64)
  const Tables& tb = tables(s, wide ? 128 : 64, true);
  // Scratch: lse2, D [H, rows] (+64: the statistics loads of a tile may run past the last row), and the fp32
  // dQ accumulator [H, rows + 64, Dk] (+64 rows: a tile's bulk reductions stay inside its head's block).
  const size_t nstat = size_t(s.H * rows + 64 + 3) & ~size_t(3), nacc = size_t(s.H * (rows + 64) * s.Dk);  // 16-byte aligned
  void* base = nullptr;
  check(cu::malloc_async(&base, (2 * nstat + nacc) * sizeof(float), st), "scratch allocation");
  float* lse2 = static_cast<float*>(base);
  float* D = lse2 + nstat;
  float* acc = D + nstat;
  check(cudaMemsetAsync(acc, 0, nacc * sizeof(float), st), "dq accumulator");
  detail::launch_bwd_pre(o, do_, lse, lse2, D, int(rows), int(s.H), int(s.Dv), st);
  detail::BwdParams p{};
  p.q = q, p.k = k, p.v = v, p.dout = do_, p.lse2 = lse2, p.D = D, p.dqacc = acc, p.dk = dk, p.dv = dv;
  p.seq_start = tb.seq_start, p.tiles = tb.tiles;
  p.H = int(s.H), p.G = int(s.H / Hkv), p.Hkv = int(Hkv), p.rows = int(rows);
  p.head_group = std::min(head_group(true), p.Hkv);
  p.sq = s.H * s.Dk, p.sk = Hkv * s.Dk, p.sv = Hkv * s.Dv, p.sdo = s.H * s.Dv;
  p.scale = scale_of(s), p.scale_log2 = p.scale * 1.4426950408889634f;
  if (tb.ntiles > 0) {
    if (s.bwd_kernel == BwdKernel::Mma) detail::launch_bwd(p, int(s.Dk), int(s.Dv), tb.ntiles, st);
    else detail::launch_bwd_wgmma(p, int(s.Dk), tb.ntiles, st);
  }
  detail::launch_dq_convert(acc, dq, int(rows), int(s.H), int(s.Dk), st);
  check(cudaGetLastError(), "attention backward launch");
  check(cudaFreeAsync(base, st), "scratch free");
}

// The combine kernel holds one weight per split in shared memory.
constexpr int kMaxDecodeSplits = 8192;

void mla_decode(const DecodeShape& s, const void* q_lat, const void* q_rope, const void* cache, void* o_lat,
                float* lse, void* stream) {
  if (s.R != 512 || s.Dr != 64) check.fail("decode supports R = 512, Dr = 64 only");
  const int64_t ldc = s.ldc > 0 ? s.ldc : s.R + s.Dr;
  if (s.H < 1 || s.Tc < 1 || ldc < s.R + s.Dr || ldc % 8) check.fail("bad decode shape");
  cu::keep_freed_memory_in_pool();
  const int sms = cu::sm_count();
  auto st = cu::stream(stream);
  const int MH = detail::decode_heads_per_block(s.H), HG = int((s.H + MH - 1) / MH);
  const int ntiles = int((s.Tc + 63) / 64);
  int splits = s.splits > 0 ? s.splits : std::max(1, sms / HG);
  splits = std::min({splits, ntiles, kMaxDecodeSplits});
  const int tps = (ntiles + splits - 1) / splits;
  splits = (ntiles + tps - 1) / tps;
  detail::DecParams p{};
  p.q_lat = q_lat, p.q_rope = q_rope, p.cache = cache;
  p.H = int(s.H), p.Tc = int(s.Tc), p.ldc = int(ldc), p.splits = splits, p.tiles_per_split = tps;
  p.scale_log2 = (s.scale > 0 ? s.scale : float(1.0 / std::sqrt(192.0))) * 1.4426950408889634f;
  void* base = nullptr;
  const size_t n_o = size_t(splits) * s.H * 512, n_ml = size_t(splits) * 2 * s.H;
  check(cu::malloc_async(&base, (n_o + n_ml) * sizeof(float), st), "decode scratch");
  p.part_o = static_cast<float*>(base);
  p.part_ml = p.part_o + n_o;
  detail::launch_decode(p, st);
  detail::launch_decode_combine(p, o_lat, lse, st);
  check(cudaGetLastError(), "decode launch");
  check(cudaFreeAsync(base, st), "decode scratch free");
}

int mla_decode_paged_splits(const PagedDecodeShape& s) {
  if (s.splits > kMaxDecodeSplits) check.fail("paged decode: at most " + std::to_string(kMaxDecodeSplits) + " splits");
  if (s.splits > 0) return s.splits;
  const int MH = detail::decode_heads_per_block(s.H), HG = int((s.H + MH - 1) / MH);
  const int64_t want = (2 * cu::sm_count() + HG * s.S - 1) / (HG * s.S);  // two waves of blocks
  return int(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, (s.max_tokens + 63) / 64)));
}

size_t mla_decode_paged_workspace(const PagedDecodeShape& s) {
  return size_t(s.S) * mla_decode_paged_splits(s) * s.H * (512 + 2) * sizeof(float);
}

void mla_decode_paged(const PagedDecodeShape& s, const void* q_lat, const void* q_rope, const void* pool,
                      const int32_t* table, const int32_t* lens, void* o_lat, void* workspace, void* stream) {
  if (s.R != 512 || s.Dr != 64) check.fail("decode supports R = 512, Dr = 64 only");
  const int64_t ldc = s.ldc > 0 ? s.ldc : s.R + s.Dr;
  const int64_t ldqr = s.ldqr > 0 ? s.ldqr : s.Dr;
  if (s.S < 1 || s.H < 1 || s.max_tokens < 1 || s.table_ld < (s.max_tokens + 63) / 64 || ldc < s.R + s.Dr || ldc % 8 ||
      ldqr < s.Dr || ldqr % 8 || reinterpret_cast<uintptr_t>(q_rope) % 16)
    check.fail("bad paged decode shape (or q_rope not 16-byte aligned)");
  if (!table || !lens || !workspace) check.fail("paged decode needs a block table, lengths and a workspace");
  detail::DecParams p{};
  p.q_lat = q_lat, p.q_rope = q_rope, p.cache = pool;
  p.H = int(s.H), p.ldc = int(ldc), p.ldqr = int(ldqr), p.splits = mla_decode_paged_splits(s);
  p.scale_log2 = (s.scale > 0 ? s.scale : float(1.0 / std::sqrt(192.0))) * 1.4426950408889634f;
  p.S = int(s.S), p.table = table, p.table_ld = s.table_ld, p.lens = lens, p.len_add = s.len_add;
  p.part_o = static_cast<float*>(workspace);
  p.part_ml = p.part_o + size_t(s.S) * p.splits * s.H * 512;
  auto st = cu::stream(stream);
  detail::launch_decode(p, st);
  detail::launch_decode_combine(p, o_lat, nullptr, st);
  check(cudaGetLastError(), "paged decode launch");
}

}  // namespace lm::ops::cuda

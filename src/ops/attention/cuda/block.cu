// Chunked prefill building blocks (attention_cuda.hpp): one query chunk against one key block of the same
// sequence (the wgmma forward of fwd_wgmma.cu in block mode), and the log-sum-exp merge of the partials.
//
// Legend: Tq queries at positions [q_pos0, q_pos0 + Tq), Tk keys at [k_pos0, k_pos0 + Tk), H query heads, Hkv kv
//         heads, Dk/Dv head dims, delta = q_pos0 − k_pos0 (query row i sees key row j iff j <= i + delta),
//         rows the query rows of a merge, n = rows·H (row, head) pairs.
// Merge of two partials (o_a, l_a), (o_b, l_b) of disjoint key sets, l = natural-log softmax denominators:
//   l = m + log(e^(l_a − m) + e^(l_b − m)), m = max(l_a, l_b);  o = (e^(l_a − l) o_a + e^(l_b − l) o_b).
// Both empty (l_a = l_b = −inf): l = −inf, o unchanged (0). No scratch, no host-device copies: capturable.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/env.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"
#include "ops/attention/cuda/kernels.hpp"

namespace lm::ops::cuda {

namespace detail {

namespace {

constexpr int kMergeThreads = 256;  // 8 warps, one (row, head) pair each per step

// One warp per (row, head) pair i; lane l takes columns [4l, 4l + 4) + 128·k. lse values are read by lane 0 and
// broadcast, so its write of lse_acc[i] races with no other lane's read.
__global__ void __launch_bounds__(kMergeThreads) attn_merge_kernel(int64_t n, int Dv, const __nv_bfloat16* o_part,
                                                                   const float* lse_part, float* o_acc,
                                                                   float* lse_acc, bool first) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kMergeThreads / 32);
  for (int64_t i = int64_t(blockIdx.x) * (kMergeThreads / 32) + threadIdx.x / 32; i < n; i += warps) {
    float lp = 0.f, la = 0.f;
    if (lane == 0) lp = lse_part[i], la = first ? -INFINITY : lse_acc[i];
    lp = __shfl_sync(0xffffffffu, lp, 0);
    la = __shfl_sync(0xffffffffu, la, 0);
    // o = wa·o_acc + wp·o_part, lse = l.
    float wa, wp, l;
    const float m = fmaxf(la, lp);
    if (first) {
      wa = 0.f, wp = 1.f, l = lp;
    } else if (m == -INFINITY) {  // neither saw a key
      wa = 1.f, wp = 0.f, l = -INFINITY;
    } else {
      const float ea = expf(la - m), ep = expf(lp - m), sum = ea + ep;  // exp(−inf) = 0; sum >= 1
      wa = ea / sum, wp = ep / sum, l = m + logf(sum);
    }
    const __nv_bfloat16* op = o_part + i * Dv;
    float* oa = o_acc + i * Dv;
    for (int c = 4 * lane; c < Dv; c += 128) {
      const uint2 u = *reinterpret_cast<const uint2*>(op + c);
      const float2 p01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 p23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      float4 r;
      if (wa == 0.f) {  // first, or nothing in the accumulator yet: o_acc is not read
        r = make_float4(wp * p01.x, wp * p01.y, wp * p23.x, wp * p23.y);
      } else {
        const float4 a = *reinterpret_cast<const float4*>(oa + c);
        r = make_float4(wa * a.x + wp * p01.x, wa * a.y + wp * p01.y, wa * a.z + wp * p23.x, wa * a.w + wp * p23.y);
      }
      *reinterpret_cast<float4*>(oa + c) = r;
    }
    if (lane == 0) lse_acc[i] = l;
  }
}

__global__ void attn_merge_finish_kernel(int64_t count4, const float4* o_acc, uint2* o) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count4; i += stride) {
    const float4 a = o_acc[i];
    const __nv_bfloat162 lo = __floats2bfloat162_rn(a.x, a.y), hi = __floats2bfloat162_rn(a.z, a.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&lo);
    u.y = *reinterpret_cast<const uint32_t*>(&hi);
    o[i] = u;
  }
}

int grid_for(int64_t items, int per_block) {
  return int(std::clamp<int64_t>((items + per_block - 1) / per_block, 1, int64_t(1) << 20));
}

}  // namespace

void launch_attn_merge(int64_t n, int Dv, const void* o_part, const float* lse_part, float* o_acc, float* lse_acc,
                       bool first, cudaStream_t s) {
  attn_merge_kernel<<<grid_for(n, kMergeThreads / 32), kMergeThreads, 0, s>>>(
      n, Dv, static_cast<const __nv_bfloat16*>(o_part), lse_part, o_acc, lse_acc, first);
}

void launch_attn_merge_finish(int64_t count, const float* o_acc, void* o, cudaStream_t s) {
  attn_merge_finish_kernel<<<grid_for(count / 4, 256), 256, 0, s>>>(count / 4, reinterpret_cast<const float4*>(o_acc),
                                                                      static_cast<uint2*>(o));
}

}  // namespace detail

namespace {

constexpr cu::Checker check{"attention cuda"};
constexpr int64_t kMaxPos = int64_t(1) << 30;  // positions and counts stay far inside the kernels' 32-bit ints

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }
std::string str(int64_t x) { return std::to_string(x); }

void check_merge(const char* who, int64_t rows, int64_t H, int64_t Dv) {
  if (rows < 0 || H < 1 || Dv < 4 || Dv % 4 || Dv > 65536)
    check.fail(std::string(who) + ": need rows >= 0, H >= 1 and Dv a multiple of 4 in [4, 65536], got rows " +
               str(rows) + ", H " + str(H) + ", Dv " + str(Dv));
}

}  // namespace

void attention_forward_block(const BlockShape& s, const void* q, const void* k, const void* v, void* o, float* lse,
                             void* stream) {
  const std::string who = "attention_forward_block: ";
  const int64_t Hkv = s.Hkv > 0 ? s.Hkv : s.H;
  if (s.Tq < 1 || s.Tk < 1) check.fail(who + "Tq and Tk must be >= 1, got Tq " + str(s.Tq) + ", Tk " + str(s.Tk));
  if (s.q_pos0 < 0 || s.k_pos0 < 0)
    check.fail(who + "positions must be >= 0, got q_pos0 " + str(s.q_pos0) + ", k_pos0 " + str(s.k_pos0));
  if (s.q_pos0 + s.Tq > kMaxPos || s.k_pos0 + s.Tk > kMaxPos)
    check.fail(who + "positions past 2^30 (q_pos0 + Tq " + str(s.q_pos0 + s.Tq) + ", k_pos0 + Tk " +
               str(s.k_pos0 + s.Tk) + ")");
  if (s.H < 1 || Hkv < 1 || s.H % Hkv)
    check.fail(who + "heads H " + str(s.H) + " must be a positive multiple of Hkv " + str(Hkv));
  if (!((s.Dk == 192 && s.Dv == 128) || (s.Dk == 128 && s.Dv == 128)))
    check.fail(who + "head dims (Dk, Dv) must be (192, 128) or (128, 128), got (" + str(s.Dk) + ", " + str(s.Dv) +
               ")");
  if (!q || !k || !v || !o || !lse) check.fail(who + "q, k, v, o and lse are all required");
  if (!aligned(q, 16) || !aligned(k, 16) || !aligned(v, 16) || !aligned(o, 16) || !aligned(lse, 4))
    check.fail(who + "q, k, v and o must be 16-byte aligned");
  const int64_t ntiles = (s.Tq + 127) / 128;
  if (ntiles * s.H >= (int64_t(1) << 31)) check.fail(who + "too many query tiles × heads for one grid");

  detail::FwdParams p{};
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  p.seq_start = nullptr, p.tiles = nullptr;  // block mode
  p.H = int(s.H), p.G = int(s.H / Hkv);
  static const int group_env = env::attn_head_group();  // as attention_forward: groups of 4 heads by default
  p.head_group = std::min(group_env > 0 ? group_env : 4, p.H);
  p.sq = s.H * s.Dk, p.sk = Hkv * s.Dk, p.sv = Hkv * s.Dv, p.so = s.H * s.Dv;
  const float scale = s.scale > 0 ? s.scale : float(1.0 / std::sqrt(double(s.Dk)));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.q_len = int(s.Tq), p.k_len = int(s.Tk), p.delta = int(s.q_pos0 - s.k_pos0);
  detail::launch_fwd_wgmma(p, int(s.Dk), s.Tq, s.Tk, int(Hkv), int(ntiles), cu::stream(stream));
  check(cudaGetLastError(), "attention_forward_block launch");
}

void attention_merge(int64_t rows, int64_t H, int64_t Dv, const void* o_part, const float* lse_part, float* o_acc,
                     float* lse_acc, bool first, void* stream) {
  check_merge("attention_merge", rows, H, Dv);
  if (rows == 0) return;
  if (!o_part || !lse_part || !o_acc || !lse_acc) check.fail("attention_merge: all four tensors are required");
  if (!aligned(o_part, 8) || !aligned(o_acc, 16) || !aligned(lse_part, 4) || !aligned(lse_acc, 4))
    check.fail("attention_merge: o_part must be 8-byte and o_acc 16-byte aligned");
  detail::launch_attn_merge(rows * H, int(Dv), o_part, lse_part, o_acc, lse_acc, first, cu::stream(stream));
  check(cudaGetLastError(), "attention_merge launch");
}

void attention_merge_finish(int64_t rows, int64_t H, int64_t Dv, const float* o_acc, void* o, void* stream) {
  check_merge("attention_merge_finish", rows, H, Dv);
  if (rows == 0) return;
  if (!o_acc || !o) check.fail("attention_merge_finish: o_acc and o are required");
  if (!aligned(o_acc, 16) || !aligned(o, 8))
    check.fail("attention_merge_finish: o_acc must be 16-byte and o 8-byte aligned");
  detail::launch_attn_merge_finish(rows * H * Dv, o_acc, o, cu::stream(stream));
  check(cudaGetLastError(), "attention_merge_finish launch");
}

}  // namespace lm::ops::cuda

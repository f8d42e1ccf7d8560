#pragma once
// Hopper (sm_90a) building blocks shared by the grouped expert GEMMs (ops/moe/cuda), the attention kernels
// (ops/attention/cuda) and the KDA warpgroup recurrences (ops/kda/cuda): mbarriers, named barriers (and the
// two-warpgroup ping-pong on them), TMA tile loads, bulk copies and reductions out of shared memory. The
// warpgroup MMAs are in wgmma.cuh, the host side of TMA (tensor maps) in tensor_map.hpp.
//
// Shared-memory tiles are [rows][64] bf16 (128-byte rows) written by TMA with the 128-byte swizzle (16-byte
// chunk c of row r lands at chunk c ^ (r % 8)), the layout the wgmma descriptors read.
#include <cuda.h>  // CUtensorMap (types only; the encoder is fetched through the runtime)

#include <cstdint>

#include "core/cuda/mma.cuh"  // smem_u32

namespace lm::cu {

// ---- mbarrier ------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits for the phase of parity `phase` to complete (a fresh barrier counts its phase "1" as complete).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(phase)
        : "memory");
  } while (!done);
}

// ---- named barriers (id 0 is __syncthreads'; the thread count is an immediate) --------------------------
template <int THREADS>
__device__ __forceinline__ void named_bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void named_bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(THREADS) : "memory");
}

// Ping-pong of two compute warpgroups (c = 0, 1) over their MMA issue: named barrier 1 + c is warpgroup c's turn
// (256 threads: its own 128 wait, the other's 128 arrive). A warpgroup waits for its turn, issues, and hands the
// turn over at once, so one's elementwise work runs under the other's products. Warpgroup 1 opens with warpgroup
// 0's first turn and warpgroup 0 absorbs the one surplus arrival at the end, so the hand-over never sits under a
// branch (one made ptxas spill and serialise the MMAs of the Dk = 192 attention backward).
__device__ __forceinline__ void pingpong_open(int c) {
  if (c == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
}
__device__ __forceinline__ void pingpong_wait_turn(int c) { named_bar_sync<256>(1 + c); }
__device__ __forceinline__ void pingpong_pass_turn(int c) { named_bar_arrive<256>(2 - c); }
__device__ __forceinline__ void pingpong_close(int c) {
  if (c == 0) asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

// ---- bulk copies out of shared memory (the async proxy) -------------------------------------------------
// Generic-proxy shared-memory writes become visible to TMA, bulk copies and wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// dst[0 .. bytes) += src (fp32 add in L2), dst = src: per-row bulk copies of this thread's group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_store(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The thread's committed bulk groups have read their shared memory (it may be rewritten) / are complete.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---- TMA tile loads into shared memory, completing on `bar` ---------------------------------------------
// 2-D tile (x = column in elements, y = row).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x), "r"(y)
      : "memory");
}
// 3-D tile (x = element in the row, y = head, z = row) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}

}  // namespace lm::cu

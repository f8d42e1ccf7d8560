#pragma once
// Internal: launchers of the KDA kernels (one .cu each), called by api.cu.
#include <cuda_runtime.h>

#include "ops/kda/cuda/common.cuh"

namespace lm::kda::cuda::detail {

// kernel<<<grid, block, smem, s>>>(p). With p.started (an event created with timing disabled), the launch records
// it as a programmatic event triggered at the start of every block: it fires once all of the kernel's blocks have
// begun, so work that another stream queues behind it runs beside the kernel without delaying its blocks.
inline void launch_recurrence(void (*kernel)(OpParams), dim3 grid, int threads, size_t smem, cudaStream_t s,
                              const OpParams& p) {
  if (!p.started) {
    kernel<<<grid, threads, smem, s>>>(p);
    return;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = dim3(threads), cfg.dynamicSmemBytes = smem, cfg.stream = s;
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeProgrammaticEvent;
  at.val.programmaticEvent.event = static_cast<cudaEvent_t>(p.started);
  at.val.programmaticEvent.flags = 0;
  at.val.programmaticEvent.triggerAtBlockStart = 1;
  cfg.attrs = &at, cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, p);
}

// K1, per (chunk, head): gate, cumsum, L2 norms, A_qk, A_kk, M = (I + A_kk)^-1, W, U, Qg, Kd, Γ_last
// (and M, P_kk for the backward when `bwd`). stop 1 / 2 (forward, benchmarks): end before / after the A tiles;
// 3: after the diagonal tiles alone.
void launch_prep(const OpParams& p, int KP, bool bounded, bool gate_f32, bool bwd, cudaStream_t s, int stop = 0);
// K2, per (sequence, head, value group of 16*NW columns): the chunk recurrence. mode 0: O and ht (fp16
// products, after a forward prep); mode 1: the state at every chunk start (S0) and E, for the backward; mode 2:
// both, after a backward prep (bf16 products: S0 and E equal mode 1's, kept for a later backward).
void launch_recur_fwd(const OpParams& p, int KP, int NW, int N, int mode, cudaStream_t s);
// The same with warpgroup MMAs (recur_wgmma.cu) when K = V = 128 and NW is 4 or 8; false: not handled.
bool launch_recur_fwd_wgmma(const OpParams& p, int NW, int N, int mode, cudaStream_t s);
// Reverse recurrence of dS (SPEC §2.2): dS at every chunk end, dE, dh0.
void launch_recur_bwd(const OpParams& p, int KP, int NW, int N, cudaStream_t s);
bool launch_recur_bwd_wgmma(const OpParams& p, int NW, int N, cudaStream_t s);  // as launch_recur_fwd_wgmma
// Whether the recurrences of a K x V problem run on the warpgroup kernels (given 4 or 8 warps per block).
bool wgmma_recurrences(int K, int V);
// Per (chunk, head): every gradient of the chunk from S0, dS, E, dE; partial dA_log / ddt_bias sums.
void launch_chunk_bwd(const OpParams& p, int KP, bool bounded, bool gate_f32, cudaStream_t s);
// dA_log, ddt_bias from the per-chunk partial sums.
void launch_reduce(const OpParams& p, int KP, cudaStream_t s);
// Single-token decode.
void launch_decode(float* state, const OpParams& p, int64_t S, int KP, bool gate_f32, cudaStream_t s);

}  // namespace lm::kda::cuda::detail

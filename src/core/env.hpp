#pragma once
// The LONGMOE_* environment switches, all in one place: one function per switch, with its meaning, its
// default and the code that reads it. Nothing else calls getenv for a LONGMOE_* name; code that sets one
// (benchmarks and tests comparing variants) uses the name constants below.
//
// Each function reads the environment when it is called. Most readers keep the answer in a function-local
// static (once per process: set the switch before the first call); the grouped-GEMM overrides are read on every
// launch so a benchmark or test can change them between calls. The switches are for A/B runs, tuning and tests:
// the defaults are the measured best and what production runs use.
//
// Not here: the variables the scripts read (LONGMOE_BUILD_DIR, LONGMOE_JOBS, LONGMOE_CMAKE_ARGS, ... in
// scripts/ and .ci/), and the CMake options and compile definitions (LONGMOE_CUDA, LONGMOE_HAVE_CUDA, ...).
//
// Plain C++17 without fmt: the CUDA sources (nvcc) include it too.
#include <cstdint>
#include <cstdlib>
#include <string>

namespace lm::env {

// ---- names --------------------------------------------------------------------------------------------
inline constexpr const char* kOverlap = "LONGMOE_OVERLAP";
inline constexpr const char* kKdaSave = "LONGMOE_KDA_SAVE";
inline constexpr const char* kMoeWgradCublas = "LONGMOE_MOE_WGRAD_CUBLAS";
inline constexpr const char* kAttnResDefer = "LONGMOE_ATTNRES_DEFER";
inline constexpr const char* kGemmCublas = "LONGMOE_GEMM_CUBLAS";
inline constexpr const char* kAttnHeadGroup = "LONGMOE_ATTN_HEAD_GROUP";
inline constexpr const char* kAttnFwdMode = "LONGMOE_ATTN_FWD_MODE";
inline constexpr const char* kAttnBwdMode = "LONGMOE_ATTN_BWD_MODE";
inline constexpr const char* kAttnBwdDqAtomic = "LONGMOE_ATTN_BWD_DQ_ATOMIC";
inline constexpr const char* kKdaRecurMma = "LONGMOE_KDA_RECUR_MMA";
inline constexpr const char* kGgOrder = "LONGMOE_GG_ORDER";
inline constexpr const char* kGgEpi = "LONGMOE_GG_EPI";
inline constexpr const char* kGgBn = "LONGMOE_GG_BN";
inline constexpr const char* kMoeFewRows = "LONGMOE_MOE_FEW_ROWS";
inline constexpr const char* kGemmFewRows = "LONGMOE_GEMM_FEW_ROWS";
inline constexpr const char* kGemmFewRowsMma = "LONGMOE_GEMM_FEW_ROWS_MMA";
inline constexpr const char* kPdl = "LONGMOE_PDL";
inline constexpr const char* kPoisonScratch = "LONGMOE_POISON_SCRATCH";
inline constexpr const char* kCrashInSaveAtStep = "LONGMOE_CRASH_IN_SAVE_AT_STEP";
inline constexpr const char* kNccl = "LONGMOE_NCCL";
inline constexpr const char* kDpBucketMb = "LONGMOE_DP_BUCKET_MB";
inline constexpr const char* kNoReexec = "LONGMOE_NO_REEXEC";
inline constexpr const char* kPeerScript = "LONGMOE_PEER_SCRIPT";
inline constexpr const char* kGoldenDir = "LONGMOE_GOLDEN_DIR";
inline constexpr const char* kBrownDir = "LONGMOE_BROWN_DIR";
inline constexpr const char* kRequireNodeSdk = "LONGMOE_REQUIRE_NODE_SDK";

namespace detail {
inline const char* raw(const char* name) { return std::getenv(name); }
// The switch's first character is `c` ("1" turns an off-by-default switch on, "0" an on-by-default one off).
inline bool first_is(const char* name, char c) {
  const char* v = raw(name);
  return v && v[0] == c;
}
// atoi of the value, or `fallback` when the switch is unset.
inline int int_or(const char* name, int fallback) {
  const char* v = raw(name);
  return v ? std::atoi(v) : fallback;
}
// The value, or `fallback` when unset or empty.
inline std::string str_or(const char* name, const std::string& fallback) {
  const char* v = raw(name);
  return v && *v ? std::string(v) : fallback;
}
}  // namespace detail

// ---- GPU training step (model/cuda/gpu_model.cpp) ----------------------------------------------------------

// LONGMOE_OVERLAP=0: run the KDA core and the MoE pieces on the main stream instead of a high-priority side
// stream beside the projections. Default on.
inline bool overlap() { return !detail::first_is(kOverlap, '0'); }
// LONGMOE_KDA_SAVE=0: the training forward does not keep the KDA core's tensors for the backward (the backward
// recomputes them). Default on (kept where they fit).
inline bool kda_save() { return !detail::first_is(kKdaSave, '0'); }
// LONGMOE_MOE_WGRAD_CUBLAS=1: expert weight gradients as per-expert cuBLAS products on side streams instead of
// the grouped wgrad kernel (ops/moe/cuda/wgrad.cu). Default off.
inline bool moe_wgrad_cublas() { return detail::first_is(kMoeWgradCublas, '1'); }
// LONGMOE_ATTNRES_DEFER=0: every AttnRes read updates its closed blocks' gradients itself instead of one deferred
// update per block group (ops/attnres/cuda, attnres_flush). Default on.
inline bool attnres_defer() { return !detail::first_is(kAttnResDefer, '0'); }

// ---- CUDA kernels (ops/*/cuda) ----------------------------------------------------------------------------

// LONGMOE_GEMM_CUBLAS=1: dense GEMMs through cublasGemmEx instead of cuBLASLt (ops/gemm/cuda/gemm.cu). Default
// off (cuBLASLt).
inline bool gemm_cublas() { return detail::first_is(kGemmCublas, '1'); }
// LONGMOE_ATTN_HEAD_GROUP=N (N > 0): heads per scheduling group of the attention kernels, forward and backward
// (ops/attention/cuda/api.cu). 0 or unset: the defaults (4 forward, 1 backward).
inline int attn_head_group() { return detail::int_or(kAttnHeadGroup, 0); }
// LONGMOE_ATTN_FWD_MODE (0..3): the wgmma attention forward's variant, bit 0 intra-warpgroup overlap, bit 1
// two-warpgroup ping-pong (ops/attention/cuda/fwd_wgmma.cu). Default 3 (both).
inline int attn_fwd_mode() { return detail::int_or(kAttnFwdMode, 3) & 3; }
// LONGMOE_ATTN_BWD_MODE: the wgmma attention backward's schedule (ops/attention/cuda/bwd_wgmma.cu): 0 the
// serial order for both head dims, 3 the four-turn ping-pong for Dk = 192. Unset (-1): ping-pong for Dk = 128,
// serial for Dk = 192.
inline int attn_bwd_mode() { return detail::int_or(kAttnBwdMode, -1); }
// LONGMOE_ATTN_BWD_DQ_ATOMIC=1: the wgmma attention backward adds dQ by 16-byte vector atomics from registers
// instead of bulk reductions out of shared memory (ops/attention/cuda/bwd_wgmma.cu). Default off.
inline bool attn_bwd_dq_atomic() { return detail::first_is(kAttnBwdDqAtomic, '1'); }
// LONGMOE_KDA_RECUR_MMA=1: the KDA chunk recurrences stay on the mma.sync kernels (recur.cu) for K = V = 128
// instead of the warpgroup ones (ops/kda/cuda/recur_wgmma.cu). Default off.
inline bool kda_recur_mma() { return detail::first_is(kKdaRecurMma, '1'); }
// LONGMOE_GG_ORDER (0: m outer, 1: per expert n outer): the grouped expert GEMM's tile order
// (ops/moe/cuda/gemm.cu; read at every launch). Unset: `fallback`, the kernel's default.
inline int gg_order(int fallback) { return detail::int_or(kGgOrder, fallback); }
// LONGMOE_GG_EPI (0: direct stores, 1: staged through shared memory): the grouped expert GEMM's epilogue
// (ops/moe/cuda/gemm.cu; read at every launch). Unset: `fallback`, the kernel's default.
inline int gg_epi(int fallback) { return detail::int_or(kGgEpi, fallback); }
// LONGMOE_GG_BN=256: the plain grouped GEMM keeps 256-row weight tiles where 192-row ones would pad N less
// (ops/moe/cuda/gemm.cu; read at every launch). Default: the tile that pads less.
inline bool gg_bn256() { return detail::int_or(kGgBn, 0) == 256; }
// LONGMOE_MOE_FEW_ROWS=0: the GPU model's decode steps take the wgmma expert GEMMs (ops/moe/cuda/gemm.cu)
// instead of the few-row ones (few_rows.cu; benchmarks). Read when a decode step is built. Default on.
inline bool moe_few_rows() { return !detail::first_is(kMoeFewRows, '0'); }
// LONGMOE_GEMM_FEW_ROWS=N (0..8): dense products x · Wᵀ of at most N rows go to the few-row kernel
// (ops/gemm/cuda/few_rows.cu), the others to cuBLAS; 0: cuBLAS for all. Default 1: a batch-1 decode step (48B shape,
// H100: +5% tokens/s at batch 1, equal at 2, -10% at 4 and -19% at 8, where its CUDA-core products fall behind).
// With 8 a row's bits do not depend on the batch (1..8) it is decoded in.
inline int gemm_few_rows() { return detail::int_or(kGemmFewRows, 1); }
// LONGMOE_GEMM_FEW_ROWS_MMA=1: the few-row product runs on tensor cores (mma.sync over 16 weight rows × the rows of
// x) instead of CUDA cores (ops/gemm/cuda/few_rows.cu; read at every launch, so a test can take both). Default off
// until measured.
inline bool gemm_few_rows_mma() { return detail::first_is(kGemmFewRowsMma, '1'); }
// LONGMOE_PDL=0: kernels that support programmatic dependent launch (core/cuda/pdl.cuh) are launched plainly, each
// starting only after the previous kernel on its stream has ended. Default on.
inline bool pdl() { return !detail::first_is(kPdl, '0'); }
// LONGMOE_POISON_SCRATCH=1: every stream-ordered scratch block (cu::malloc_async, core/cuda/device.hpp) is filled
// with 0xFF bytes before use, so a kernel reading scratch it did not write shows up (a debugging aid). Default off.
inline bool poison_scratch() { return detail::first_is(kPoisonScratch, '1'); }

// ---- training (train/trainer.cpp) -------------------------------------------------------------------------

// LONGMOE_CRASH_IN_SAVE_AT_STEP=N: test hook, abort() in the middle of the checkpoint save of global step N
// (after the weights, before the rename), as a kill would. Unset: -1 (never).
inline int64_t crash_in_save_at_step() {
  const char* v = detail::raw(kCrashInSaveAtStep);
  return v ? std::atoll(v) : -1;
}

// LONGMOE_NCCL=1: the GPU trainer takes the data-parallel path over NCCL (train/cuda/data_parallel.hpp) also in a job
// of one process (tests: world size 1 through NCCL). Read when an engine is made. Default off: only jobs of several.
inline bool nccl() { return detail::first_is(kNccl, '1'); }
// LONGMOE_DP_BUCKET_MB=N: MiB of fp32 gradients per bucket that the GPU trainer's data parallel reduces at once while
// the backward goes on (train/cuda/data_parallel.hpp). Read when an engine is made. Default 32.
inline int dp_bucket_mb() { return detail::int_or(kDpBucketMb, 32); }

// ---- the CLI (apps/longmoe, bench/) ------------------------------------------------------------------------

// LONGMOE_NO_REEXEC (set, any value): the CLI does not re-execute itself with OMP_WAIT_POLICY=passive and
// OPENBLAS_CORETYPE=SkylakeX (apps/longmoe/main.cpp). Default: re-exec when one of them would change.
inline bool no_reexec() { return detail::raw(kNoReexec) != nullptr; }
// LONGMOE_PEER_SCRIPT=PATH: the PyTorch peer driver of `longmoe bench attention|moe --device cuda --peer`
// (bench/verbs/cuda.cpp). Unset: `fallback`, bench/peer_attention_moe.py of the source tree.
inline std::string peer_script(const std::string& fallback) {
  const char* v = detail::raw(kPeerScript);
  return v ? std::string(v) : fallback;
}

// ---- tests (tests/) ------------------------------------------------------------------------------------------

// LONGMOE_GOLDEN_DIR=DIR: the golden vectors (tests/testing.hpp). Unset or empty: `fallback`, ../shared/golden.
inline std::string golden_dir(const std::string& fallback) { return detail::str_or(kGoldenDir, fallback); }
// LONGMOE_BROWN_DIR=DIR: the Brown corpus for the tests that read it (tests/io). Unset or empty: `fallback`.
inline std::string brown_dir(const std::string& fallback) { return detail::str_or(kBrownDir, fallback); }
// LONGMOE_REQUIRE_NODE_SDK=1: the OpenAI Node SDK test (tests/serve/test_openai_sdk.cpp) fails instead of skipping
// when node, npm or the SDK is missing (.ci/run sets it). Default: it skips and says why.
inline bool require_node_sdk() { return detail::first_is(kRequireNodeSdk, '1'); }

}  // namespace lm::env

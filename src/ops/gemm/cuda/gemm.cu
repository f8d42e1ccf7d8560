// Dense bf16 GEMMs through cuBLAS (row-major wrapper): the model's linear layers and the chunked LM head.
// x · Wᵀ of one row (a batch-1 decode step; LONGMOE_GEMM_FEW_ROWS up to 8) goes to the few-row kernel (few_rows.cu).
// On the calling thread's main handle the product goes through cuBLASLt with the algorithm picked per problem
// (shape, strides, transposes, output type, beta = 0 or not, operand alignments) by timing cuBLASLt's top
// heuristic candidates once, on a scratch output; cublasGemmEx's default choice trailed the best candidate on
// the model's projection shapes. LONGMOE_GEMM_CUBLAS=1 keeps cublasGemmEx (A/B runs); the grouped side streams
// always use it (their concurrent products would share one cuBLASLt workspace).
//
// Legend: row-major C [M, N] = op(A) [M, K] · op(B) [K, N]. cuBLAS is column-major, and a row-major matrix
// read column-major is its transpose, so the row-major product C = op(A)·op(B) is computed as the
// column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap places and keep their transpose flags.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/env.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"

namespace lm::ops::cuda {

namespace {

constexpr cu::Checker check{"gemm cuda"};

struct Handle {
  cublasHandle_t h = nullptr;
  void* ws = nullptr;
  Handle() {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) check.fail("cublasCreate failed (no device?)");
    // A private workspace lets cuBLAS pick its split-K kernels on any stream.
    const size_t bytes = 32u << 20;
    if (cudaMalloc(&ws, bytes) == cudaSuccess) cublasSetWorkspace(h, ws, bytes);
  }
  ~Handle() {
    if (h) cublasDestroy(h);
    if (ws) cudaFree(ws);
  }
};

// Side streams for grouped products: each group alone is too small to fill the GPU (an expert's 2048 x 768
// product is ~50 tiles on 132 SMs), so groups run concurrently on kSide streams, each with its own cuBLAS handle
// and workspace (a shared workspace would race), forked from and joined back to the caller's stream by events.
constexpr int kSide = 8;
thread_local cublasHandle_t side_handles[kSide] = {};
thread_local cudaStream_t side_streams[kSide] = {};
// The handle bound to a side stream of gemm_bf16_grouped, or null for any other stream.
cublasHandle_t side_handle(void* stream) {
  for (int i = 0; i < kSide; ++i)
    if (side_streams[i] && side_streams[i] == lm::cu::stream(stream)) return side_handles[i];
  return nullptr;
}

bool use_lt() {
  static const bool v = !env::gemm_cublas();
  return v;
}

int64_t few_rows_max() {
  static const int64_t v = std::clamp<int64_t>(env::gemm_few_rows(), 0, kFewRowsMax);
  return v;
}

// Largest power of two (<= 256) dividing both the address and the row stride in bytes: the alignment cuBLASLt
// may assume for every row of the operand.
uint32_t alignment(const void* p, int64_t ld_bytes) {
  const uint64_t a = reinterpret_cast<uint64_t>(p) | static_cast<uint64_t>(ld_bytes) | 256u;
  return static_cast<uint32_t>(a & (~a + 1));
}

// One problem's descriptors and chosen algorithm (column-major view: D [N, M] = op(B) · op(A), see the legend).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // false: no cuBLASLt algorithm, use cublasGemmEx
};
using LtKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, uint32_t,
                         uint32_t, uint32_t>;

struct Lt {
  static constexpr size_t kMaxPlans = 4096;  // beyond: start over (a server meeting ever new shapes)
  cublasLtHandle_t h = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 32u << 20;
  std::map<LtKey, LtPlan> plans;
  Lt() {
    if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) check.fail("cublasLtCreate failed (no device?)");
    if (cudaMalloc(&ws, ws_bytes) != cudaSuccess) ws = nullptr, ws_bytes = 0;
  }
  void clear() {
    for (auto& [k, pl] : plans) {
      if (pl.op) cublasLtMatmulDescDestroy(pl.op);
      for (auto l : {pl.la, pl.lb, pl.lc})
        if (l) cublasLtMatrixLayoutDestroy(l);
    }
    plans.clear();
  }
  ~Lt() {
    clear();
    if (h) cublasLtDestroy(h);
    if (ws) cudaFree(ws);
  }
};

// cuBLASLt's top candidates for the problem, each timed (median of 3 after a warm-up) on the caller's operands
// and a scratch output; the fastest is kept. Runs once per problem (the first call waits for the timings).
// Products under kTimedFlops take the heuristic's first choice untimed: timing them would cost more than it can
// win, and inference meets many small shapes (a new row count per prompt or decode batch).
LtPlan make_plan(Lt& lt, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                 int64_t ldb, float beta, int64_t ldc, DType c_type, const uint32_t (&al)[3], cudaStream_t st) {
  LtPlan pl;
  const cudaDataType_t ct = c_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (cublasLtMatmulDescCreate(&pl.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return pl;
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  if (cublasLtMatrixLayoutCreate(&pl.la, CUDA_R_16BF, tb ? K : N, tb ? N : K, ldb) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.lb, CUDA_R_16BF, ta ? M : K, ta ? K : M, lda) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.lc, ct, N, M, ldc) != CUBLAS_STATUS_SUCCESS)
    return pl;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return pl;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt.ws_bytes,
                                       sizeof lt.ws_bytes);
  const uint32_t a_first = al[1], a_second = al[0], a_c = al[2];  // first operand = B, second = A (the swap)
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_first, sizeof a_first);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &a_second, sizeof a_second);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a_c, sizeof a_c);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a_c, sizeof a_c);
  constexpr int kCand = 8;
  cublasLtMatmulHeuristicResult_t res[kCand];
  int n = 0;
  const cublasStatus_t hs =
      cublasLtMatmulAlgoGetHeuristic(lt.h, pl.op, pl.la, pl.lb, pl.lc, pl.lc, pref, kCand, res, &n);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || n <= 0) return pl;
  int best = 0;
  constexpr double kTimedFlops = 1e10;
  if (n > 1 && 2.0 * double(M) * double(N) * double(K) >= kTimedFlops) {
    const size_t es = c_type == DType::F32 ? 4 : 2;
    void* scratch = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (cudaMalloc(&scratch, size_t(ldc) * size_t(M) * es) == cudaSuccess &&
        cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
      const float one = 1.f;
      float best_ms = 1e30f;
      for (int i = 0; i < n; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        float t[3] = {0, 0, 0};
        bool ok = true;
        for (int r = 0; r < 4 && ok; ++r) {
          cudaEventRecord(e0, st);
          ok = cublasLtMatmul(lt.h, pl.op, &one, B, pl.la, A, pl.lb, &beta, scratch, pl.lc, scratch, pl.lc,
                              &res[i].algo, lt.ws, lt.ws_bytes, st) == CUBLAS_STATUS_SUCCESS;
          cudaEventRecord(e1, st);
          cudaEventSynchronize(e1);
          if (r > 0) cudaEventElapsedTime(&t[r - 1], e0, e1);
        }
        std::sort(t, t + 3);
        if (ok && t[1] < best_ms) best_ms = t[1], best = i;
      }
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (scratch) cudaFree(scratch);
    cudaGetLastError();  // a candidate that failed to launch leaves nothing behind
  }
  pl.algo = res[best].algo;
  pl.ok = true;
  return pl;
}

}  // namespace

void* blas_handle(void* stream) {
  thread_local Handle handle;
  cublasSetStream(handle.h, lm::cu::stream(stream));
  return handle.h;
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
               const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType c_type, void* stream,
               const void* c_src) {
  if (M < 0 || N < 0 || K < 0) check.fail("negative dimension");
  if (c_type != DType::F32 && c_type != DType::BF16) check.fail("C must be F32 or BF16");
  if (M == 0 || N == 0) return;
  if (!lda) lda = ta ? M : K;
  if (!ldb) ldb = tb ? K : N;
  if (!ldc) ldc = N;
  if (beta == 0.f || c_src == C) c_src = nullptr;
  cublasHandle_t h = side_handle(stream);
  if (!h) h = static_cast<cublasHandle_t>(blas_handle(stream));
  const size_t esz = c_type == DType::F32 ? 4 : 2;
  // The paths without a separate C input: C = c_src first, then the product adds in place.
  auto copy_c_src = [&] {
    if (!c_src) return;
    if (cudaMemcpy2DAsync(C, ldc * esz, c_src, ldc * esz, N * esz, M, cudaMemcpyDeviceToDevice,
                          lm::cu::stream(stream)) != cudaSuccess)
      check.fail("cudaMemcpy2DAsync failed");
    c_src = nullptr;
  };
  if (K == 0) {
    copy_c_src();  // C = beta·C without a product (cuBLAS rejects k = 0 on some paths)
    if (beta == 0.f) {
      const size_t es = c_type == DType::F32 ? 4 : 2;
      if (cudaMemset2DAsync(C, ldc * es, 0, N * es, M, lm::cu::stream(stream)) != cudaSuccess)
        check.fail("cudaMemset2DAsync failed");
      return;
    }
    if (beta == 1.f) return;
    check.fail("K == 0 with beta other than 0 or 1");
  }
  if (!ta && tb && M <= few_rows_max() &&
      gemm_bf16_few_rows(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, c_type, stream, c_src))
    return;
  if (use_lt() && !side_handle(stream)) {
    thread_local Lt lt;
    uint32_t ac = alignment(C, ldc * int64_t(esz));
    if (c_src) ac = std::min(ac, alignment(c_src, ldc * int64_t(esz)));
    const uint32_t al[3] = {alignment(A, lda * 2), alignment(B, ldb * 2), ac};
    const LtKey key{ta, tb, M, N, K, lda, ldb, ldc, int(c_type), beta == 0.f, al[0], al[1], al[2]};
    auto it = lt.plans.find(key);
    auto cs = lm::cu::stream(stream);
    if (it == lt.plans.end()) {
      if (lt.plans.size() >= Lt::kMaxPlans) lt.clear();
      it = lt.plans.emplace(key, make_plan(lt, ta, tb, M, N, K, A, lda, B, ldb, beta, ldc, c_type, al, cs)).first;
    }
    const LtPlan& pl = it->second;
    if (pl.ok) {
      const cublasStatus_t s2 = cublasLtMatmul(lt.h, pl.op, &alpha, B, pl.la, A, pl.lb, &beta, c_src ? c_src : C,
                                               pl.lc, C, pl.lc, &pl.algo, lt.ws, lt.ws_bytes, cs);
      if (s2 != CUBLAS_STATUS_SUCCESS)
        check.fail("cublasLtMatmul failed (status " + std::to_string(static_cast<int>(s2)) + ") for M=" +
             std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
      return;
    }
  }
  copy_c_src();
  const cublasStatus_t st = cublasGemmEx(
      h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
      static_cast<int>(K), &alpha, B, CUDA_R_16BF, static_cast<int>(ldb), A, CUDA_R_16BF, static_cast<int>(lda), &beta,
      C, c_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    check.fail("cublasGemmEx failed (status " + std::to_string(static_cast<int>(st)) + ") for M=" + std::to_string(M) +
         " N=" + std::to_string(N) + " K=" + std::to_string(K));
}

void gemm_bf16_strided_batched(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                               int64_t lda, int64_t sA, const void* B, int64_t ldb, int64_t sB, float beta, void* C,
                               int64_t ldc, int64_t sC, int64_t batch, DType c_type, void* stream) {
  if (M < 0 || N < 0 || K <= 0 || batch < 0) check.fail("strided batch: need M, N, batch >= 0 and K > 0");
  if (c_type != DType::F32 && c_type != DType::BF16) check.fail("C must be F32 or BF16");
  if (M == 0 || N == 0 || batch == 0) return;
  if (std::max({M, N, K, lda, ldb, ldc, batch}) > INT32_MAX) check.fail("strided batch: sizes must fit int32");
  auto* h = static_cast<cublasHandle_t>(blas_handle(stream));
  // (column-major view, as gemm_bf16: Cᵀ = op(B)ᵀ op(A)ᵀ)
  const cublasStatus_t st = cublasGemmStridedBatchedEx(
      h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(N), int(M), int(K), &alpha, B,
      CUDA_R_16BF, int(ldb), sB, A, CUDA_R_16BF, int(lda), sA, &beta, C,
      c_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF, int(ldc), sC, int(batch), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    check.fail("cublasGemmStridedBatchedEx failed (status " + std::to_string(static_cast<int>(st)) + ") for M=" +
               std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) + " batch " +
               std::to_string(batch));
}

namespace {

struct SidePool {
  cudaStream_t s[kSide] = {};
  cudaEvent_t done[kSide] = {}, fork = nullptr;
  Handle h[kSide];
  SidePool() {
    for (int i = 0; i < kSide; ++i) {
      if (cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking) != cudaSuccess ||
          cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming) != cudaSuccess)
        check.fail("cannot create the side streams");
      cublasSetStream(h[i].h, s[i]);
      side_handles[i] = h[i].h, side_streams[i] = s[i];
    }
    if (cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) != cudaSuccess) check.fail("cannot create an event");
  }
};

}  // namespace

void gemm_bf16_grouped(bool ta, bool tb, const std::vector<GemmGroup>& groups, float alpha, float beta, DType c_type,
                       void* stream) {
  if (c_type != DType::F32 && c_type != DType::BF16) check.fail("C must be F32 or BF16");
  thread_local SidePool pool;
  auto main = lm::cu::stream(stream);
  if (cudaEventRecord(pool.fork, main) != cudaSuccess) check.fail("cudaEventRecord failed");
  for (int i = 0; i < kSide; ++i) cudaStreamWaitEvent(pool.s[i], pool.fork, 0);
  int next = 0;
  for (const GemmGroup& g : groups) {
    if (g.M == 0 || g.N == 0) continue;
    gemm_bf16(ta, tb, g.M, g.N, g.K, alpha, g.A, g.lda, g.B, g.ldb, beta, g.C, g.ldc, c_type, pool.s[next]);
    next = (next + 1) % kSide;
  }
  for (int i = 0; i < kSide; ++i) {
    cudaEventRecord(pool.done[i], pool.s[i]);
    cudaStreamWaitEvent(main, pool.done[i], 0);
  }
}

void linear_fwd(const void* x, const void* W, void* y, DType y_type, int64_t rows, int64_t in, int64_t out,
                bool accumulate, void* stream, int64_t ldx, int64_t ldy, const void* base) {
  gemm_bf16(false, true, rows, out, in, 1.f, x, ldx ? ldx : in, W, in, accumulate || base ? 1.f : 0.f, y,
            ldy ? ldy : out, y_type, stream, base);
}

void linear_bwd(const void* x, const void* W, const void* dy, void* dx, DType dx_type, float* dW, int64_t rows,
                int64_t in, int64_t out, bool accumulate_dx, void* stream, int64_t ldx, int64_t lddy, int64_t lddx) {
  const int64_t ldy = lddy ? lddy : out;
  if (dx)
    gemm_bf16(false, false, rows, in, out, 1.f, dy, ldy, W, in, accumulate_dx ? 1.f : 0.f, dx, lddx ? lddx : in,
              dx_type, stream);
  if (dW) gemm_bf16(true, false, out, in, rows, 1.f, dy, ldy, x, ldx ? ldx : in, 1.f, dW, in, DType::F32, stream);
}

}  // namespace lm::ops::cuda

// Dense bf16 GEMMs through cuBLAS (row-major wrapper): the model's linear layers and the chunked LM head.
//
// Legend: row-major C [M, N] = op(A) [M, K] · op(B) [K, N]. cuBLAS is column-major, and a row-major matrix
// read column-major is its transpose, so the row-major product C = op(A)·op(B) is computed as the
// column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap places and keep their transpose flags.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/kda/cuda/cuda_error.hpp"

namespace lm::ops::cuda {

namespace {

[[noreturn]] void fail(const std::string& m) { throw Error("gemm cuda: " + m); }

struct Handle {
  cublasHandle_t h = nullptr;
  void* ws = nullptr;
  Handle() {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cublasCreate failed (no device?)");
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
    if (side_streams[i] && side_streams[i] == static_cast<cudaStream_t>(stream)) return side_handles[i];
  return nullptr;
}

}  // namespace

void* blas_handle(void* stream) {
  thread_local Handle handle;
  cublasSetStream(handle.h, static_cast<cudaStream_t>(stream));
  return handle.h;
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
               const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType c_type, void* stream) {
  if (M < 0 || N < 0 || K < 0) fail("negative dimension");
  if (c_type != DType::F32 && c_type != DType::BF16) fail("C must be F32 or BF16");
  if (M == 0 || N == 0) return;
  if (!lda) lda = ta ? M : K;
  if (!ldb) ldb = tb ? K : N;
  if (!ldc) ldc = N;
  cublasHandle_t h = side_handle(stream);
  if (!h) h = static_cast<cublasHandle_t>(blas_handle(stream));
  if (K == 0) {  // C = beta·C without a product (cuBLAS rejects k = 0 on some paths)
    if (beta == 0.f) {
      const size_t es = c_type == DType::F32 ? 4 : 2;
      if (cudaMemset2DAsync(C, ldc * es, 0, N * es, M, static_cast<cudaStream_t>(stream)) != cudaSuccess)
        fail("cudaMemset2DAsync failed");
      return;
    }
    if (beta == 1.f) return;
    fail("K == 0 with beta other than 0 or 1");
  }
  const cublasStatus_t st = cublasGemmEx(
      h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
      static_cast<int>(K), &alpha, B, CUDA_R_16BF, static_cast<int>(ldb), A, CUDA_R_16BF, static_cast<int>(lda), &beta,
      C, c_type == DType::F32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    fail("cublasGemmEx failed (status " + std::to_string(static_cast<int>(st)) + ") for M=" + std::to_string(M) +
         " N=" + std::to_string(N) + " K=" + std::to_string(K));
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
        fail("cannot create the side streams");
      cublasSetStream(h[i].h, s[i]);
      side_handles[i] = h[i].h, side_streams[i] = s[i];
    }
    if (cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) != cudaSuccess) fail("cannot create an event");
  }
};

}  // namespace

void gemm_bf16_grouped(bool ta, bool tb, const std::vector<GemmGroup>& groups, float alpha, float beta, DType c_type,
                       void* stream) {
  if (c_type != DType::F32 && c_type != DType::BF16) fail("C must be F32 or BF16");
  thread_local SidePool pool;
  auto main = static_cast<cudaStream_t>(stream);
  if (cudaEventRecord(pool.fork, main) != cudaSuccess) fail("cudaEventRecord failed");
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
                bool accumulate, void* stream, int64_t ldx, int64_t ldy) {
  gemm_bf16(false, true, rows, out, in, 1.f, x, ldx ? ldx : in, W, in, accumulate ? 1.f : 0.f, y, ldy ? ldy : out,
            y_type, stream);
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

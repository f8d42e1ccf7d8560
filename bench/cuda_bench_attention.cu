// Causal MLA attention on the GPU: forward and forward+backward TFLOP/s, and the absorbed decode's time and
// cache bandwidth. Median of CUDA-event timings after warm-up; prints "RESULT key value" lines that
// bench/peer_attention_moe.py sets beside PyTorch's figures from the same machine and run.
//
// Legend: B batch, T tokens, H heads, Dk/Dv head dims, Tc cached positions.
// FLOPs (the same formula on both sides): causal pairs P = B·H·T²/2; forward 2·P·(Dk + Dv) (S = QKᵀ and PV);
// backward 2·P·(3·Dk + 2·Dv) (S recomputed, dV, dP, dS·K, dSᵀ·Q); forward+backward is their sum.
// The default kernels are the wgmma ones; the mma.sync pair and each wgmma backward alone are timed too
// (fwd_mma, bwd_mma, bwd_wgmma64, bwd_wgmma128; backward alone includes its row statistics and dQ conversion).
// Usage: cuda_bench_attention [reps]   (default 20)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ops/attention/cuda/attention_cuda.hpp"

namespace oc = lm::ops::cuda;

#define CK(x)                                                                                   \
  do {                                                                                          \
    const cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace {

__device__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return x;
}
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float sd) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t a = hash32(uint32_t(i) * 2u + seed * 0x9e3779b9u), b = hash32(uint32_t(i) * 2u + 1u + seed * 0x85ebca6bu);
    const float u1 = (float(a >> 8) + 1.f) / 16777217.f, u2 = float(b >> 8) / 16777216.f;
    p[i] = __float2bfloat16(sd * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}
__nv_bfloat16* rand_bf16(size_t n, uint32_t seed, float sd = 1.f) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * 2));
  fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, sd);
  CK(cudaGetLastError());
  return static_cast<__nv_bfloat16*>(p);
}
template <class F>
double median_ms(F&& f, int warm, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(3, std::atoi(argv[1])) : 20;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  struct Shape {
    int B, T, H, Dk, Dv;
  };
  const std::vector<Shape> shapes = {{1, 8192, 32, 192, 128}, {1, 8192, 64, 192, 128}, {1, 8192, 32, 128, 128},
                                     {4, 4096, 32, 192, 128}};
  for (const Shape& s : shapes) {
    const size_t rows = size_t(s.B) * s.T, nq = rows * s.H * s.Dk, nv = rows * s.H * s.Dv;
    auto *q = rand_bf16(nq, 1), *k = rand_bf16(nq, 2), *v = rand_bf16(nv, 3), *dO = rand_bf16(nv, 4);
    __nv_bfloat16 *o, *dq, *dk, *dv;
    float* lse;
    CK(cudaMalloc(&o, nv * 2));
    CK(cudaMalloc(&dq, nq * 2));
    CK(cudaMalloc(&dk, nq * 2));
    CK(cudaMalloc(&dv, nv * 2));
    CK(cudaMalloc(&lse, rows * s.H * 4));
    CK(cudaDeviceSynchronize());
    oc::AttnShape a;
    a.B = s.B, a.T = s.T, a.H = s.H, a.Dk = s.Dk, a.Dv = s.Dv;
    auto fwd = [&] { oc::attention_forward(a, q, k, v, o, lse); };
    auto fb = [&] {
      oc::attention_forward(a, q, k, v, o, lse);
      oc::attention_backward(a, q, k, v, o, lse, dO, dq, dk, dv);
    };
    const double tf = median_ms(fwd, 3, reps), tfb = median_ms(fb, 2, reps);
    oc::AttnShape am = a;
    am.fwd_kernel = oc::FwdKernel::Mma;
    am.bwd_kernel = oc::BwdKernel::Mma;
    const double tfm = median_ms([&] { oc::attention_forward(am, q, k, v, o, lse); }, 3, reps);
    const double tbm = median_ms([&] { oc::attention_backward(am, q, k, v, o, lse, dO, dq, dk, dv); }, 2, reps);
    oc::AttnShape a64 = a, a128 = a;
    a64.bwd_kernel = oc::BwdKernel::Wgmma;
    a128.bwd_kernel = oc::BwdKernel::Wgmma128;
    const double tb64 = median_ms([&] { oc::attention_backward(a64, q, k, v, o, lse, dO, dq, dk, dv); }, 2, reps);
    const double tb128 = median_ms([&] { oc::attention_backward(a128, q, k, v, o, lse, dO, dq, dk, dv); }, 2, reps);
    const double pairs = double(s.B) * s.H * double(s.T) * s.T / 2;
    const double ff = 2 * pairs * (s.Dk + s.Dv), fbw = 2 * pairs * (3.0 * s.Dk + 2.0 * s.Dv);
    char key[96];
    std::snprintf(key, sizeof key, "attn_B%d_T%d_H%d_%d_%d", s.B, s.T, s.H, s.Dk, s.Dv);
    std::printf("RESULT %s_fwd_ms %.4f\nRESULT %s_fwd_tflops %.1f\n", key, tf, key, ff / tf / 1e9);
    std::printf("RESULT %s_fwdbwd_ms %.4f\nRESULT %s_fwdbwd_tflops %.1f\n", key, tfb, key, (ff + fbw) / tfb / 1e9);
    std::printf("RESULT %s_bwd_tflops %.1f\n", key, fbw / (tfb - tf) / 1e9);
    std::printf("RESULT %s_fwd_mma_tflops %.1f\nRESULT %s_bwd_mma_tflops %.1f\n", key, ff / tfm / 1e9, key,
                fbw / tbm / 1e9);
    std::printf("RESULT %s_bwd_wgmma64_tflops %.1f\nRESULT %s_bwd_wgmma128_tflops %.1f\n", key, fbw / tb64 / 1e9, key,
                fbw / tb128 / 1e9);
    std::printf("RESULT %s_bwd_wgmma64_ms %.4f\nRESULT %s_bwd_wgmma128_ms %.4f\n", key, tb64, key, tb128);
    std::fflush(stdout);
    for (void* p : std::vector<void*>{q, k, v, dO, o, dq, dk, dv, lse}) CK(cudaFree(p));
  }

  // Absorbed decode over the 576-wide latent cache: one query per head, bytes = the cache read once.
  struct Dec {
    int H, Tc;
  };
  for (const Dec d : {Dec{64, 32768}, Dec{128, 32768}, Dec{16, 131072}}) {
    auto* ql = rand_bf16(size_t(d.H) * 512, 5, 0.5f);
    auto* qr = rand_bf16(size_t(d.H) * 64, 6, 0.5f);
    auto* cache = rand_bf16(size_t(d.Tc) * 576, 7);
    __nv_bfloat16* ol;
    CK(cudaMalloc(&ol, size_t(d.H) * 512 * 2));
    oc::DecodeShape ds;
    ds.H = d.H, ds.Tc = d.Tc;
    const double t = median_ms([&] { oc::mla_decode(ds, ql, qr, cache, ol, nullptr); }, 5, reps * 2);
    const double bytes = double(d.Tc) * 576 * 2, flop = 2.0 * d.H * d.Tc * (576 + 512);
    std::printf("RESULT decode_H%d_Tc%d_us %.2f\nRESULT decode_H%d_Tc%d_tbps %.2f\nRESULT decode_H%d_Tc%d_tflops %.1f\n",
                d.H, d.Tc, t * 1e3, d.H, d.Tc, bytes / t / 1e9, d.H, d.Tc, flop / t / 1e9);
    for (void* p : std::vector<void*>{ql, qr, cache, ol}) CK(cudaFree(p));
  }
  return 0;
}
